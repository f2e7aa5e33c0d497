"""Type stubs for ``fsdp_rs._core``, the Rust sharding planner.

Every table is a read-only, one-dimensional NumPy array whose memory is owned
by the plan object (``array.base is plan``); reading a table twice returns two
arrays over the same memory. Sizes and offsets are in elements, not bytes,
unless a name ends in ``_bytes``.

Inputs describe a group of ``P`` parameters as two flat int64 arrays:
``ndims`` (``P`` entries, each >= 1) and ``dims`` (the shapes concatenated,
``sum(ndims)`` entries, each >= 0). See [Note: Row layout] in
``rust/planner/src/group.rs`` for the buffer layout.
"""

from typing import final

import numpy as np
import numpy.typing as npt

__version__: str

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]

DEFAULT_ALIGNMENT: int
DEFAULT_TILE_NUMEL: int

@final
class GroupPlan:
    """FSDP2 metadata and the group-buffer plan for one parameter group."""

    num_params: int
    world_size: int
    rank: int
    post_forward_world_size: int | None
    post_forward_rank: int | None
    orig_elem_size: int
    param_elem_size: int
    reduce_elem_size: int
    alignment: int
    align_numel: int
    """Element alignment of every row segment and unsharded segment:
    ``alignment // min(orig, param, reduce elem size)`` (at least 1)."""
    tile_numel: int
    row_numel: int
    """``S``: elements in the sharded buffer, in one all-gather row and in one
    reduce-scatter row (all three share the row layout)."""
    unsharded_numel: int
    num_tiles: int

    # per-parameter FSDP2 metadata (P entries unless noted)
    @property
    def dim_offsets(self) -> Int64Array:
        """P + 1 entries: param p's dims are ``dims[dim_offsets[p]:dim_offsets[p+1]]``
        in every concatenated size/stride table."""
    @property
    def numel(self) -> Int64Array: ...
    @property
    def chunk_rows(self) -> Int64Array:
        """``ceil(d0 / W)``: rows of every padded shard (torch.chunk rule)."""
    @property
    def sharded_rows(self) -> Int64Array:
        """Rows this rank owns, unpadded (possibly 0)."""
    @property
    def sharded_numel(self) -> Int64Array: ...
    @property
    def padded_sharded_numel(self) -> Int64Array:
        """``n = chunk_rows * prod(dims[1:])``."""
    @property
    def sharded_sizes(self) -> Int64Array:
        """Concatenated; equals torch FSDP2's ``FSDPParam.sharded_size``."""
    @property
    def padded_sharded_sizes(self) -> Int64Array:
        """Concatenated; equals ``FSDPParam.padded_sharded_param_size``."""
    @property
    def contiguous_strides(self) -> Int64Array:
        """Concatenated contiguous strides. They equal ``contiguous_sharded_stride``,
        the padded shard's and the post-forward shard's strides, and the original
        contiguous stride: a dim-0 size never enters a contiguous stride."""
    @property
    def post_forward_sizes(self) -> Int64Array | None:
        """Concatenated ``sharded_post_forward_size``; None without a post-forward
        world size."""

    # group buffer plan
    @property
    def row_offsets(self) -> Int64Array:
        """Start of each param's padded shard in the sharded buffer, in one
        all-gather row and in one reduce-scatter row; aligned to ``align_numel``."""
    @property
    def split_sizes(self) -> Int64Array:
        """Segment length of each param in a row, alignment padding included
        (``sum == row_numel``); for ``split_with_sizes_copy``-style copy-out."""
    @property
    def unsharded_offsets(self) -> Int64Array:
        """Start of each param's ``W * n`` unsharded elements; aligned."""

    # tile table shared by copy-out and reduce-scatter copy-in
    @property
    def tile_param(self) -> Int32Array: ...
    @property
    def tile_start(self) -> Int64Array:
        """Offset of the tile inside its param's row segment."""
    @property
    def tile_len(self) -> Int32Array: ...

    # memory plan
    sharded_bytes: int
    all_gather_bytes: int
    unsharded_bytes: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    plan_bytes: int
    """Bytes of all tables this plan owns."""

    def fingerprint(self) -> int:
        """A stable 64-bit digest (``0 <= x < 2**64``) of everything in the plan
        that all ranks of the shard group compute alike: the config but the rank,
        the buffer sizes and the rank-independent tables (padded sizes, strides,
        offsets). Equal on every rank that planned the same group; see [Note:
        Plan fingerprints] in ``rust/planner/src/fingerprint.rs``. Releases the
        GIL."""

