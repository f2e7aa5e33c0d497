//! `fsdp_rs._core`: thin PyO3 bindings over `fsdp-rs-planner`. Arguments are
//! checked and copied in with the GIL held; planning runs with it released.

mod arrays;
mod errors;
mod plans;

use arrays::{bool_vec, int64_vec};
use errors::run_planner;
use fsdp_rs_planner as planner;
use numpy::PyArray1;
use plans::{FlatPlan, GroupPlan};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Plan one FSDP2 parameter group (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (
    ndims, dims, world_size, rank, *, orig_elem_size = 4, param_elem_size = None,
    reduce_elem_size = None, alignment = planner::DEFAULT_ALIGNMENT,
    post_forward_world_size = None, tile_numel = planner::DEFAULT_TILE_NUMEL,
))]
#[allow(clippy::too_many_arguments)]
fn plan_group(
    py: Python<'_>,
    ndims: &Bound<'_, PyAny>,
    dims: &Bound<'_, PyAny>,
    world_size: i64,
    rank: i64,
    orig_elem_size: i64,
    param_elem_size: Option<i64>,
    reduce_elem_size: Option<i64>,
    alignment: i64,
    post_forward_world_size: Option<i64>,
    tile_numel: i64,
) -> PyResult<GroupPlan> {
    let ndims = int64_vec(ndims, "ndims")?;
    let dims = int64_vec(dims, "dims")?;
    let config = planner::GroupConfig {
        world_size,
        rank,
        orig_elem_size,
        param_elem_size: param_elem_size.unwrap_or(orig_elem_size),
        reduce_elem_size: reduce_elem_size.unwrap_or(orig_elem_size),
        alignment,
        post_forward_world_size,
        tile_numel,
    };
    let plan = py.detach(|| {
        run_planner(|| planner::GroupPlan::new(&planner::Shapes::new(&ndims, &dims)?, config))
    })?;
    Ok(GroupPlan { plan })
}

/// FSDP1 flat-parameter metadata for one group (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (ndims, dims, world_size, rank, *, aligned_numel = 0))]
fn plan_flat(
    py: Python<'_>,
    ndims: &Bound<'_, PyAny>,
    dims: &Bound<'_, PyAny>,
    world_size: i64,
    rank: i64,
    aligned_numel: i64,
) -> PyResult<FlatPlan> {
    let ndims = int64_vec(ndims, "ndims")?;
    let dims = int64_vec(dims, "dims")?;
    let plan = py.detach(|| {
        run_planner(|| {
            let shapes = planner::Shapes::new(&ndims, &dims)?;
            planner::FlatPlan::new(&shapes, world_size, rank, aligned_numel)
        })
    })?;
    Ok(FlatPlan { plan })
}

