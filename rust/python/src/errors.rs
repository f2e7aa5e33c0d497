//! The one place planner errors and panics become Python exceptions.

use fsdp_rs_planner::PlanError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Every planner error is a bad value the caller passed: a ValueError whose
/// message names the parameter and the fix.
pub fn to_py_err(err: PlanError) -> PyErr {
    match err {
        PlanError::WorldSize { .. }
        | PlanError::Rank { .. }
        | PlanError::PostForwardWorldSize { .. }
        | PlanError::Alignment { .. }
        | PlanError::ElemSize { .. }
        | PlanError::TileNumel { .. }
        | PlanError::TooManyTiles { .. }
        | PlanError::TooManyParams { .. }
        | PlanError::DimsLength { .. }
        | PlanError::ScalarParam { .. }
        | PlanError::NegativeNdim { .. }
        | PlanError::NegativeDim { .. }
        | PlanError::Overflow { .. }
        | PlanError::AlignedNumel { .. }
        | PlanError::GroupLengths { .. }
        | PlanError::NegativeBytes { .. }
        | PlanError::NegativeCount { .. }
        | PlanError::GroupBudget { .. }
        | PlanError::UnitLengths { .. } => PyValueError::new_err(err.to_string()),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic")
}

/// Run planner code, turning its errors into ValueError and any panic (a bug)
/// into RuntimeError, so no Rust panic ever reaches Python as PanicException.
pub fn run_planner<T>(f: impl FnOnce() -> Result<T, PlanError>) -> Result<T, PyErr> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(to_py_err),
        Err(payload) => Err(PyRuntimeError::new_err(format!(
            "internal error in the fsdp-rs planner (please report it): {}",
            panic_message(payload.as_ref())
        ))),
    }
}
