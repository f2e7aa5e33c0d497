"""Element indices for the CPU references, built once per table set.

[Note: Cached CPU indices]
On CPU the copy-out and the reduce-scatter copy-in move a few thousand
elements per group, so they are bound by how many torch ops they run, not by
bytes: building their gather indices from the tables takes about ten ops per
call, the copy itself one ``index_select``. The index is a function of the
table tensors only (and the world size), so it is computed once and kept while
those same tensor objects live and have not been written in place (their
version counters are part of the check). A hit costs a dict lookup. Indices
are int32 when they fit (``index_select`` takes both).

The cache holds at most ``BUDGET`` bytes in all: an index is about one
unsharded buffer's worth of int32 per table set, memory torch FSDP2 does not
spend, and building one whole uncached costs several times that for the
moment of the copy. A table set whose index does not fit (the index functions
return None) is copied by the cached patterns of its runs of parameters
where they repeat ([Note: Repeating runs]), else by the same element pairs
built and dropped a run at a time ([Note: Tiled indices]), both in
``_cpu_tiles.py``, within a bounded index memory, the same result bit for bit.

[Note: Trusted hits]
A hit compares the tables' version counters with those the index was built
from, which catches a caller that wrote its tables in place. The runtime's
calls are trusted ([Note: Trusted calls] in ``ops/copies.py``): their tables
are the plan's, checked once and never written, so their hits skip that
comparison. It is most of a hit's cost in a step: the three tables are cold
by the time a group runs again (about 6 of 10 us a lookup, three lookups per
group and step, on a model of a thousand groups). The builders are functions
of their arguments, not closures, so a hit makes no function object either.

The cache is per process, shared by every model and by ranks that are threads
of one process: one lock guards its writes and its byte count (a hit reads an
entry, an immutable tuple, without it: about 1 us). What one model leaves in
it changes no other model's results (an index is a function of the tables it
is keyed on, and a table set that does not fit takes the per-parameter path,
bit for bit the same), only which path a copy takes; a table set's entry goes
with its tables.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fsdp_rs.kernels._checks import is_none
from fsdp_rs.kernels._segments import segment_columns

__all__ = [
    "BUDGET",
    "cached",
    "clear",
    "copy_out_index",
    "element_pairs",
    "flat_pairs",
    "flattened",
    "gap_columns",
    "held_bytes",
    "index_dtype",
    "reduce_scatter_buffer_index",
    "reduce_scatter_flat_index",
]

_CACHE: dict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, ...], object]] = {}
BUDGET = 1 << 20  # bytes of cached indices, in all
_held = [0]  # bytes cached now
_LOCK = threading.RLock()  # the cache and _held; reentrant: an eviction callback may run inside


def clear() -> None:
    """Drop every cached index (a benchmark measuring one model's memory from a
    clean start calls it; the indices are rebuilt on next use)."""
    with _LOCK:
        _CACHE.clear()
        _held[0] = 0


def held_bytes() -> int:
    """Bytes the cache holds now (read under its lock by a builder, which
    ``cached`` runs inside it)."""
    return _held[0]


def _nbytes(index: object) -> int:
    if isinstance(index, torch.Tensor):
        return index.numel() * index.element_size()
    if isinstance(index, tuple):
        return sum(map(_nbytes, index))
    return 0


def _evict(key: tuple) -> None:
    with _LOCK:
        entry = _CACHE.pop(key, None)
        if entry is not None:
            _held[0] -= _nbytes(entry[2])


def cached(
    tables: tuple[torch.Tensor, ...],
    extra: tuple,
    rows: int,
    trusted: bool,
    build: Callable[..., object],
    *args: object,
):
    """The index ``build(*args)`` makes for ``tables``, cached; or None where it
    does not fit the budget (``rows``: elements of the ``[W, S]`` buffer it
    spans, so at least ``4 * rows`` bytes). A refusal is cached too, with the
    same lifetime, so a table set takes one path for as long as it lives.
    ``trusted``: the runtime's tables ([Note: Trusted calls]), which nothing
    writes in place, so a hit skips the version check ([Note: Trusted hits])."""
    key = (*map(id, tables), *extra)
    # A hit needs no lock: entries are immutable tuples, replaced whole under it.
    # Nor an identity check: a key's ids are of live tables, since a table's
    # death evicts its entries (the weak references' callback) before its id
    # can be reused.
    hit = _CACHE.get(key)
    if hit is not None and (trusted or hit[1] == tuple(map(_VERSION, tables))):
        return hit[2]
    versions = tuple(map(_VERSION, tables))
    with _LOCK:
        _evict(key)
        index = build(*args) if _held[0] + 4 * rows <= BUDGET else None
        if index is not None and _held[0] + _nbytes(index) > BUDGET:
            index = None
        refs = tuple(weakref.ref(t, lambda _, key=key: _evict(key)) for t in tables)
        _CACHE[key] = (refs, versions, index)
        _held[0] += _nbytes(index)
        return index


_VERSION = operator.attrgetter("_version")


def index_dtype(bound: int) -> torch.dtype:
    return torch.int32 if bound < 2**31 else torch.int64


def element_pairs(
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    world_size: int,
    row_numel: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat, unsharded)``: every element of every param's padded chunk, as its
    position in the flat rows ``[W, S]`` and in the unsharded layout (chunk
    ``r`` of param ``p`` at ``unsharded_offsets[p] + r * n``). Both int64, in the
    same order."""
    seg, pos, cols = segment_columns(row_offsets, padded_numel)
    ranks = torch.arange(world_size)[:, None]
    flat = (cols + ranks * row_numel).view(-1)
    unsharded = (unsharded_offsets[seg] + ranks * padded_numel[seg] + pos).view(-1)
    return flat, unsharded


