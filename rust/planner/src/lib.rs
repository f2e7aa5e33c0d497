//! fsdp-rs planner: all sharding arithmetic for fully sharded data parallelism,
//! as plain Rust over flat integer arrays. No Python, no tensors: the
//! `fsdp-rs-python` crate binds it, and the runtime hands its tables to kernels.
//!
//! - [`GroupPlan`]: FSDP2 per-parameter metadata, the group-buffer row layout
//!   and the copy tile table ([Note: FSDP2 sharding rule], [Note: Row layout],
//!   [Note: Tile table] in `group.rs`).
//! - [`FlatPlan`]: FSDP1 flat-parameter metadata ([Note: FSDP1 flat sharding]).
//! - [`peak_memory`]: peak bytes over a sequence of groups ([Note: Memory model]).
//! - [`GroupPlan::fingerprint`]: a rank-independent digest of a plan, compared
//!   across ranks before the first collective ([Note: Plan fingerprints]).
//! - [`module_groups`]: which consecutive modules share one `fully_shard` group
//!   ([Note: Module grouping]).

pub mod alloc;
mod arith;
mod error;
mod fingerprint;
mod flat;
mod group;
mod memory;
mod modules;
mod parallel;
mod shapes;

pub use error::{PlanError, Result};
pub use fingerprint::Fingerprint;
pub use flat::{FlatPlan, NOT_IN_SHARD};
pub use group::{BufferBytes, GroupConfig, GroupPlan, DEFAULT_ALIGNMENT, DEFAULT_TILE_NUMEL};
pub use memory::{peak_memory, GroupBytes, PeakMemory, Schedule};
pub use modules::module_groups;
pub use shapes::Shapes;
