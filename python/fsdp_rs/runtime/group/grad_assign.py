"""The sharded side of a group's gradients: the reduced gradients become (or are
added to) the ``.grad`` DTensor views of the sharded parameters, and the hooks
users registered on those parameters run.

[Note: Sharded gradient buffer]
The sharded ``.grad``s of a group are DTensor views of one buffer in the row
layout, made at the reduction that finds every ``.grad`` None (the reduce-scatter
writes it directly when nothing else is due), as FSDP2's are views of its
reduce-scatter output. fsdp-rs holds the buffer and the views weakly: they live
exactly as long as some ``.grad`` does, so ``zero_grad()`` (``set_to_none``)
frees the gradient memory and the next backward allocates it again group by
group, and a ``.grad`` the user kept is never written by a later backward. While
the views live, a reduction that finds them all in place accumulates into the
buffer with one post-reduce; anything else goes per parameter.

[Note: Post-accumulate-grad hooks]
Autograd never accumulates into a sharded parameter (forward uses the unsharded
one), so the hooks users register on it with
``register_post_accumulate_grad_hook`` (optimizer-in-backward: one optimizer per
parameter, stepped in the hook) are run here, as FSDP2 runs them: once per
parameter per reduction that assigns or adds to its ``.grad``, right after, on
the stream of that assignment. No reduction, no hook: a backward under
``set_requires_gradient_sync(False)`` or ``set_requires_all_reduce(False)``
(HSDP) runs none, and the next synced one runs each once. A parameter that
this rank had no gradient for gets its hook when the agreement assigns its
``.grad`` ([Note: Gradient agreement]); one no rank had a gradient for, none.
"""

from __future__ import annotations

import functools
import operator
import weakref

import torch
from torch.distributed.tensor import DTensor

from fsdp_rs.runtime.group.grad_buffers import take_parked
from fsdp_rs.runtime.group.params import is_none, own_accumulate_hooks, own_grads, set_own_grads

__all__ = ["GradAssignment"]

_DEREF = weakref.ref.__call__
# a DTensor (not a parameter) over a local shard: [Note: Cheap sharded parameters]
_NEW_GRAD_VIEW = functools.partial(DTensor.__new__, DTensor, requires_grad=False)


