"""The CPU references' copies without an index: one torch op over every
parameter's block, for table sets whose index is over the cache's budget.

[Note: Block copies]
Without a cached index ([Note: Cached CPU indices]) a copy moves each
parameter's ``[W, n]`` block on its own. Done as a Python loop that was four
or five torch calls per parameter, the larger part of a step of a big group
(``auto_shard``'s groups hold thousands of parameters: 29 us per parameter a
step at 1e4, 23 with blocks). torch has the loop in C++: ``split_with_sizes_copy`` splits the
all-gather output's columns into per-parameter outputs (FSDP2's copy-out),
``cat`` along the columns writes them back into rows, and ``_chunk_cat``
(FSDP2's reduce-scatter copy-in) cuts each gradient into ``W`` zero-padded
chunks along its first dim and lays chunk ``r`` of every gradient into row
``r``. What stays per parameter is a C-level pass that makes the blocks'
views (``map`` over ``as_strided``, about 1.5 us each, and torch's split copy
costs about 2 us per output), so the copies take no memory beyond their own, as
the loop took none. The row's alignment gaps are blocks too (one list entry
per gap, made only where some gap has columns): zeros read from an expanded
scalar, or written to a scratch block and dropped.
``_chunk_cat`` pads each gradient by its own first dim, which is the row
layout's chunk wherever the plan chunked the parameter along dim 0 (every
dim-0 group); a table set where that does not hold for every gradient, or
whose rows are not in parameter order, keeps the per-parameter loop, with the
same bits.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from itertools import repeat

import numpy as np
import torch

__all__ = ["RowBlocks", "chunked_by_first_dim", "row_blocks"]

_FIRST_DIM = operator.methodcaller("size", 0)  # len() of a tensor is a Python call


class RowBlocks:
    """A row of ``W`` ranks' ``row_numel`` columns as consecutive blocks: each
    parameter's ``n`` columns, each preceded by its gap (0 columns where there
    is none), and the gap after the last."""

    def __init__(self, world_size: int, padded: list[int], gaps: list[int]) -> None:
        self.world_size = world_size
        self.padded = padded
        self.gaps = gaps  # one per parameter, then the tail
        self._columns = [
            *itertools.chain.from_iterable(zip(gaps[:-1], padded, strict=True)),
            gaps[-1],
        ]

    def sizes(self) -> list[int]:
        """Every block's columns in row order, gaps included, none empty."""
        return self.interleave(self.padded, self.gaps)

    def interleave(self, blocks: Sequence, gaps: Sequence) -> list:
        """``blocks`` (one per parameter) with ``gaps`` (one before each, and one
        after the last), in row order, without the blocks of no columns (which
        ``_chunk_cat`` refuses, and which cost a view each for nothing)."""
        every = [*itertools.chain.from_iterable(zip(gaps[:-1], blocks, strict=True)), gaps[-1]]
        return list(itertools.compress(every, self._columns))

    def views(self, buffer: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
        """Each parameter's ``[W, n]`` block of a buffer in the unsharded layout,
        starting at its offset."""
        w, n = self.world_size, self.padded
        return list(map(buffer.as_strided, zip(repeat(w), n), zip(n, repeat(1)), offsets))

    def zero_gaps(self, dtype: torch.dtype, flat: bool) -> list:
        """A zero block per gap (None for a gap of no columns), no memory (one
        expanded scalar): ``[W, g]``, or ``flat``: ``W * g`` elements, which
        ``_chunk_cat`` cuts into ``W`` of ``g``."""
        zero = torch.zeros((), dtype=dtype)
        w = self.world_size
        return (
            [
                None if not g else zero.expand(w * g) if flat else zero.expand(w, g)
                for g in self.gaps
            ]
            if any(self.gaps)
            else [None] * len(self.gaps)
        )

    def scratch_gaps(self, like: torch.Tensor) -> list:
        """A ``[W, g]`` block per gap (None for a gap of no columns) for a copy
        to write and drop, all on one scratch buffer of the largest."""
        if not any(self.gaps):
            return [None] * len(self.gaps)
        w = self.world_size
        scratch = like.new_empty(w * max(self.gaps))
        return [None if not g else scratch[: w * g].view(w, g) for g in self.gaps]


def row_blocks(
    row_offsets: torch.Tensor, padded_numel: torch.Tensor, world_size: int, row_numel: int
) -> RowBlocks | None:
    """The row as blocks, or None where the parameters' rows are not in their
    order without overlap ([Note: Block copies])."""
    if row_offsets.device.type != "cpu" or padded_numel.device.type != "cpu":
        return None
    starts, padded = row_offsets.numpy(), padded_numel.numpy()
    ends = starts + padded
    gaps = np.concatenate((starts, [row_numel])) - np.concatenate(([0], ends))
    if (gaps < 0).any():
        return None
    return RowBlocks(world_size, padded.tolist(), gaps.tolist())


def chunked_by_first_dim(grads: Sequence[torch.Tensor], padded: list[int], world_size: int) -> bool:
    """Whether ``_chunk_cat`` pads each gradient to the row layout's chunk:
    ``ceil(d0 / W)`` rows of ``numel / d0`` elements is ``padded`` for every one
    ([Note: Block copies])."""
    if 0 in map(torch.Tensor.dim, grads):
        return False
    first = np.fromiter(map(_FIRST_DIM, grads), np.int64, len(grads))
    numel = np.fromiter(map(torch.Tensor.numel, grads), np.int64, len(grads))
    rows = -(-first // world_size)
    per_row = np.floor_divide(numel, np.maximum(first, 1))
    return bool(np.array_equal(rows * per_row, np.asarray(padded, dtype=np.int64)))
