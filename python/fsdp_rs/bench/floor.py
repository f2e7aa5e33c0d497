"""The floor under a ``fully_shard`` group's host cost: the torch calls any
FSDP makes per parameter at sharding and per group and step, made bare.

[Note: The floor]
fsdp-rs's targets are host time per parameter (``fully_shard``) and per group
and step (the hooks). Part of that time is not bookkeeping but calls every FSDP
makes, whatever language holds its state: at ``fully_shard``, per parameter, a
copy of its shard (``torch._chunk_cat``), a view of the sharded buffer and a
DTensor over it, and the swap into its module; per group and step, the module
hooks torch dispatches, the autograd hooks registered on an input and an
output, two all-gathers (forward and backward) and one reduce-scatter, their
output buffers, the copy-out and copy-in around them (one ``index_select``
each, as fsdp-rs copies on CPU, into gradients autograd accumulates in place
as fsdp-rs pre-places them), and the swaps of the parameters. ``bare_shard``
makes those calls and nothing else, for blocks of one dtype: it plans nothing
(the rows are ``_chunk_cat``'s, without FSDP2's alignment), checks nothing,
handles no policy, no missing gradient, no shared parameter, no stream, no
``torch.compile``, no second forward, and keeps no state a user could observe
beyond its modules' parameters. Its training is a forward and backward with
FSDP's collectives; it is not FSDP (its gradients are not divided, and the
first group's gradients are reduced only at the end of the backward).

``bench init`` and ``bench step --optimizer none`` time it beside fsdp-rs and
FSDP2 as the ``floor`` column: the distance from it is what fsdp-rs's Python
still costs, and a target below it cannot be met by any FSDP whose groups run
their own hooks and collectives.
"""

from __future__ import annotations

import functools
import gc
import operator
from collections import deque
from itertools import repeat

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_rs.runtime.comm.collectives import _PG_ALL_GATHER, _PG_REDUCE_SCATTER

__all__ = ["bare_shard"]

_NEW_PARAM = functools.partial(DTensor.__new__, DTensor, requires_grad=True)
_NEW_GRAD = functools.partial(DTensor.__new__, DTensor, requires_grad=False)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


_FIRST, _SECOND, _THIRD = map(operator.itemgetter, range(3))


def _full_stride(local: tuple) -> tuple[int, ...]:
    return local[2].tensor_meta.stride


def _set(dicts: list[dict], names: list[str], values: list) -> None:
    """``dicts[k][names[k]] = values[k]`` for every k, in one C-level pass."""
    deque(map(dict.__setitem__, dicts, names, values), maxlen=0)