class GradAssignment:
    """One group's sharded gradient buffer and its ``.grad`` views, held by the
    group (``FSDPParamGroup.grad_assign``); every method takes the group.

    Reads of the group: ``_grad_params`` and ``_grad_index`` (the trainable
    sharded parameters and their indices), ``grad_layout``, ``grad_dtype``,
    ``reduce_dtype``, ``device``, ``sharded`` (its device), ``info.shard_size``,
    ``all_reduce_hook``, ``shard_ops`` (``post_reduce``) and ``sharding``
    (``grad_views``, ``spec_of``); ``take_parked`` reads and clears its
    ``_parked`` ([Note: Parked gradient buffers]). Writes: the ``.grad`` of the
    sharded parameters, and ``_fsdp_rs_group`` (a weak reference to the group)
    on each buffer it makes.

    Its own state: ``buffer_ref`` and ``view_refs``, weak references to the
    buffer and views of the last reduction ([Note: Sharded gradient buffer]);
    ``unagreed``, the post-reduced row whose parameters this rank had no gradient
    for wait on ([Note: Gradient agreement]); ``specs``, the views' specs per
    gradient layout and dtype."""

    __slots__ = ("buffer_ref", "specs", "unagreed", "view_refs")

    def __init__(self) -> None:
        self.buffer_ref = None
        self.view_refs = None
        self.unagreed: torch.Tensor | None = None
        # (the _grad_index they are for, dtype, a spec per trainable parameter)
        self.specs: tuple | None = None

    def forget_views(self) -> None:
        """Drop the weak references to the last buffer and views (the trainable
        parameters were read again: those are views of the old ones)."""
        self.buffer_ref = self.view_refs = None

    def owned(self, group) -> tuple[torch.Tensor | None, list]:
        """The gradient buffer of the last reduction while a ``.grad`` view of it
        lives (views keep their base alive), with its views (None where dead)."""
        buffer = None if self.buffer_ref is None else self.buffer_ref()
        if buffer is None:
            return None, [None] * len(group._grad_index)
        return buffer, list(map(_DEREF, self.view_refs))

    def whole(
        self, group, current: list[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, list] | None:
        """The last reduction's gradient buffer and its views where each view is
        alive and still its parameter's ``.grad`` (``current``: the ``.grad``s,
        read here if None); else None ([Note: Whole gradient buffers]). A view
        that died (its ``.grad`` cleared while a tensor on the buffer lives on)
        is None, and so is its ``.grad``, which must not count as one."""
        buffer, views = self.owned(group)
        if buffer is None or any(map(is_none, views)):
            return None
        if current is None:
            current = own_grads(group._grad_params)
        return (buffer, views) if all(map(operator.is_, current, views)) else None

    def new_buffer(self, group) -> tuple[torch.Tensor, list]:
        """A sharded gradient buffer and a ``.grad`` DTensor view per trainable
        parameter, held weakly ([Note: Sharded gradient buffer]); the parked
        ones where there are ([Note: Parked gradient buffers])."""
        parked = take_parked(group)
        if parked is not None:
            return parked
        buffer = self._new_sharded_grads(group, torch.empty)
        buffer._fsdp_rs_group = weakref.ref(group)  # for grad_buffers.sharded_grad_buffers
        local = group.sharding.grad_views(group, buffer)
        views = self._sharded_grad_views(group, local, buffer.dtype)
        self.buffer_ref = weakref.ref(buffer)
        self.view_refs = list(map(weakref.ref, views))
        return buffer, views

    @staticmethod
    def _new_sharded_grads(group, make) -> torch.Tensor:
        """A sharded buffer in the gradient layout, made by ``make`` (``torch.empty``
        or ``torch.zeros``) where the sharded parameters live, in the sharded
        gradient dtype (theirs unless [Note: Gradient dtype policy])."""
        sharded = group.sharded
        numel = group.grad_layout.plan.row_numel
        return make(numel, dtype=group.grad_dtype, device=sharded.device)

    def _sharded_grad_views(
        self, group, local: list[torch.Tensor], dtype: torch.dtype
    ) -> list[DTensor]:
        """A DTensor view of each trainable parameter's ``local`` shard (in
        ``dtype``): one C-level pass, the specs looked up once per gradient
        layout (a backward makes these views for every parameter)."""
        cached = self.specs
        if cached is None or cached[0] is not group._grad_index or cached[1] != dtype:
            spec_of = group.sharding.spec_of
            specs = [spec_of(group, i, dtype) for i in group._grad_index]
            cached = self.specs = (group._grad_index, dtype, specs)
        return list(map(_NEW_GRAD_VIEW, local, cached[2]))

    @staticmethod
    def reduces_into_buffer(
        group, had_grad: list[bool], current: list[torch.Tensor | None]
    ) -> bool:
        """Whether the reduce-scatter can write the sharded gradient buffer itself,
        as FSDP2's gradients are views of its reduce-scatter output: every
        parameter got a gradient and has no ``.grad`` (the usual step after
        ``zero_grad()``), the reduced gradient goes to no hook first, and needs
        no cast or move. A division then runs in place on the buffer, and HSDP's
        all-reduce too (the caller rules out a backward that leaves it partial):
        the reduce-scatter output is never a second gradient-sized buffer, which
        on an accelerator would stay allocated for the all-reduce stream until
        the end of backward ([Note: Cross-stream lifetimes])."""
        return (
            group.info.shard_size > 1
            and group.all_reduce_hook is None
            and group.grad_dtype == group.reduce_dtype
            and group.sharded.device == group.device
            and all(had_grad)
            and all(map(is_none, current))
        )

    def assign(
        self,
        group,
        output: torch.Tensor,
        divide: float,
        had_grad: list[bool],
        current: list[torch.Tensor | None] | None,
    ) -> None:
        """Post-reduce into the sharded gradient buffer, then make sure every
        parameter that got a gradient on this rank has a ``.grad`` view of it
        (``current``: their ``.grad`` before, None if not read yet). The others
        wait for the agreement ([Note: Gradient agreement])."""
        if current is None:
            current = own_grads(group._grad_params)
        if output.device != group.sharded.device:
            output = output.to(group.sharded.device)
        if all(had_grad):
            whole = self.whole(group, current)
            if whole is not None:  # accumulated in place
                group.shard_ops.post_reduce(output, whole[0], divide, True)
                return
            if all(map(is_none, current)):
                buffer, views = self.new_buffer(group)
                group.shard_ops.post_reduce(output, buffer, divide, False)
                set_own_grads(group._grad_params, views)
                return
        # Rare path (some gradients None, replaced by the user, or missing here).
        fresh = self._new_sharded_grads(group, torch.zeros)
        group.shard_ops.post_reduce(output, fresh, divide, False)
        self._assign_from(group, fresh, had_grad, current)
        if not all(had_grad):
            self.unagreed = fresh

    def assign_agreed(self, group, had_grad: list[bool], agreed: list[bool]) -> None:
        """Once the ranks agreed: assign the parameters some rank had a gradient
        for and this one had none for (on the stream of their post-reduce)."""
        fresh, self.unagreed = self.unagreed, None
        wanted = [a and not h for a, h in zip(agreed, had_grad, strict=True)]
        if any(wanted):
            self._assign_from(group, fresh, wanted, own_grads(group._grad_params))
            self.run_accumulate_hooks(group, wanted)

    @staticmethod
    def run_accumulate_hooks(group, which: list[bool]) -> None:
        """[Note: Post-accumulate-grad hooks] on the parameters ``which`` marks."""
        params = group._grad_params
        if not own_accumulate_hooks(params):  # the usual case: one C-level pass
            return
        for param, assigned in zip(params, which, strict=True):
            hooks = param._post_accumulate_grad_hooks
            if assigned and hooks:
                for hook in list(hooks.values()):
                    hook(param)

    def _assign_from(
        self, group, fresh: torch.Tensor, which: list[bool], current: list[torch.Tensor | None]
    ) -> None:
        """Per parameter, the ``which`` ones: ``fresh`` (post-reduced, in the
        sharded layout) becomes or is added to its ``.grad``."""
        fresh_views = group.sharding.grad_views(group, fresh)
        spec_of = group.sharding.spec_of
        for k, (i, p) in enumerate(zip(group._grad_index, group._grad_params, strict=True)):
            if not which[k]:
                continue
            if current[k] is None:  # a view of ``fresh``, as a fresh reduction would give
                local = fresh_views[k]
                p.grad = _NEW_GRAD_VIEW(local, spec_of(group, i, local.dtype))
                self.buffer_ref = None  # views of two buffers: no whole-buffer accumulation
            else:
                current[k]._local_tensor.add_(fresh_views[k].to(current[k].dtype))
