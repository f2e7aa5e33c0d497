"""The CPU references' copies over the index cache's budget: the element index
built tile by tile, used and dropped.

[Note: Tiled indices]
A table set whose whole index does not fit the cache ([Note: Cached CPU
indices]) is copied in runs of consecutive parameters: for each run the same
element pairs the cached index is made of (``element_pairs``, or
``flat_pairs`` over the gradients ``flattened``), then one ``index_select`` and one
``index_copy_``. A run holds parameters of at most ``TILE_BYTES // 48``
elements in all (48: the bytes per element of the run's int64 index tensors
alive together), so a copy takes at most about ``2 * TILE_BYTES`` of
transient index memory, as much as the cache may hold for good; a parameter
over that alone is its own run, copied by one strided copy. About a dozen
torch ops per run and NumPy over the tables, no Python or torch call per
parameter: the copy-out of a 10,000-parameter group (856,000 elements, W = 8)
took 24.7 ms by the per-parameter blocks it replaces (views, then torch's
split copy, about 2.5 us a parameter) and 5.6 ms in 14 runs, called alone;
in a step, 39 against 9.7 ms a copy-out. Element pairs are exact positions, so
the bits are the cached index's, whatever the table set (rows out of
parameter order, gradients of any shape, missing ones): the blocks needed
rows in parameter order and gradients ``_chunk_cat`` pads as the plan does,
and fell back to a loop of four or five torch calls per parameter otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fsdp_rs.kernels._cpu_index import element_pairs, flat_pairs, flattened

__all__ = ["TILE_BYTES", "copy_in_flat_tiled", "copy_in_tiled", "copy_out_tiled", "runs"]

TILE_BYTES = 1 << 20  # transient index bytes a run may take
_BYTES_PER_ELEMENT = 48  # int64 index tensors alive together per element of a run


def runs(padded_numel: torch.Tensor, world_size: int) -> list[tuple[int, int, bool]]:
    """``(a, b, indexed)``: parameters ``[a, b)`` in order, each run of at most
    ``TILE_BYTES // 48`` elements (``W * n`` each) copied by an index
    (``indexed``), or one parameter over that, copied by one strided copy."""
    limit = TILE_BYTES // _BYTES_PER_ELEMENT
    sizes = world_size * np.asarray(padded_numel.cpu().numpy(), dtype=np.int64)
    count = len(sizes)
    if count == 0:
        return []
    big = sizes > limit
    # runs of small parameters cut where their running total crosses a multiple
    # of the limit (a run ends at most one parameter past it), and at each big one
    tile = np.cumsum(np.where(big, 0, sizes)) // max(limit, 1)
    cuts = np.flatnonzero(np.diff(tile)) + 1
    bigs = np.flatnonzero(big)
    edges = np.unique(np.concatenate(([0, count], cuts, bigs, bigs + 1)))
    starts, ends = edges[:-1].tolist(), edges[1:].tolist()
    return [(a, b, not (b - a == 1 and bool(big[a]))) for a, b in zip(starts, ends, strict=True)]


def copy_out_tiled(
    all_gather_output: torch.Tensor,
    out: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
) -> None:
    """Every parameter's ``W`` chunks from its columns of the all-gather output
    into its block of the flat ``out`` (the cached index's copy, by runs)."""
    world_size, row_numel = all_gather_output.shape
    flat = all_gather_output.view(-1)
    for a, b, indexed in runs(padded_numel, world_size):
        if indexed:
            src, dst = element_pairs(
                row_offsets[a:b], unsharded_offsets[a:b], padded_numel[a:b], world_size, row_numel
            )
            out.index_copy_(0, dst, flat.index_select(0, src))
        else:
            r, u, n = int(row_offsets[a]), int(unsharded_offsets[a]), int(padded_numel[a])
            out[u : u + world_size * n].view(world_size, n).copy_(all_gather_output[:, r : r + n])


def _zero_gaps(reduce_scatter_input: torch.Tensor, padded_numel: torch.Tensor) -> None:
    """Zeros where no parameter's columns are (the alignment gaps): the whole
    input, where the parameters do not cover its row."""
    if int(padded_numel.sum()) != reduce_scatter_input.shape[1]:
        reduce_scatter_input.zero_()


def copy_in_flat_tiled(
    grad_buffer: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
) -> None:
    """Every parameter's ``W`` chunks from its block of the flat gradient buffer
    into its columns of the reduce-scatter input, zeros into the gaps (cast to
    the input's dtype where it differs)."""
    world_size, row_numel = reduce_scatter_input.shape
    _zero_gaps(reduce_scatter_input, padded_numel)
    flat = reduce_scatter_input.view(-1)
    for a, b, indexed in runs(padded_numel, world_size):
        if indexed:
            dst, src = element_pairs(
                row_offsets[a:b], unsharded_offsets[a:b], padded_numel[a:b], world_size, row_numel
            )
            flat.index_copy_(0, dst, grad_buffer.index_select(0, src).to(flat.dtype))
        else:
            r, u, n = int(row_offsets[a]), int(unsharded_offsets[a]), int(padded_numel[a])
            block = grad_buffer[u : u + world_size * n].view(world_size, n)
            reduce_scatter_input[:, r : r + n].copy_(block)


def copy_in_tiled(
    grads: Sequence[torch.Tensor | None],
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    numels: np.ndarray,
    dtype: torch.dtype,
    copy_one,
) -> None:
    """Every gradient's ``W`` chunks of ``n`` elements into its columns (zeros
    past its end, and for a missing one, whose stand-in has ``numels[p]``
    zeros), zeros into the gaps. ``copy_one(g, dst, n)``: a parameter over a
    run's size alone, into its ``[W, n]`` columns ``dst``."""
    world_size, row_numel = reduce_scatter_input.shape
    _zero_gaps(reduce_scatter_input, padded_numel)
    flat = reduce_scatter_input.view(-1)
    for a, b, indexed in runs(padded_numel, world_size):
        part = grads[a:b]
        if not indexed:
            r, n = int(row_offsets[a]), int(padded_numel[a])
            copy_one(part[0], reduce_scatter_input[:, r : r + n], n)
            continue
        counts = numels[a:b]
        values = flattened(part, counts, reduce_scatter_input, dtype)
        dst, src = flat_pairs(row_offsets[a:b], padded_numel[a:b], counts, world_size, row_numel)
        flat.index_copy_(0, dst.view(-1), values.index_select(0, src.view(-1)).to(flat.dtype))
