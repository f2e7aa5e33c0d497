"""The runtime's public view of the sharded gradient buffers, for code above it
(``fsdp_rs.optim``) that works per group instead of per parameter.

[Note: Whole gradient buffers]
A group's sharded ``.grad``s are DTensor views of one buffer in the row layout
of its trainable parameters ([Note: Sharded gradient buffer], [Note: Gradient
layout]); its padding holds zeros, which every reduction writes. When every view of a live
buffer is still its parameter's ``.grad`` and the caller passed every one of
them, an elementwise operation over all of those gradients (a scale) or a
reduction that zeros do not change (a p-norm, p > 0) can run once over the
buffer, bit for bit the same per element as over each gradient. Anything else
(a ``.grad`` the user replaced or set, a gradient made by the rare per-parameter
path, only some of a group's gradients passed) is left to the caller's
per-gradient path.

[Note: Parked gradient buffers]
A backward that finds every ``.grad`` None (the step after ``zero_grad()``)
makes a new sharded gradient buffer and a DTensor view per parameter ([Note:
Sharded gradient buffer]): two Python objects per parameter every step, made,
traversed by the garbage collector while they live and freed again at the next
``zero_grad``, the larger part of a step's cost per parameter. ``FlatOptimizer.zero_grad``
(fsdp-rs's own, which knows the groups) instead parks a group's buffer where it
can tell nothing outside fsdp-rs holds it: every view was its parameter's
``.grad`` and ``zero_grad`` cleared them all, and afterwards no Python reference
remains to a view or its local tensor but fsdp-rs's own, and no tensor but the
buffer and the views shares its storage (the reference counts and the storage's
use count say so, in C-level passes). Then the storage is resized to 0 bytes, so
the memory is freed at ``zero_grad`` as FSDP2 frees it, and the next reduction
that would make a new buffer resizes it back and assigns the same views again,
in the same layout and dtype: bits and memory as a new buffer's, no object made.
Anything else (a ``.grad`` the user kept, or its local tensor or a view of it, a
gradient layout or dtype changed since, ``zero_grad`` from another optimizer or
the module) takes the usual path, so a kept ``.grad`` is never written by a
later backward. Views held through a tensor weak reference are fixed first
(``_fix_weakref``), as torch requires for a tensor whose other references go.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from fsdp_rs.runtime.comm.mesh import MeshInfo
from fsdp_rs.runtime.group.params import is_none, own_grads

__all__ = [
    "GradBuffer",
    "ShardedBuffer",
    "hold_grads",
    "local_tensor",
    "park_grads",
    "sharded_buffers",
    "sharded_grad_buffers",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _group_of(t: torch.Tensor):
    """The group whose sharded or gradient buffer ``t``'s local tensor views."""
    base = _local_base(t)
    ref = getattr(base, "_fsdp_rs_group", None) if base is not None else None
    return ref() if ref is not None else None


@dataclass(frozen=True)
class GradBuffer:
    """One group's sharded gradients as one tensor."""

    buffer: torch.Tensor  # this rank's rows: every gradient of the group, padding zero
    grads: list[torch.Tensor]  # the DTensor ``.grad`` views it holds


def sharded_grad_buffers(
    grads: Sequence[torch.Tensor],
) -> tuple[list[GradBuffer], list[torch.Tensor]]:
    """Split ``grads`` into whole group buffers ([Note: Whole gradient buffers])
    and the rest, each in the order first seen. Costs O(len(grads)) C-level
    passes and O(groups) Python."""
    try:
        bases = list(map(_LOCAL_BASE, grads))
    except AttributeError:  # a plain tensor among them: its base is None, as a non-view's
        bases = list(map(_local_base, grads))
    per_base = Counter(map(id, bases))  # how many of ``grads`` view each base
    # id -> base (the first seen is written last)
    first = dict(zip(map(id, reversed(bases)), reversed(bases), strict=True))
    passed = set(map(id, grads))
    whole: list[GradBuffer] = []
    covered: set[int] = set()
    for i, count in per_base.items():
        ref = getattr(first[i], "_fsdp_rs_group", None)
        group = ref() if ref is not None else None
        found = group.grad_assign.whole(group) if group is not None else None
        # every view passed, once each (a gradient passed twice is scaled twice):
        # as many gradients view this buffer as it has views, and each view is one
        if (
            found is not None
            and found[0] is first[i]
            and count == len(found[1])
            and all(map(passed.__contains__, map(id, found[1])))
        ):
            whole.append(GradBuffer(found[0], found[1]))
            covered.add(i)
    if len(covered) == len(per_base):
        return whole, []
    rest = [g for g, b in zip(grads, bases, strict=True) if id(b) not in covered]
    return whole, rest


_LOCAL_BASE = operator.attrgetter("_local_tensor._base")


def _local_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a DTensor's local shard is a view of (None for a plain tensor)."""
    return getattr(getattr(t, "_local_tensor", None), "_base", None)


