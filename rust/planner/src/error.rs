//! The planner's one error type. Every variant says what was wrong and how to
//! fix it; the Python binding maps each variant to a Python exception in one place.

use std::fmt;

/// Why a plan could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// `world_size` below 1.
    WorldSize { world_size: i64 },
    /// `rank` outside `[0, world_size)`.
    Rank { rank: i64, world_size: i64 },
    /// A post-forward world size that is not a divisor of the world size.
    PostForwardWorldSize {
        post_forward_world_size: i64,
        world_size: i64,
    },
    /// An alignment that is not a positive power of two.
    Alignment { alignment: i64 },
    /// An element size (bytes per element) that is not a positive power of two.
    ElemSize { name: &'static str, size: i64 },
    /// A tile size outside `[1, i32::MAX]`.
    TileNumel { tile_numel: i64 },
    /// A tile table longer than a CUDA grid dimension (`i32::MAX` tiles).
    TooManyTiles { num_tiles: i64, tile_numel: i64 },
    /// More parameters than an int32 tile table can index.
    TooManyParams { num_params: usize },
    /// `dims` does not hold `sum(ndims)` entries.
    DimsLength { expected: i64, got: usize },
    /// A 0-dim (scalar) parameter: FSDP2 shards dim 0 and rejects it.
    ScalarParam { index: usize },
    /// A negative entry in `ndims`.
    NegativeNdim { index: usize, ndim: i64 },
    /// A negative size in a parameter's shape.
    NegativeDim {
        index: usize,
        axis: usize,
        size: i64,
    },
    /// A size, offset or byte count past `i64::MAX`.
    Overflow {
        index: Option<usize>,
        what: &'static str,
    },
    /// A negative FSDP1 `aligned_numel`.
    AlignedNumel { aligned_numel: i64 },
    /// Per-group arrays of different lengths (memory model).
    GroupLengths {
        name: &'static str,
        expected: usize,
        got: usize,
    },
    /// A negative byte count (memory model).
    NegativeBytes {
        name: &'static str,
        index: usize,
        value: i64,
    },
    /// A negative prefetch depth or resident byte count (memory model).
    NegativeCount { name: &'static str, value: i64 },
    /// A module-group byte budget below 1 (module grouping).
    GroupBudget { budget: i64 },
    /// Per-unit arrays of different lengths (module grouping).
    UnitLengths { bytes: usize, boundaries: usize },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WorldSize { world_size } => write!(
                f,
                "world_size must be >= 1, got {world_size}: pass the size of the shard mesh dimension"
            ),
            Self::Rank { rank, world_size } => write!(
                f,
                "rank must be in [0, world_size) = [0, {world_size}), got {rank}: pass this \
                 process's rank in the shard mesh dimension"
            ),
            Self::PostForwardWorldSize { post_forward_world_size, world_size } => write!(
                f,
                "post_forward_world_size must divide world_size {world_size} and lie in \
                 [1, {world_size}], got {post_forward_world_size}: pick a divisor (e.g. the \
                 number of ranks per node) or pass None"
            ),
            Self::Alignment { alignment } => write!(
                f,
                "alignment must be a positive power of two (bytes), got {alignment}: use 16, \
                 the alignment Inductor assumes"
            ),
            Self::ElemSize { name, size } => write!(
                f,
                "{name} must be a positive power of two (bytes per element, e.g. \
                 torch.float32.itemsize == 4), got {size}"
            ),
            Self::TileNumel { tile_numel } => write!(
                f,
                "tile_numel must be in [1, 2**31 - 1], got {tile_numel}: use the default \
                 (65536) unless tuning kernels"
            ),
            Self::TooManyTiles { num_tiles, tile_numel } => write!(
                f,
                "the copy tile table would hold {num_tiles} tiles of {tile_numel} elements, \
                 more than a kernel grid allows (2**31 - 1): raise tile_numel or split the group"
            ),
            Self::TooManyParams { num_params } => write!(
                f,
                "a group holds {num_params} parameters, more than 2**31 - 1: split it into \
                 several fully_shard groups"
            ),
            Self::DimsLength { expected, got } => write!(
                f,
                "dims must hold sum(ndims) = {expected} sizes, got {got}: pass every \
                 parameter's shape concatenated, in the order of ndims"
            ),
            Self::ScalarParam { index } => write!(
                f,
                "parameter {index} is 0-dim (a scalar); FSDP2 shards dim 0 and cannot shard \
                 it: reshape it to (1,) or leave it out of the group (ignored_params)"
            ),
            Self::NegativeNdim { index, ndim } => write!(
                f,
                "parameter {index} has ndim {ndim}; ndims entries must be >= 1"
            ),
            Self::NegativeDim { index, axis, size } => write!(
                f,
                "parameter {index} has size {size} in dim {axis}; sizes must be >= 0"
            ),
            Self::Overflow { index: Some(index), what } => write!(
                f,
                "parameter {index}: {what} exceeds 2**63 - 1; check its shape (a size may be \
                 corrupt) or split the group"
            ),
            Self::Overflow { index: None, what } => write!(
                f,
                "{what} exceeds 2**63 - 1; split the group into smaller fully_shard groups"
            ),
            Self::AlignedNumel { aligned_numel } => write!(
                f,
                "aligned_numel must be >= 0, got {aligned_numel}: use 16 // itemsize for \
                 use_orig_params=True, 0 otherwise"
            ),
            Self::GroupLengths { name, expected, got } => write!(
                f,
                "{name} has {got} groups but sharded_bytes has {expected}: pass one entry per \
                 group for every array"
            ),
            Self::NegativeBytes { name, index, value } => write!(
                f,
                "{name}[{index}] is {value}; byte counts must be >= 0"
            ),
            Self::NegativeCount { name, value } => {
                write!(f, "{name} must be >= 0, got {value}")
            }
            Self::GroupBudget { budget } => write!(
                f,
                "group_bytes must be >= 1, got {budget}: pass the unsharded bytes a group may \
                 hold (e.g. 2**27 for 128 MiB)"
            ),
            Self::UnitLengths { bytes, boundaries } => write!(
                f,
                "unit_bytes has {bytes} entries but boundary_before has {boundaries}: pass one \
                 entry per module in both"
            ),
        }
    }
}

impl std::error::Error for PlanError {}

pub type Result<T> = std::result::Result<T, PlanError>;
