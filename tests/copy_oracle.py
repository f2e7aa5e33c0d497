"""Naive per-param oracle of the group copies, written from FSDP2's semantics
(torch.chunk of dim 0, zero padding to ``ceil(d0 / W)`` rows) rather than from
the plan's tables, so the references and kernels are checked against an
independent statement of the layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_rs import GroupPlan


def padded_chunks(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[W, n]``: rank r's padded shard of ``t`` in each row (FSDP2's chunk rule)."""
    d0 = t.shape[0]
    rows = -(-d0 // world_size)
    padded = t.new_zeros((rows * world_size, *t.shape[1:]))
    padded[:d0] = t
    return padded.reshape(world_size, -1)


def rows_of(params: Sequence[torch.Tensor], plan: GroupPlan, dtype: torch.dtype) -> torch.Tensor:
    """The ``[W, S]`` rows every rank's sharded buffer holds (zero alignment gaps)."""
    world_size = plan.world_size
    rows = torch.zeros(world_size, plan.row_numel, dtype=dtype)
    for t, off in zip(params, plan.row_offsets.tolist(), strict=True):
        chunk = padded_chunks(t, world_size)
        rows[:, off : off + chunk.shape[1]] = chunk
    return rows


def unsharded_of(
    params: Sequence[torch.Tensor], plan: GroupPlan, fill: float, dtype: torch.dtype
) -> torch.Tensor:
    """The unsharded buffer after copy-out: each param's padded ``W * n`` elements at
    its offset; everything else keeps ``fill`` (the copy-out must not touch it)."""
    out = torch.full((plan.unsharded_numel,), fill, dtype=dtype)
    for t, off in zip(params, plan.unsharded_offsets.tolist(), strict=True):
        flat = padded_chunks(t, plan.world_size).reshape(-1)
        out[off : off + flat.numel()] = flat
    return out
