//! The `GroupPlan` and `FlatPlan` Python classes: immutable holders of planner
//! output whose tables are handed out zero-copy.

use crate::arrays::readonly_view;
use fsdp_rs_planner as planner;
use numpy::PyArray1;
use pyo3::prelude::*;

/// FSDP2 metadata and the group-buffer plan for one parameter group.
#[pyclass(module = "fsdp_rs._core", frozen)]
pub struct GroupPlan {
    pub plan: planner::GroupPlan,
}

/// One `#[pymethods]` block per class: zero-copy getters for the listed tables
/// (each a planner accessor returning a slice), then the class's other methods.
macro_rules! plan_methods {
    ($class:ty, tables { $($name:ident: $elem:ty),* $(,)? } $($methods:tt)*) => {
        #[pymethods]
        impl $class {
            $(
                #[getter]
                fn $name<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<$elem>> {
                    readonly_view(slf.get().plan.$name(), slf.as_any())
                }
            )*
            $($methods)*
        }
    };
}

plan_methods!(
    GroupPlan,
    tables {
    dim_offsets: i64,
    numel: i64,
    chunk_rows: i64,
    sharded_rows: i64,
    sharded_numel: i64,
    padded_sharded_numel: i64,
    sharded_sizes: i64,
    padded_sharded_sizes: i64,
    contiguous_strides: i64,
    row_offsets: i64,
    split_sizes: i64,
    unsharded_offsets: i64,
    tile_param: i32,
    tile_start: i64,
    tile_len: i32,
    }
    #[getter]
    fn post_forward_sizes<'py>(slf: &Bound<'py, Self>) -> Option<Bound<'py, PyArray1<i64>>> {
        let sizes = slf.get().plan.post_forward_sizes()?;
        Some(readonly_view(sizes, slf.as_any()))
    }
    #[getter]
    fn num_params(&self) -> usize {
        self.plan.num_params()
    }
    #[getter]
    fn world_size(&self) -> i64 {
        self.plan.config.world_size
    }
    #[getter]
    fn rank(&self) -> i64 {
        self.plan.config.rank
    }
    #[getter]
    fn post_forward_world_size(&self) -> Option<i64> {
        self.plan.config.post_forward_world_size
    }
    #[getter]
    fn post_forward_rank(&self) -> Option<i64> {
        self.plan.config.post_forward_rank()
    }
    #[getter]
    fn orig_elem_size(&self) -> i64 {
        self.plan.config.orig_elem_size
    }
    #[getter]
    fn param_elem_size(&self) -> i64 {
        self.plan.config.param_elem_size
    }
    #[getter]
    fn reduce_elem_size(&self) -> i64 {
        self.plan.config.reduce_elem_size
    }
    #[getter]
    fn alignment(&self) -> i64 {
        self.plan.config.alignment
    }
    #[getter]
    fn align_numel(&self) -> i64 {
        self.plan.align_numel
    }
    #[getter]
    fn tile_numel(&self) -> i64 {
        self.plan.config.tile_numel
    }
    #[getter]
    fn row_numel(&self) -> i64 {
        self.plan.row_numel
    }
    #[getter]
    fn unsharded_numel(&self) -> i64 {
        self.plan.unsharded_numel
    }
    #[getter]
    fn num_tiles(&self) -> usize {
        self.plan.num_tiles()
    }
    #[getter]
    fn sharded_bytes(&self) -> i64 {
        self.plan.bytes.sharded
    }
    #[getter]
    fn all_gather_bytes(&self) -> i64 {
        self.plan.bytes.all_gather
    }
    #[getter]
    fn unsharded_bytes(&self) -> i64 {
        self.plan.bytes.unsharded
    }
    #[getter]
    fn reduce_scatter_input_bytes(&self) -> i64 {
        self.plan.bytes.reduce_scatter_input
    }
    #[getter]
    fn reduce_scatter_output_bytes(&self) -> i64 {
        self.plan.bytes.reduce_scatter_output
    }
    #[getter]
    fn plan_bytes(&self) -> usize {
        self.plan.plan_bytes()
    }
    /// The plan's rank-independent digest; see `_core.pyi`.
    fn fingerprint(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.plan.fingerprint())
    }
    fn __len__(&self) -> usize {
        self.plan.num_params()
    }
    fn __repr__(&self) -> String {
        let c = &self.plan.config;
        format!(
            "GroupPlan(num_params={}, world_size={}, rank={}, row_numel={}, unsharded_numel={}, \
             num_tiles={}, plan_bytes={})",
            self.plan.num_params(),
            c.world_size,
            c.rank,
            self.plan.row_numel,
            self.plan.unsharded_numel,
            self.plan.num_tiles(),
            self.plan.plan_bytes()
        )
    }
);

/// FSDP1 `FlatParamHandle` metadata for one parameter group.
#[pyclass(module = "fsdp_rs._core", frozen)]
pub struct FlatPlan {
    pub plan: planner::FlatPlan,
}

plan_methods!(
    FlatPlan,
    tables {
    flat_offsets: i64,
    numel: i64,
    in_shard: bool,
    offset_in_shard: i64,
    numel_in_shard: i64,
    intra_param_start: i64,
    intra_param_end: i64,
    }
    #[getter]
    fn num_params(&self) -> usize {
        self.plan.num_params()
    }
    #[getter]
    fn world_size(&self) -> i64 {
        self.plan.world_size
    }
    #[getter]
    fn rank(&self) -> i64 {
        self.plan.rank
    }
    #[getter]
    fn aligned_numel(&self) -> i64 {
        self.plan.aligned_numel
    }
    #[getter]
    fn flat_numel(&self) -> i64 {
        self.plan.flat_numel
    }
    #[getter]
    fn shard_numel(&self) -> i64 {
        self.plan.shard_numel
    }
    #[getter]
    fn shard_numel_padded(&self) -> i64 {
        self.plan.shard_numel_padded
    }
    #[getter]
    fn plan_bytes(&self) -> usize {
        self.plan.plan_bytes()
    }
    fn __len__(&self) -> usize {
        self.plan.num_params()
    }
    fn __repr__(&self) -> String {
        format!(
            "FlatPlan(num_params={}, world_size={}, rank={}, flat_numel={}, shard_numel={})",
            self.plan.num_params(),
            self.plan.world_size,
            self.plan.rank,
            self.plan.flat_numel,
            self.plan.shard_numel
        )
    }
);