@dataclass(eq=False)
class ShardedBuffer:
    """One group's sharded parameters as one buffer: what an optimizer needs to
    step runs of them over flat tensors ([Note: Flat optimizer] in
    ``fsdp_rs/optim/flat.py``)."""

    sharded: torch.Tensor  # this rank's row, 1-D, the parameters' dtype; padding zero
    params: list[torch.Tensor]  # the group's sharded DTensor parameters, in buffer order
    offsets: list[int]  # where each parameter's local elements start in ``sharded``
    numels: list[int]  # how many local elements it has
    # where each trainable parameter's gradient starts in the group's gradient
    # buffer of ``grad_numel`` elements, -1 for a frozen one ([Note: Gradient
    # layout] in ``runtime/group/gradients.py``)
    grad_offsets: list[int]
    grad_numel: int
    info: MeshInfo
    _group: object  # weak reference to the runtime's group
    _grad_layout: object  # the group's gradient layout these offsets are of

    def current(self) -> bool:
        """Whether the group still keeps its parameters in ``sharded`` (it moves
        them to a new buffer when it adopts re-registered parameters) and its
        gradients in the same layout (which changes with the trainable set)."""
        group = self._group()
        return (
            group is not None
            and group.sharded is self.sharded
            and group.grad_layout is self._grad_layout
        )

    def whole_grad_buffer(self) -> torch.Tensor | None:
        """The group's gradient buffer when every trainable parameter's ``.grad``
        is its view ([Note: Whole gradient buffers]), else None."""
        group = self._group()
        found = group.grad_assign.whole(group) if group is not None else None
        return found[0] if found is not None else None


def sharded_buffers(
    params: Sequence[torch.Tensor],
) -> tuple[list[ShardedBuffer], list[torch.Tensor]]:
    """The fsdp-rs groups whose sharded parameters are among ``params`` (each
    once, first seen first) and the parameters of ``params`` no group holds."""
    found: dict[int, ShardedBuffer] = {}
    others: list[torch.Tensor] = []
    for p in params:
        group = _group_of(p)
        if group is None or group.sharded is not p._local_tensor._base:  # not a parameter
            others.append(p)
            continue
        if group.grad_dtype != group.sharded.dtype:
            # gradients in another dtype ([Note: Gradient dtype policy]): torch's
            # optimizers step such a parameter per tensor, if at all
            others.append(p)
            continue
        if id(group) in found:
            continue
        layout, grad_layout = group.layout, group.grad_layout
        numels = layout.sharded_numels()
        grad_offsets = [-1] * len(numels)
        if group._grad_index:
            for i, off in zip(group._grad_index, grad_layout.row_offsets, strict=True):
                grad_offsets[i] = off
        found[id(group)] = ShardedBuffer(
            group.sharded,
            list(group.sharded_params),
            list(layout.row_offsets),
            numels,
            grad_offsets,
            grad_layout.plan.row_numel,
            group.info,
            weakref.ref(group),
            grad_layout,
        )
    return list(found.values()), others


_LOCAL = operator.attrgetter("_local_tensor")
_FIX_WEAKREF = torch.Tensor._fix_weakref


def hold_grads(groups: Sequence) -> list:
    """Before a ``zero_grad`` clears the ``.grad``s: keep each group's gradient
    buffer and views alive where they are its ``.grad``s, for ``park_grads``;
    returns the groups holding ([Note: Parked gradient buffers])."""
    holding = []
    for group in groups:
        if group._parked is not None or group._holding is not None:
            continue
        found = group.grad_assign.whole(group)
        if found is not None:
            deque(map(_FIX_WEAKREF, found[1]), maxlen=0)
            group._holding = found
            holding.append(group)
    return holding


def park_grads(groups: Sequence) -> None:
    """After ``zero_grad`` cleared the ``.grad``s: free each held buffer's memory
    and keep it and its views for the group's next reduction where nothing
    outside fsdp-rs holds them; else let them go ([Note: Parked gradient
    buffers])."""
    for group in groups:
        held, group._holding = group._holding, None
        if held is not None:
            _park(group, *held)


def _park(group, buffer: torch.Tensor, views: list[DTensor]) -> None:
    if not all(map(is_none, own_grads(group._grad_params))):
        return
    locals_ = list(map(_LOCAL, views))
    listed = next(map(sys.getrefcount, [object()]))  # an object a list alone holds
    storage = buffer.untyped_storage()
    if (
        set(map(sys.getrefcount, views)) != {listed}
        or set(map(sys.getrefcount, locals_)) != {listed + 1}  # and its DTensor
        # the buffer, the views' local tensors and ``storage`` itself
        or torch._C._storage_Use_Count(storage._cdata) != len(views) + 2
    ):
        return
    storage.resize_(0)
    group._parked = (buffer, views, group.grad_layout, group.grad_dtype)


def take_parked(group) -> tuple[torch.Tensor, list[DTensor]] | None:
    """The group's parked buffer, its storage allocated again, and its views,
    where they fit its current gradient layout and dtype; None otherwise (a
    parked one is dropped then) ([Note: Parked gradient buffers])."""
    parked, group._parked = group._parked, None
    if parked is None:
        return None
    buffer, views, layout, dtype = parked
    ref = group.grad_assign.buffer_ref
    if layout is not group.grad_layout or dtype != group.grad_dtype or ref is None:
        return None
    if ref() is not buffer or buffer.device != group.sharded.device:
        return None
    buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
    return buffer, views
