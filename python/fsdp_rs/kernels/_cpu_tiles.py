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

from fsdp_rs.kernels import _cpu_index
from fsdp_rs.kernels._checks import host_table
from fsdp_rs.kernels._cpu_index import element_pairs, flat_pairs, flattened, index_dtype

__all__ = [
    "PATTERN_NUMEL",
    "TILE_BYTES",
    "copy_in_flat_tiled",
    "copy_in_tiled",
    "copy_out_tiled",
    "repeating_list_runs",
    "repeating_runs",
    "runs",
]

TILE_BYTES = 1 << 20  # transient index bytes a run may take
_BYTES_PER_ELEMENT = 48  # int64 index tensors alive together per element of a run
PATTERN_NUMEL = 1 << 13  # elements of a repeating run at most ([Note: Repeating runs])
_MAX_PERIOD = 1024  # parameters in the longest repetition looked for
_INT64 = 8

# [Note: Repeating runs]
# A group of many parameters is mostly the same few shapes over and over (the
# blocks of a model, which ``auto_shard`` puts in one group), and then its
# tables repeat too: cut into runs of a whole number of repetitions, most runs
# have the same element pairs relative to their first parameter's row and
# buffer offsets. So where the whole index is over the budget, the runs'
# distinct patterns of pairs are kept instead (``repeating_runs``: a few
# thousand elements each, a head, the body and a tail), and each run is one
# ``index_select`` (and, where its block of the buffer has gaps, one
# ``index_copy_``) on views at its offsets: no index arithmetic per call. The
# patterns are found by content (each run's relative tables), so a run that
# does not repeat has a pattern of its own and the result is the tiled copy's,
# bit for bit; a table set with more distinct runs than repeated ones, or
# whose patterns do not fit the budget, is copied by tiles. A 10,000-parameter
# group (W = 8, 856,000 elements): a copy-out took 9.7 ms by tiles and about
# 1 ms this way.


