"""The runtime's public view of the sharded gradient buffers, for code above it
(``fsdp_rs.optim``) that works per group instead of per parameter.

[Note: Whole gradient buffers]
A group's sharded ``.grad``s are DTensor views of one buffer in the row layout
([Note: Sharded gradient buffer]); its padding and the rows of its frozen
parameters hold zeros, which every reduction writes. When every view of a live
buffer is still its parameter's ``.grad`` and the caller passed every one of
them, an elementwise operation over all of those gradients (a scale) or a
reduction that zeros do not change (a p-norm, p > 0) can run once over the
buffer, bit for bit the same per element as over each gradient. Anything else
(a ``.grad`` the user replaced or set, a gradient made by the rare per-parameter
path, only some of a group's gradients passed) is left to the caller's
per-gradient path.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rs.runtime.mesh import MeshInfo

__all__ = ["GradBuffer", "sharded_grad_buffers"]

_GRAD = operator.attrgetter("grad")


@dataclass(frozen=True)
class GradBuffer:
    """One group's sharded gradients as one tensor."""

    buffer: torch.Tensor  # this rank's rows: every gradient of the group, padding zero
    grads: list[torch.Tensor]  # the DTensor ``.grad`` views it holds
    info: MeshInfo  # the group's mesh: reduce a norm over ``shard_group`` only

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.info.shard_group


def sharded_grad_buffers(
    grads: Sequence[torch.Tensor],
) -> tuple[list[GradBuffer], list[torch.Tensor]]:
    """Split ``grads`` into whole group buffers ([Note: Whole gradient buffers])
    and the rest, each in the order first seen. Costs O(len(grads)) C-level
    passes and O(groups) Python."""
    candidates: dict[int, tuple[object, list[torch.Tensor]]] = {}
    rest: list[torch.Tensor] = []
    for g in grads:
        base = getattr(getattr(g, "_local_tensor", None), "_base", None)
        ref = getattr(base, "_fsdp_rs_group", None) if base is not None else None
        group = ref() if ref is not None else None
        if group is None:
            rest.append(g)
            continue
        entry = candidates.get(id(base))
        if entry is None:
            entry = candidates[id(base)] = (group, [])
        entry[1].append(g)
    whole: list[GradBuffer] = []
    for group, passed in candidates.values():
        buffer, views = group._owned()
        params = group._grad_params
        if (
            buffer is not None
            and len(passed) == len(views)
            and set(map(id, passed)) == set(map(id, views))
            and all(map(operator.is_, map(_GRAD, params), views))
        ):
            whole.append(GradBuffer(buffer, passed, group.info))
        else:
            rest.extend(passed)
    return whole, rest
