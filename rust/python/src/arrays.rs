//! NumPy at the boundary: int64 inputs are checked and copied in, output tables
//! go out as read-only arrays over memory the plan object owns.

use numpy::ndarray::ArrayView1;
use numpy::{Element, PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

/// Copy a 1-D int64 NumPy array (any strides) into a Vec; anything else is a
/// TypeError that says what to pass. Copying lets planning run without the GIL
/// while Python threads may write to the caller's array.
pub fn int64_vec(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Ok(array) = obj.cast::<PyArray1<i64>>() {
        let array = array.readonly();
        return Ok(match array.as_slice() {
            Ok(slice) => fsdp_rs_planner::alloc::copied(slice),
            Err(_) => array.as_array().iter().copied().collect(),
        });
    }
    let found = match obj.cast::<PyUntypedArray>() {
        Ok(array) => format!("a {}-D array of dtype {}", array.ndim(), array.dtype()),
        Err(_) => format!("{}", obj.get_type().name()?),
    };
    Err(PyTypeError::new_err(format!(
        "{name} must be a 1-D numpy array of dtype int64, got {found}: convert it with \
         numpy.asarray({name}, dtype=numpy.int64).ravel() (fsdp_rs.planning.shapes_to_arrays \
         builds ndims and dims from a list of shapes)"
    )))
}

/// One bool per group: a Python bool repeated `count` times, or a 1-D NumPy
/// bool array (any strides); anything else is a TypeError that says what to pass.
pub fn bool_vec(obj: &Bound<'_, PyAny>, count: usize, name: &str) -> PyResult<Vec<bool>> {
    if let Ok(flag) = obj.cast::<PyBool>() {
        return Ok(vec![flag.is_true(); count]);
    }
    if let Ok(array) = obj.cast::<PyArray1<bool>>() {
        return Ok(array.readonly().as_array().iter().copied().collect());
    }
    Err(PyTypeError::new_err(format!(
        "{name} must be a bool or a 1-D numpy array of dtype bool (one per group), got {}: \
         convert it with numpy.asarray({name}, dtype=bool)",
        obj.get_type().name()?
    )))
}

/// A read-only 1-D array over `data`, kept alive by `owner` (its `base`).
///
/// The owner must be a frozen pyclass whose tables are never mutated or
/// reallocated after construction, so the memory outlives every array.
pub fn readonly_view<'py, T: Element>(
    data: &[T],
    owner: &Bound<'py, PyAny>,
) -> Bound<'py, PyArray1<T>> {
    let view = ArrayView1::from(data);
    // SAFETY: `data` lives inside `owner`, which the array holds as its base
    // object; the owner is immutable, so `data` is neither freed nor moved
    // while the array exists.
    let array = unsafe { PyArray1::borrow_from_array(&view, owner.clone()) };
    array.readwrite().make_nonwriteable();
    array
}
