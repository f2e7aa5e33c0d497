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

import math
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rs.runtime.mesh import MeshInfo
from fsdp_rs.runtime.params import is_none

__all__ = ["GradBuffer", "ShardedBuffer", "sharded_buffers", "sharded_grad_buffers"]

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


@dataclass(eq=False)
class ShardedBuffer:
    """One group's sharded parameters as one buffer: what an optimizer needs to
    step runs of them over flat tensors ([Note: Flat optimizer] in
    ``fsdp_rs/optim/flat.py``)."""

    sharded: torch.Tensor  # this rank's row, 1-D, the parameters' dtype; padding zero
    params: list[torch.Tensor]  # the group's sharded DTensor parameters, in buffer order
    offsets: list[int]  # where each parameter's local elements start in ``sharded``
    numels: list[int]  # how many local elements it has
    info: MeshInfo
    _group: object  # weak reference to the runtime's group

    def current(self) -> bool:
        """Whether the group still keeps its parameters in ``sharded`` (it moves
        them to a new buffer when it adopts re-registered parameters)."""
        group = self._group()
        return group is not None and group.sharded is self.sharded

    def whole_grad_buffer(self) -> torch.Tensor | None:
        """The group's gradient buffer when every trainable parameter's ``.grad``
        is its view ([Note: Whole gradient buffers]), else None."""
        group = self._group()
        if group is None:
            return None
        buffer, views = group._owned()
        if (
            buffer is None
            or any(map(is_none, views))
            or not all(map(operator.is_, map(_GRAD, group._grad_params), views))
        ):
            return None
        return buffer


def _group_of(p: torch.Tensor):
    base = getattr(getattr(p, "_local_tensor", None), "_base", None)
    ref = getattr(base, "_fsdp_rs_group", None) if base is not None else None
    group = ref() if ref is not None else None
    return group if group is not None and group.sharded is base else None


def sharded_buffers(
    params: Sequence[torch.Tensor],
) -> tuple[list[ShardedBuffer], list[torch.Tensor]]:
    """The fsdp-rs groups whose sharded parameters are among ``params`` (each
    once, first seen first) and the parameters of ``params`` no group holds."""
    found: dict[int, ShardedBuffer] = {}
    others: list[torch.Tensor] = []
    for p in params:
        group = _group_of(p)
        if group is None:
            others.append(p)
            continue
        if id(group) in found:
            continue
        layout = group.layout
        numels = [math.prod(s) for s in layout.sharded_sizes]
        found[id(group)] = ShardedBuffer(
            group.sharded,
            list(group.sharded_params),
            list(layout.row_offsets),
            numels,
            group.info,
            weakref.ref(group),
        )
    return list(found.values()), others