@final
class FlatPlan:
    """FSDP1 ``FlatParamHandle`` metadata for the same group."""

    num_params: int
    world_size: int
    rank: int
    aligned_numel: int
    flat_numel: int
    """Unsharded flat parameter numel, alignment and world-size padding included."""
    shard_numel: int
    """Sharded flat parameter numel (``ceil(flat_numel / W)``)."""
    shard_numel_padded: int
    """This rank's ``_shard_numel_padded``."""
    @property
    def flat_offsets(self) -> Int64Array:
        """Start of each param in the unsharded flat parameter."""
    @property
    def numel(self) -> Int64Array: ...
    @property
    def in_shard(self) -> BoolArray: ...
    @property
    def offset_in_shard(self) -> Int64Array:
        """-1 where ``in_shard`` is False (torch's None); likewise below."""
    @property
    def numel_in_shard(self) -> Int64Array: ...
    @property
    def intra_param_start(self) -> Int64Array: ...
    @property
    def intra_param_end(self) -> Int64Array:
        """Inclusive; -1 is a real value for an empty param inside the shard."""
    plan_bytes: int

def plan_group(
    ndims: Int64Array,
    dims: Int64Array,
    world_size: int,
    rank: int,
    *,
    orig_elem_size: int = 4,
    param_elem_size: int | None = None,
    reduce_elem_size: int | None = None,
    alignment: int = 16,
    post_forward_world_size: int | None = None,
    tile_numel: int = 65536,
) -> GroupPlan:
    """Plan one FSDP2 parameter group. Releases the GIL while planning.

    ``param_elem_size`` and ``reduce_elem_size`` default to ``orig_elem_size``.
    ``post_forward_world_size`` (for ``reshard_after_forward=int``) must divide
    ``world_size``; the post-forward rank is ``rank % post_forward_world_size``.
    Raises TypeError for non-int64 arrays and ValueError for bad values.
    """

def plan_flat(
    ndims: Int64Array,
    dims: Int64Array,
    world_size: int,
    rank: int,
    *,
    aligned_numel: int = 0,
) -> FlatPlan:
    """FSDP1 flat-parameter metadata (``aligned_numel = 16 // itemsize`` when
    ``use_orig_params=True``, else 0). Releases the GIL while planning."""

def peak_memory(
    sharded_bytes: Int64Array,
    all_gather_bytes: Int64Array,
    unsharded_bytes: Int64Array,
    reduce_scatter_input_bytes: Int64Array,
    reduce_scatter_output_bytes: Int64Array,
    *,
    prefetch: int = 1,
    forward_prefetch: int = 0,
    reshard_after_forward: bool | BoolArray = True,
    gradient_bytes: Int64Array | None = None,
    unsharded_gradient_bytes: Int64Array | None = None,
    accumulated_gradient_bytes: Int64Array | None = None,
    activation_bytes: Int64Array | None = None,
    post_forward_bytes: Int64Array | None = None,
    output_bytes: Int64Array | None = None,
    backward_bytes: Int64Array | None = None,
    reduce_scatter_kept_bytes: Int64Array | None = None,
    resident_bytes: int = 0,
    loss_bytes: int = 0,
    accumulate: bool = False,
    side_streams: bool = True,
) -> dict[str, int]:
    """Peak bytes of one training step over groups run in order (one entry per
    group in every array, forward order); see [Note: Memory model] in
    ``rust/planner/src/memory.rs``. Defaults: ``gradient_bytes`` the reduce-scatter
    output, ``unsharded_gradient_bytes`` the unsharded bytes,
    ``accumulated_gradient_bytes`` the unsharded gradient bytes,
    ``reduce_scatter_kept_bytes`` (what a group's reduction leaves held into the
    next group's backward: the last input of a module sharded as several
    groups) the reduce-scatter input, the other arrays zeros;
    ``reshard_after_forward`` one bool for every group or one per group.
    Keys: ``persistent`` (sharded bytes plus ``resident_bytes``), ``forward``,
    ``backward`` (the most held on top of it in each pass), ``peak``."""

def module_groups(
    unit_bytes: Int64Array, boundary_before: bool | BoolArray, group_bytes: int
) -> Int64Array:
    """The group of each module unit (ids from 0, rising by one per group):
    consecutive units merged while a group's unsharded bytes stay within
    ``group_bytes``; a unit over it alone; ``boundary_before[i]`` starts a new
    group at unit ``i``. See [Note: Module grouping] in
    ``rust/planner/src/modules.rs``. ValueError for ``group_bytes < 1``, a
    negative byte count or arrays of different lengths."""