def _period(*columns: np.ndarray) -> int | None:
    """The smallest shift (up to ``_MAX_PERIOD``) under which every column
    equals itself for at least 90% of its length: a body of repeated blocks,
    whatever comes before and after it; None where there is none."""
    count = min(map(len, columns))
    for q in range(1, min(_MAX_PERIOD, count // 2) + 1):
        if all(np.count_nonzero(c[q:] == c[:-q]) * 10 >= 9 * (len(c) - q) for c in columns):
            return q
    return None


def repeating_runs(
    kind: str,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    world_size: int,
    row_numel: int,
    trusted: bool = False,
) -> tuple[tuple, tuple] | None:
    """``(runs, patterns)`` of [Note: Repeating runs], cached with the tables
    (``trusted``: [Note: Trusted hits]), or None: copy by tiles. Each run is
    ``(row, buffer, numel, k)``: its first parameter's column in the rows and
    offset in the unsharded-layout buffer, its elements, and its pattern
    ``patterns[k] = (dst, src)`` relative to those offsets, sorted by buffer
    position (``k = -1``: one parameter over a run's size, copied by one
    strided copy; ``numel`` is then its padded chunk). ``kind`` "copy_out":
    ``src`` the rows' positions (int32 where they fit), ``dst`` the buffer's
    (int64); "copy_in": ``src`` the buffer's, ``dst`` the rows' (int64). The
    buffer's side is None where it is every element of the run's block in
    order."""
    tables = (row_offsets, unsharded_offsets, padded_numel)
    limit = _pattern_limit()
    key = ("repeating_runs", kind, world_size, row_numel, limit)
    return _cpu_index.cached(
        tables, key, 0, trusted, _build_repeating, kind, *tables, world_size, row_numel, limit
    )


def _pattern_limit() -> int:
    """Elements of a repeating run at most: ``PATTERN_NUMEL``, and no more than
    a tile's."""
    return min(PATTERN_NUMEL, TILE_BYTES // _BYTES_PER_ELEMENT)


def _cut(fixed: list[np.ndarray], relative: list[np.ndarray], limit: int):
    """``(runs, firsts, ends)``, or None where the tables do not repeat: runs
    ``(a, b, k)`` of parameters (``k = -1``: a parameter of more than ``limit``
    elements alone; else the index of the run's shape in ``firsts``, the
    first run of each), and the running count of elements (big parameters'
    not counted). A run's shape is its ``fixed`` columns (``fixed[0]``: the
    elements of each parameter) and its ``relative`` ones less their value at
    its first parameter."""
    sizes = fixed[0]
    count = len(sizes)
    if count < 4 or limit <= 0:
        return None
    q = _period(*fixed, *map(np.diff, relative))
    if q is None:
        return None
    big = sizes > limit  # each its own run, one strided copy (as by tiles)
    ends = np.concatenate(([0], np.cumsum(np.where(big, 0, sizes))))
    widest = int((ends[q:] - ends[:-q]).max())  # small elements of q parameters in a row
    step = q * (limit // max(widest, 1))
    if step == 0:
        return None
    found: dict[tuple, int] = {}
    firsts: list[tuple[int, int]] = []
    cut = []
    for a, b in _segments(big, step):
        if b == a + 1 and big[a]:
            cut.append((a, b, -1))
            continue
        shape = (*(c[a:b].tobytes() for c in fixed), *((c[a:b] - c[a]).tobytes() for c in relative))
        k = found.setdefault(shape, len(firsts))
        if k == len(firsts):
            firsts.append((a, b))
        cut.append((a, b, k))
    if 2 * len(firsts) > len(cut) - int(np.count_nonzero(big)):
        return None  # more distinct runs than repeated ones
    return cut, firsts, ends


def _fits(held: int) -> bool:
    """Whether ``held`` more bytes fit the index cache's budget (read under its
    lock: the builders run inside ``cached``)."""
    return _cpu_index.held_bytes() + held <= _cpu_index.BUDGET


def _host(table: torch.Tensor) -> np.ndarray:
    """A table's values on the host, as int64 (what the arithmetic and the
    shapes' bytes are taken in)."""
    return np.asarray(host_table(table), dtype=np.int64)


def _build_repeating(
    kind, row_offsets, unsharded_offsets, padded_numel, world_size, row_numel, limit
) -> tuple[tuple, tuple] | None:
    rows, outs, padded = _host(row_offsets), _host(unsharded_offsets), _host(padded_numel)
    found = _cut([world_size * padded], [rows, outs], limit)
    if found is None:
        return None
    cut, firsts, ends = found
    # the buffer's side is every element in order where the run's blocks are back to back
    in_order = [bool(np.array_equal(outs[a:b] - outs[a], ends[a:b] - ends[a])) for a, b in firsts]
    # kept always: the rows' side (int32 where it fits, for a copy-out's index_select);
    # the buffer's side (int64) only where it is not in order
    rows_side = index_dtype(world_size * row_numel).itemsize if kind == "copy_out" else _INT64
    held = sum(
        int(ends[b] - ends[a]) * (rows_side + (0 if o else _INT64))
        for (a, b), o in zip(firsts, in_order, strict=True)
    )
    if not _fits(held):
        return None
    tables = (row_offsets, unsharded_offsets, padded_numel)
    patterns = tuple(
        _pattern(kind, *tables, a, b, o, world_size, row_numel)
        for (a, b), o in zip(firsts, in_order, strict=True)
    )
    run_list = tuple(
        (int(rows[a]), int(outs[a]), int(padded[a]) if k < 0 else int(ends[b] - ends[a]), k)
        for a, b, k in cut
    )
    return run_list, patterns


def repeating_list_runs(
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    numels: np.ndarray,
    world_size: int,
    row_numel: int,
    trusted: bool = False,
) -> tuple[tuple, tuple] | None:
    """``repeating_runs`` of the reduce-scatter copy-in from separate gradients
    (``numels[p]`` elements each): runs ``(row, a, b, k)`` of parameters
    ``[a, b)``, and ``patterns[k] = (dst, src)`` of ``flat_pairs`` over the run's
    gradients ``flattened``, ``dst`` relative to ``row`` (``k = -1``: one
    parameter over a run's size, copied alone)."""
    tables = (row_offsets, padded_numel)
    limit = _pattern_limit()
    key = ("repeating_list_runs", world_size, row_numel, limit, numels.tobytes())
    return _cpu_index.cached(
        tables, key, 0, trusted, _build_list, *tables, numels, world_size, row_numel, limit
    )


def _build_list(row_offsets, padded_numel, numels, world_size, row_numel, limit):
    rows, padded = _host(row_offsets), _host(padded_numel)
    found = _cut([world_size * padded, numels], [rows], limit)
    if found is None:
        return None
    cut, firsts, ends = found
    src_bytes = index_dtype(int(numels.sum()) + 1).itemsize
    if not _fits(sum(int(ends[b] - ends[a]) * (_INT64 + src_bytes) for a, b in firsts)):
        return None
    patterns = []
    for a, b in firsts:
        counts = numels[a:b]
        dst, src = flat_pairs(
            row_offsets[a:b] - row_offsets[a], padded_numel[a:b], counts, world_size, row_numel
        )
        patterns.append((dst.reshape(-1), src.reshape(-1).to(index_dtype(int(counts.sum()) + 1))))
    return tuple((int(rows[a]), a, b, k) for a, b, k in cut), tuple(patterns)


def _segments(big: np.ndarray, step: int):
    """``(a, b)``: each big parameter alone, and the parameters between them in
    runs of ``step`` from the first after each big one (so that the runs of a
    repeated body line up with its repetitions)."""
    start = 0
    for p in [*np.flatnonzero(big).tolist(), len(big)]:
        for a in range(start, p, step):
            yield a, min(a + step, p)
        if p < len(big):
            yield p, p + 1
        start = p + 1


def _pattern(kind, row_offsets, unsharded_offsets, padded_numel, a, b, in_order, world_size,
             row_numel) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """The element pairs of parameters ``[a, b)`` relative to parameter ``a``'s
    offsets, sorted by buffer position (see ``repeating_runs``)."""
    flat, buffer = element_pairs(
        row_offsets[a:b] - row_offsets[a], unsharded_offsets[a:b] - unsharded_offsets[a],
        padded_numel[a:b], world_size, row_numel,
    )  # fmt: skip
    order = torch.argsort(buffer)
    flat, buffer = flat[order], buffer[order]
    if kind == "copy_in":
        return flat, (None if in_order else buffer)
    return (None if in_order else buffer), flat.to(index_dtype(world_size * row_numel))


def runs(padded_numel: torch.Tensor, world_size: int) -> list[tuple[int, int, bool]]:
    """``(a, b, indexed)``: parameters ``[a, b)`` in order, each run of at most
    ``TILE_BYTES // 48`` elements (``W * n`` each) copied by an index
    (``indexed``), or one parameter over that, copied by one strided copy."""
    limit = TILE_BYTES // _BYTES_PER_ELEMENT
    sizes = world_size * _host(padded_numel)
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


def _block_out(all_gather_output, out, row: int, at: int, n: int) -> None:
    """One parameter's ``[W, n]`` columns at ``row`` into its block of ``out``
    at ``at``: one strided copy."""
    world_size = all_gather_output.shape[0]
    out[at : at + world_size * n].view(world_size, n).copy_(all_gather_output[:, row : row + n])


def _block_in(grad_buffer, reduce_scatter_input, row: int, at: int, n: int) -> None:
    """One parameter's block of ``grad_buffer`` at ``at`` into its ``[W, n]``
    columns at ``row``: one strided copy."""
    world_size = reduce_scatter_input.shape[0]
    block = grad_buffer[at : at + world_size * n].view(world_size, n)
    reduce_scatter_input[:, row : row + n].copy_(block)


def copy_out_tiled(
    all_gather_output: torch.Tensor,
    out: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    trusted: bool = False,
) -> None:
    """Every parameter's ``W`` chunks from its columns of the all-gather output
    into its block of the flat ``out`` (the cached index's copy, by repeating
    runs or by tiles)."""
    world_size, row_numel = all_gather_output.shape
    flat = all_gather_output.view(-1)
    tables = (row_offsets, unsharded_offsets, padded_numel)
    repeating = repeating_runs("copy_out", *tables, world_size, row_numel, trusted)
    if repeating is not None:  # [Note: Repeating runs]
        run_list, patterns = repeating
        for row, at, numel, k in run_list:
            if k < 0:  # a big parameter: numel is its padded chunk
                _block_out(all_gather_output, out, row, at, numel)
                continue
            dst, src = patterns[k]
            if dst is None:
                torch.index_select(flat[row:], 0, src, out=out[at : at + numel])
            else:
                out[at:].index_copy_(0, dst, flat[row:].index_select(0, src))
        return
    for a, b, indexed in runs(padded_numel, world_size):
        if indexed:
            src, dst = element_pairs(
                row_offsets[a:b], unsharded_offsets[a:b], padded_numel[a:b], world_size, row_numel
            )
            out.index_copy_(0, dst, flat.index_select(0, src))
        else:
            r, u, n = int(row_offsets[a]), int(unsharded_offsets[a]), int(padded_numel[a])
            _block_out(all_gather_output, out, r, u, n)


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
    trusted: bool = False,
) -> None:
    """Every parameter's ``W`` chunks from its block of the flat gradient buffer
    into its columns of the reduce-scatter input, zeros into the gaps (cast to
    the input's dtype where it differs)."""
    world_size, row_numel = reduce_scatter_input.shape
    _zero_gaps(reduce_scatter_input, padded_numel)
    flat = reduce_scatter_input.view(-1)
    tables = (row_offsets, unsharded_offsets, padded_numel)
    repeating = repeating_runs("copy_in", *tables, world_size, row_numel, trusted)
    if repeating is not None:  # [Note: Repeating runs]
        run_list, patterns = repeating
        for row, at, numel, k in run_list:
            if k < 0:  # a big parameter: numel is its padded chunk
                _block_in(grad_buffer, reduce_scatter_input, row, at, numel)
                continue
            dst, src = patterns[k]
            block = grad_buffer[at:]
            values = block[:numel] if src is None else block.index_select(0, src)
            flat[row:].index_copy_(0, dst, values.to(flat.dtype))
        return
    for a, b, indexed in runs(padded_numel, world_size):
        if indexed:
            dst, src = element_pairs(
                row_offsets[a:b], unsharded_offsets[a:b], padded_numel[a:b], world_size, row_numel
            )
            flat.index_copy_(0, dst, grad_buffer.index_select(0, src).to(flat.dtype))
        else:
            r, u, n = int(row_offsets[a]), int(unsharded_offsets[a]), int(padded_numel[a])
            _block_in(grad_buffer, reduce_scatter_input, r, u, n)


def copy_in_tiled(
    grads: Sequence[torch.Tensor | None],
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    numels: np.ndarray,
    dtype: torch.dtype,
    copy_one,
    trusted: bool = False,
) -> None:
    """Every gradient's ``W`` chunks of ``n`` elements into its columns (zeros
    past its end, and for a missing one, whose stand-in has ``numels[p]``
    zeros), zeros into the gaps. ``copy_one(g, dst, n)``: a parameter over a
    run's size alone, into its ``[W, n]`` columns ``dst``."""
    world_size, row_numel = reduce_scatter_input.shape
    _zero_gaps(reduce_scatter_input, padded_numel)
    flat = reduce_scatter_input.view(-1)
    repeating = repeating_list_runs(
        row_offsets, padded_numel, numels, world_size, row_numel, trusted
    )
    if repeating is not None:  # [Note: Repeating runs]
        run_list, patterns = repeating
        for row, a, b, k in run_list:
            if k < 0:
                n = int(padded_numel[a])
                copy_one(grads[a], reduce_scatter_input[:, row : row + n], n)
                continue
            dst, src = patterns[k]
            values = flattened(grads[a:b], numels[a:b], reduce_scatter_input, dtype)
            flat[row:].index_copy_(0, dst, values.index_select(0, src).to(flat.dtype))
        return
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