/// Peak bytes of one training step (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (
    sharded_bytes, all_gather_bytes, unsharded_bytes, reduce_scatter_input_bytes,
    reduce_scatter_output_bytes, *, prefetch = 1, forward_prefetch = 0,
    reshard_after_forward = None, gradient_bytes = None, unsharded_gradient_bytes = None,
    accumulated_gradient_bytes = None, activation_bytes = None, post_forward_bytes = None, output_bytes = None,
    backward_bytes = None, reduce_scatter_kept_bytes = None,
    resident_bytes = 0, loss_bytes = 0, accumulate = false, side_streams = true,
))]
#[allow(clippy::too_many_arguments)]
fn peak_memory<'py>(
    py: Python<'py>,
    sharded_bytes: &Bound<'py, PyAny>,
    all_gather_bytes: &Bound<'py, PyAny>,
    unsharded_bytes: &Bound<'py, PyAny>,
    reduce_scatter_input_bytes: &Bound<'py, PyAny>,
    reduce_scatter_output_bytes: &Bound<'py, PyAny>,
    prefetch: i64,
    forward_prefetch: i64,
    reshard_after_forward: Option<&Bound<'py, PyAny>>,
    gradient_bytes: Option<&Bound<'py, PyAny>>,
    unsharded_gradient_bytes: Option<&Bound<'py, PyAny>>,
    accumulated_gradient_bytes: Option<&Bound<'py, PyAny>>,
    activation_bytes: Option<&Bound<'py, PyAny>>,
    post_forward_bytes: Option<&Bound<'py, PyAny>>,
    output_bytes: Option<&Bound<'py, PyAny>>,
    backward_bytes: Option<&Bound<'py, PyAny>>,
    reduce_scatter_kept_bytes: Option<&Bound<'py, PyAny>>,
    resident_bytes: i64,
    loss_bytes: i64,
    accumulate: bool,
    side_streams: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let sharded = int64_vec(sharded_bytes, "sharded_bytes")?;
    let all_gather = int64_vec(all_gather_bytes, "all_gather_bytes")?;
    let unsharded = int64_vec(unsharded_bytes, "unsharded_bytes")?;
    let rs_in = int64_vec(reduce_scatter_input_bytes, "reduce_scatter_input_bytes")?;
    let rs_out = int64_vec(reduce_scatter_output_bytes, "reduce_scatter_output_bytes")?;
    let n = sharded.len();
    let or = |given: Option<&Bound<'py, PyAny>>, name: &str, default: &[i64]| match given {
        Some(obj) => int64_vec(obj, name),
        None => Ok(default.to_vec()),
    };
    let zeros = vec![0; n];
    let gradient = or(gradient_bytes, "gradient_bytes", &rs_out)?;
    let ugrad = or(
        unsharded_gradient_bytes,
        "unsharded_gradient_bytes",
        &unsharded,
    )?;
    let accumulated = or(
        accumulated_gradient_bytes,
        "accumulated_gradient_bytes",
        &ugrad,
    )?;
    let activation = or(activation_bytes, "activation_bytes", &zeros)?;
    let post_forward = or(post_forward_bytes, "post_forward_bytes", &zeros)?;
    let output = or(output_bytes, "output_bytes", &zeros)?;
    let backward = or(backward_bytes, "backward_bytes", &zeros)?;
    let rs_kept = or(
        reduce_scatter_kept_bytes,
        "reduce_scatter_kept_bytes",
        &rs_in,
    )?;
    let reshard = match reshard_after_forward {
        None => vec![true; n],
        Some(obj) => bool_vec(obj, n, "reshard_after_forward")?,
    };
    let groups = planner::GroupBytes {
        sharded: &sharded,
        all_gather: &all_gather,
        unsharded: &unsharded,
        reduce_scatter_input: &rs_in,
        reduce_scatter_output: &rs_out,
        reduce_scatter_kept: &rs_kept,
        gradient: &gradient,
        unsharded_gradient: &ugrad,
        accumulated_gradient: &accumulated,
        activation: &activation,
        post_forward: &post_forward,
        output: &output,
        backward: &backward,
    };
    let schedule = planner::Schedule {
        prefetch,
        forward_prefetch,
        reshard_after_forward: &reshard,
        resident: resident_bytes,
        loss: loss_bytes,
        accumulate,
        side_streams,
    };
    let peak = run_planner(|| planner::peak_memory(groups, schedule))?;
    let out = PyDict::new(py);
    out.set_item("persistent", peak.persistent)?;
    out.set_item("forward", peak.forward)?;
    out.set_item("backward", peak.backward)?;
    out.set_item("peak", peak.peak)?;
    Ok(out)
}

/// The group of each module unit, consecutive units merged up to `group_bytes`
/// (see `_core.pyi` and [Note: Module grouping]).
#[pyfunction]
fn module_groups<'py>(
    py: Python<'py>,
    unit_bytes: &Bound<'py, PyAny>,
    boundary_before: &Bound<'py, PyAny>,
    group_bytes: i64,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let bytes = int64_vec(unit_bytes, "unit_bytes")?;
    let boundaries = bool_vec(boundary_before, bytes.len(), "boundary_before")?;
    let groups =
        py.detach(|| run_planner(|| planner::module_groups(&bytes, &boundaries, group_bytes)))?;
    Ok(PyArray1::from_vec(py, groups))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_ALIGNMENT", planner::DEFAULT_ALIGNMENT)?;
    m.add("DEFAULT_TILE_NUMEL", planner::DEFAULT_TILE_NUMEL)?;
    m.add_class::<GroupPlan>()?;
    m.add_class::<FlatPlan>()?;
    m.add_function(wrap_pyfunction!(plan_group, m)?)?;
    m.add_function(wrap_pyfunction!(plan_flat, m)?)?;
    m.add_function(wrap_pyfunction!(peak_memory, m)?)?;
    m.add_function(wrap_pyfunction!(module_groups, m)?)?;
    Ok(())
}
