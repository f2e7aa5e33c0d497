"""Vectorized segment arithmetic for the torch references (no per-parameter loop)."""

from __future__ import annotations

import torch

__all__ = ["segment_columns"]


def segment_columns(
    starts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For segments ``[starts[p], starts[p] + lengths[p])`` laid end to end, return
    per element: the segment index, the position inside the segment, and the
    absolute column ``starts[p] + position``. All int64, ``lengths.sum()`` long."""
    lengths = lengths.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(seg.numel(), device=lengths.device) - first[seg]
    return seg, pos, starts[seg] + pos