class _BareGroup:
    """One module's parameters, sharded bare; see [Note: The floor]."""

    def __init__(self, module: nn.Module, mesh, specs: dict, backward: _Backward) -> None:
        self.pg = mesh.get_group()
        world, rank = mesh.size(), mesh.get_local_rank()
        self.world = world
        self.backward = backward
        slots = [
            (m._parameters, name)
            for m in module.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        self.dicts = [d for d, _ in slots]
        self.names = [name for _, name in slots]
        params = list(map(dict.__getitem__, self.dicts, self.names))
        with torch.no_grad():
            rows = torch._chunk_cat(params, 0, world)  # (world, row): every rank's shard
        self.sharded = rows[rank].clone()
        self.shapes = list(map(operator.attrgetter("shape"), params))
        # per distinct shape (across groups): this rank's padded shard, its
        # strides and the sharded parameter's spec
        for shape in set(self.shapes).difference(specs):  # one dtype: the bench models
            local = torch.Size((-(-shape[0] // world), *shape[1:]))
            meta = TensorMeta(shape, _contiguous_stride(shape), self.sharded.dtype)
            specs[shape] = (local, _contiguous_stride(local), DTensorSpec(mesh, (Shard(0),), meta))
        self.local = list(map(specs.__getitem__, self.shapes))
        local_shapes = list(map(_FIRST, self.local))
        chunk = np.fromiter(map(torch.Size.numel, local_shapes), np.int64, len(local_shapes))
        self.chunks = chunk.tolist()
        self.offsets = np.concatenate(([0], np.cumsum(chunk)[:-1])).tolist()
        views = list(
            map(self.sharded.as_strided, local_shapes, map(_SECOND, self.local), self.offsets)
        )
        self.sharded_params = list(map(_NEW_PARAM, views, map(_THIRD, self.local)))
        deque(map(setattr, self.sharded_params, repeat("_is_param"), repeat(True)), maxlen=0)
        _set(self.dicts, self.names, self.sharded_params)
        self.unsharded_params: list[nn.Parameter] | None = None

    def _make_unsharded(self) -> None:
        """At the first unshard, as FSDP2 and fsdp-rs make them: the unsharded
        buffer holds each param's (world, chunk) rows in turn; each unsharded
        param aliases its storage with a version counter of its own (a view
        would share the buffer's, which the backward's copy-out bumps). Then
        what makes the copies one op each: the gradient buffer, in the same
        layout, with a view per param that autograd accumulates into (as
        fsdp-rs pre-places them), the index from the all-gather's rank-major
        rows to that layout and its inverse, the reduce-scatter's input and
        output, and the sharded gradients viewing the output."""
        world, dtype, row = self.world, self.sharded.dtype, self.sharded.numel()
        self.unsharded = torch.empty(world * row, dtype=dtype)
        starts = [world * offset for offset in self.offsets]
        storage = self.unsharded.untyped_storage()
        full_strides = list(map(_full_stride, self.local))
        self.unsharded_params = [
            nn.Parameter(torch.empty(0, dtype=dtype).set_(storage, s, shape, shape_stride))
            for s, shape, shape_stride in zip(starts, self.shapes, full_strides, strict=True)
        ]
        self.grad_buffer = torch.zeros(world * row, dtype=dtype)
        self.grad_aliases = list(
            map(self.grad_buffer.as_strided, self.shapes, full_strides, starts)
        )
        # position u of the unsharded layout (param i, rank r, element j of its
        # chunk) reads the all-gather output at r * row + offset_i + j
        chunks = np.asarray(self.chunks, np.int64)
        param = np.repeat(np.arange(len(chunks)), world * chunks)
        within = np.arange(world * row) - np.repeat(starts, world * chunks)
        rank, j = within // chunks[param], within % chunks[param]
        gather = rank * row + np.asarray(self.offsets, np.int64)[param] + j
        self.gather_index = torch.from_numpy(gather)
        self.scatter_index = torch.from_numpy(np.argsort(gather))
        self.rs_input = torch.empty(world * row, dtype=dtype)
        self.grad_row = torch.zeros_like(self.sharded)
        local_shapes = list(map(_FIRST, self.local))
        grad_views = map(
            self.grad_row.as_strided, local_shapes, map(_SECOND, self.local), self.offsets
        )
        self.sharded_grads = list(map(_NEW_GRAD, grad_views, map(_THIRD, self.local)))
        rs_opts = ReduceScatterOptions()
        rs_opts.reduceOp = dist.ReduceOp.SUM
        # the process group's own methods, bound once, as fsdp-rs calls them
        # ([Note: Direct collectives])
        self.all_gather = getattr(self.pg, _PG_ALL_GATHER)
        self.reduce_scatter = getattr(self.pg, _PG_REDUCE_SCATTER)
        self.ag_opts, self.rs_opts = AllgatherOptions(), rs_opts

    def unshard(self) -> None:
        if self.unsharded_params is None:
            self._make_unsharded()
        ag = torch.empty(self.world * self.sharded.numel(), dtype=self.sharded.dtype)
        self.all_gather(ag, self.sharded, self.ag_opts).wait()
        torch.index_select(ag, 0, self.gather_index, out=self.unsharded)
        _set(self.dicts, self.names, self.unsharded_params)

    def pre_forward(self, module: nn.Module, args: tuple):
        self.unshard()
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x = x.view_as(x)
            x.grad_fn.register_prehook(self.post_backward)
            return (x, *args[1:])
        return None

    def post_forward(self, module: nn.Module, args: tuple, output):
        _set(self.dicts, self.names, self.sharded_params)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self.pre_backward)
        return None

    def pre_backward(self, grad: torch.Tensor) -> None:
        backward = self.backward
        if not backward.begun:
            torch.autograd.Variable._execution_engine.queue_callback(backward.end)
            backward.begun = True
        backward.pending[id(self)] = self
        self.unshard()
        self.grad_buffer.zero_()
        deque(map(setattr, self.unsharded_params, repeat("grad"), self.grad_aliases), maxlen=0)

    def post_backward(self, grads: tuple) -> None:
        self.backward.pending.pop(id(self), None)
        with torch.no_grad():
            torch.index_select(self.grad_buffer, 0, self.scatter_index, out=self.rs_input)
            self.reduce_scatter(self.grad_row, self.rs_input, self.rs_opts).wait()
        deque(map(setattr, self.unsharded_params, repeat("grad"), repeat(None)), maxlen=0)
        deque(map(setattr, self.sharded_params, repeat("grad"), self.sharded_grads), maxlen=0)
        _set(self.dicts, self.names, self.sharded_params)
        return None


class _Backward:
    """The groups whose pre-backward ran and post-backward did not (yet): at
    the end of the backward (the first group's input needs no gradient, so no
    hook on it runs) their gradients are reduced."""

    def __init__(self) -> None:
        self.begun = False
        self.pending: dict[int, _BareGroup] = {}

    def end(self) -> None:
        pending = list(self.pending.values())
        self.pending.clear()
        self.begun = False
        for group in pending:
            group.post_backward(())


def bare_shard(model: nn.Module, mesh) -> None:
    """Shard ``model.blocks`` (each its own group) bare, over ``mesh``; see
    [Note: The floor]. The root holds no parameters in the bench models."""
    backward, specs = _Backward(), {}
    enabled = gc.isenabled()
    gc.disable()  # as fsdp-rs's fully_shard: the collector would scan what it makes
    try:
        for block in model.blocks:
            group = _BareGroup(block, mesh, specs, backward)
            block.register_forward_pre_hook(group.pre_forward)
            block.register_forward_hook(group.post_forward)
    finally:
        if enabled:
            gc.enable()
