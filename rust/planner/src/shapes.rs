//! Validated parameter shapes: the flat `(ndims, dims)` input every planner takes.

use crate::error::{PlanError, Result};

/// Shapes of a parameter group with every ndim >= 1 and `sum(ndims)` sizes.
/// Sizes are checked per parameter by [`checked_numel`], inside the planners'
/// (parallel) passes, so the input is read once.
#[derive(Debug, Clone, Copy)]
pub struct Shapes<'a> {
    ndims: &'a [i64],
    dims: &'a [i64],
}

impl<'a> Shapes<'a> {
    /// Check `ndims` against `dims` (the shapes concatenated in parameter order).
    pub fn new(ndims: &'a [i64], dims: &'a [i64]) -> Result<Self> {
        if ndims.len() > i32::MAX as usize {
            return Err(PlanError::TooManyParams {
                num_params: ndims.len(),
            });
        }
        let mut total: i64 = 0;
        for (index, &ndim) in ndims.iter().enumerate() {
            if ndim == 0 {
                return Err(PlanError::ScalarParam { index });
            }
            if ndim < 0 {
                return Err(PlanError::NegativeNdim { index, ndim });
            }
            total = total.saturating_add(ndim);
        }
        if total != dims.len() as i64 {
            return Err(PlanError::DimsLength {
                expected: total,
                got: dims.len(),
            });
        }
        Ok(Self { ndims, dims })
    }

    /// Cut the group into contiguous ranges starting at the given parameter
    /// indices (`bounds` ascending, first 0, last `len()`). Each item is
    /// `(first param index, shapes of the range)`.
    pub fn split(&self, bounds: &[usize]) -> Vec<(usize, Shapes<'a>)> {
        let mut out = Vec::with_capacity(bounds.len().saturating_sub(1));
        let mut dim_start = 0usize;
        for pair in bounds.windows(2) {
            let ndims = &self.ndims[pair[0]..pair[1]];
            let dim_len = ndims.iter().sum::<i64>() as usize;
            let dims = &self.dims[dim_start..dim_start + dim_len];
            out.push((pair[0], Shapes { ndims, dims }));
            dim_start += dim_len;
        }
        out
    }

    pub fn len(&self) -> usize {
        self.ndims.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ndims.is_empty()
    }

    pub fn total_dims(&self) -> usize {
        self.dims.len()
    }

    /// Iterate over each parameter's shape, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a [i64]> + 'a {
        let dims = self.dims;
        let mut start = 0usize;
        self.ndims.iter().map(move |&ndim| {
            let shape = &dims[start..start + ndim as usize];
            start += ndim as usize;
            shape
        })
    }
}

/// Parameter `index`'s numel, after checking every size is >= 0 and the
/// running product (in dim order, as torch computes it) fits an `i64`.
#[inline]
pub fn checked_numel(index: usize, shape: &[i64]) -> Result<i64> {
    let mut numel: i64 = 1;
    for (axis, &size) in shape.iter().enumerate() {
        if size < 0 {
            return Err(PlanError::NegativeDim { index, axis, size });
        }
        numel = numel.checked_mul(size).ok_or(PlanError::Overflow {
            index: Some(index),
            what: "numel",
        })?;
    }
    Ok(numel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes() {
        assert_eq!(
            Shapes::new(&[1, 0], &[3]).unwrap_err(),
            PlanError::ScalarParam { index: 1 }
        );
        assert_eq!(
            Shapes::new(&[-1], &[]).unwrap_err(),
            PlanError::NegativeNdim { index: 0, ndim: -1 }
        );
        assert_eq!(
            Shapes::new(&[2], &[3]).unwrap_err(),
            PlanError::DimsLength {
                expected: 2,
                got: 1
            }
        );
        assert_eq!(
            checked_numel(1, &[4, -5]).unwrap_err(),
            PlanError::NegativeDim {
                index: 1,
                axis: 1,
                size: -5
            }
        );
        assert_eq!(
            checked_numel(0, &[1 << 40, 1 << 40, 0]).unwrap_err(),
            PlanError::Overflow {
                index: Some(0),
                what: "numel"
            }
        );
        assert_eq!(checked_numel(0, &[0, 1 << 40, 1 << 40]), Ok(0));
    }

    #[test]
    fn iterates_shapes_in_order() {
        let shapes = Shapes::new(&[3, 1], &[0, 5, 7, 2]).unwrap();
        let all: Vec<&[i64]> = shapes.iter().collect();
        assert_eq!(all, vec![&[0, 5, 7][..], &[2][..]]);
    }
}