def copy_out_index(
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    world_size: int,
    row_numel: int,
    out_numel: int,
    trusted: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Where each unsharded element comes from in the flat all-gather output
    ``[W, S]``, as ``(dst, src)``: element ``dst[k]`` of the unsharded buffer
    receives element ``src[k]``. ``dst`` is None when it would be every element
    in order (the buffer has no alignment gaps), so that a single gather fills
    it; the gaps are never written otherwise. None: over the budget.
    ``trusted``: see ``cached``."""
    tables = (row_offsets, unsharded_offsets, padded_numel)
    key = ("copy_out", world_size, row_numel, out_numel)
    return cached(
        tables, key, world_size * row_numel, trusted, _build_copy_out, *tables, world_size,
        row_numel, out_numel,
    )  # fmt: skip


def _build_copy_out(
    row_offsets, unsharded_offsets, padded_numel, world_size, row_numel, out_numel
) -> tuple[torch.Tensor | None, torch.Tensor]:
    src, dst = element_pairs(row_offsets, unsharded_offsets, padded_numel, world_size, row_numel)
    src_dtype = index_dtype(world_size * row_numel)
    if dst.numel() == out_numel:
        index = torch.empty(out_numel, dtype=src_dtype)
        index[dst] = src.to(src_dtype)
        return None, index
    return dst, src.to(src_dtype)


def reduce_scatter_flat_index(
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    numels: np.ndarray,
    world_size: int,
    row_numel: int,
    trusted: bool = False,
) -> torch.Tensor | None:
    """``index[i]``: the element of the gradients flattened and concatenated
    (``numels[p]`` elements each, plus one zero at the end) that element ``i``
    of the reduce-scatter input ``[W, S]`` receives: chunk ``r`` of param ``p``
    is its elements ``[r * n, (r + 1) * n)``; padding and gaps point at the zero.
    None: over the budget. ``trusted``: see ``cached``."""
    key = ("reduce_scatter_flat", world_size, row_numel, numels.tobytes())
    return cached(
        (row_offsets, padded_numel), key, world_size * row_numel, trusted, _build_flat,
        row_offsets, padded_numel, numels, world_size, row_numel,
    )  # fmt: skip


def _build_flat(row_offsets, padded_numel, numels, world_size, row_numel) -> torch.Tensor:
    dst, src = flat_pairs(row_offsets, padded_numel, numels, world_size, row_numel)
    zero = int(numels.sum())
    index = torch.full((world_size * row_numel,), zero, dtype=torch.int64)
    index[dst.view(-1)] = src.view(-1)
    return index.to(index_dtype(zero + 1))


def flat_pairs(
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    numels: np.ndarray,
    world_size: int,
    row_numel: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)``, both ``[W, columns]`` int64: element ``dst`` of the flat
    reduce-scatter input ``[W, S]`` receives element ``src`` of the gradients
    flattened and concatenated (``flattened``), or its last, zero element
    past a gradient's end."""
    seg, pos, cols = segment_columns(row_offsets, padded_numel)
    numel = torch.from_numpy(numels)
    start = torch.cumsum(numel, 0) - numel
    ranks = torch.arange(world_size)[:, None]
    within = ranks * padded_numel.to(torch.int64)[seg] + pos
    src = torch.where(within < numel[seg], start[seg] + within, int(numels.sum()))
    return cols + ranks * row_numel, src


def flattened(
    grads: Sequence[torch.Tensor | None], numels: np.ndarray, like: torch.Tensor, dtype
) -> torch.Tensor:
    """``grads`` flattened and concatenated, ``numels[p]`` zeros standing in for
    a missing one, and one more zero at the end (what ``flat_pairs`` reads)."""
    zero = like.new_zeros(1, dtype=dtype)
    if any(map(is_none, grads)):
        flat = [
            zero.expand(n) if g is None else g.flatten()
            for g, n in zip(grads, numels.tolist(), strict=True)
        ]
    else:
        flat = list(map(torch.flatten, grads))
    return torch.cat([*flat, zero])


def reduce_scatter_buffer_index(
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    world_size: int,
    row_numel: int,
    trusted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """``(src, gaps, bound)`` for the reduce-scatter copy-in from a buffer laid out like
    the unsharded one: element ``i`` of the flat input ``[W, S]`` receives buffer
    element ``src[i]``, except the alignment-gap elements ``gaps`` (None when
    there are none), which are zeros; the buffer needs ``bound`` elements.
    None: over the budget. ``trusted``: see ``cached``."""
    tables = (row_offsets, unsharded_offsets, padded_numel)
    key = ("reduce_scatter_buffer", world_size, row_numel)
    return cached(
        tables, key, world_size * row_numel, trusted, _build_buffer, *tables, world_size,
        row_numel,
    )  # fmt: skip


def _build_buffer(
    row_offsets, unsharded_offsets, padded_numel, world_size, row_numel
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    dst, src = element_pairs(row_offsets, unsharded_offsets, padded_numel, world_size, row_numel)
    index = torch.zeros(world_size * row_numel, dtype=torch.int64)
    index[dst] = src
    gap = torch.ones(world_size * row_numel, dtype=torch.bool)
    gap[dst] = False
    gaps = gap.nonzero().view(-1) if bool(gap.any()) else None
    bound = int(src.max()) + 1 if src.numel() else 0
    return index.to(index_dtype(bound)), gaps, bound


def gap_columns(row_offsets: list[int], padded: list[int], row_numel: int) -> list[tuple[int, int]]:
    """The column ranges of a row that no parameter's chunk covers (alignment gaps)."""
    gaps, end = [], 0
    for r, n in sorted(zip(row_offsets, padded, strict=True)):
        if r > end:
            gaps.append((end, r))
        end = max(end, r + n)
    if end < row_numel:
        gaps.append((end, row_numel))
    return gaps
