"""Groups with all-gather extensions under the traced hooks ([Note: Traced
hooks], [Note: All-gather extensions]).

[Note: Extensions under trace]
Dynamo cannot call an extension's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``: they are methods of a tensor subclass, which it has
no rule for. So such a group's unshard is one function that Dynamo puts in
the graph as a single call (``torch._dynamo.allow_in_graph``) and AOT autograd
traces op by op, running the extension's own Python on its fake tensors: the
eager unshard's steps, by its functions (each parameter's all-gather inputs,
``inputs_of``; one byte buffer, ``pack``; the functional all-gather; each
input's bytes back, ``unpack`` and ``as_output``, into fresh tensors where
eager refills the ones it keeps; ``fsdp_post_all_gather`` without
``out=``), then ``_Bridge``, whose backward is the group's gradient reduction
(``ops.traced.Reduction``) into the sharded local tensors, as the copy-out's
formula is for a plain group. The reduction's flags are arguments
of the call, so that Dynamo guards on them as it does on a plain group's.

AOT autograd rebuilds each local tensor from its inner tensors with its
class's ``__tensor_unflatten__``, so only an extension that class defines, and
rebuilds, can run there: ``set_fullgraph_compile`` refuses a group whose
extension was set on a local tensor's instance (as FSDP2's tests patch them),
or whose class has no ``__tensor_flatten__`` or rebuilds another class (torch's
``TwoTensor`` rebuilds a ``TwoTensor`` for every subclass of it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_rs.ops.traced import all_gather_rows, chained, reduction
from fsdp_rs.runtime.variants.extensions import (
    POST_ALL_GATHER,
    PRE_ALL_GATHER,
    as_output,
    has_extension,
    pack,
    plain_grad,
    unpack,
)

__all__ = ["extension_gather", "untraceable"]


def untraceable(group) -> str | None:
    """Why the extensions of ``group`` cannot be traced ([Note: Extensions
    under trace]), or None."""
    for fqn, p in zip(group.managed.fqns, group.sharded_params, strict=True):
        local = p._local_tensor
        if not has_extension(local):
            continue
        cls = type(local)
        if PRE_ALL_GATHER in vars(local) or POST_ALL_GATHER in vars(local):
            return (
                f"the all-gather extension of parameter {fqn} is set on its local tensor, "
                "which torch.compile cannot see: define it on a tensor subclass"
            )
        flatten = getattr(local, "__tensor_flatten__", None)
        if flatten is None:
            return (
                f"parameter {fqn}'s local tensor is a {cls.__name__}, which torch.compile "
                "cannot trace (it has no __tensor_flatten__ / __tensor_unflatten__)"
            )
        try:
            names, meta = flatten()
            inner = {name: getattr(local, name) for name in names}
            rebuilt = cls.__tensor_unflatten__(inner, meta, local.size(), local.stride())
        except Exception as e:  # torch.compile would call them too
            return (
                f"rebuilding parameter {fqn}'s local tensor ({cls.__name__}) from its "
                f"__tensor_flatten__ raised {type(e).__name__}: {e}"
            )
        if type(rebuilt) is not cls:
            return (
                f"{cls.__name__}.__tensor_unflatten__ (parameter {fqn}) makes a "
                f"{type(rebuilt).__name__}, so torch.compile would lose its all-gather "
                f"extension: make it return a {cls.__name__}"
            )
    return None


class _Bridge(torch.autograd.Function):
    """The unsharded parameters an extension made (not differentiable: made
    from the all-gather) passed through, with the group's gradient reduction
    into the trained parameters' sharded local tensors as their backward."""

    @staticmethod
    def forward(ctx, reduce, count: int, token, *tensors):  # type: ignore[override]
        ctx.reduce, ctx.count = reduce, count
        ctx.set_materialize_grads(False)  # [Note: Unused parameters under trace]
        outs = tuple(t.view_as(t) for t in tensors[:count])
        trained = set(reduce.trained)
        frozen = [out for i, out in enumerate(outs) if i not in trained]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        # [Note: Every group's backward on every rank]
        ctx.device = token.device
        return (*outs, token.new_empty(0))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        sharded = ctx.reduce([plain_grad(g) for g in grads[:-1]], grads[-1])
        return (None, None, chained(grads[-1], ctx.device), *([None] * ctx.count), *sharded)


def extension_gather(traced) -> Callable:
    """The unshard of ``traced``'s extension group: a function of the
    reduction flags, the previous group's token, the gradient layout's tables
    and every parameter's local tensor that returns the unsharded parameters,
    the group's token and its all-gather output ([Note: Extensions under
    trace], [Note: Regathered on every rank])."""
    group = traced.group
    count = len(traced.grad_tables)
    chunks = group.plan.chunk_rows.tolist()
    world = traced.world

    def gather(reduce_op, all_reduce_op, pre, post, token, *tensors):
        # token: the previous group's ([Note: Every group's backward on every
        # rank]); tensors: the gradient layout's tables (graph inputs, as every
        # tensor the graph reads must be), then every parameter's local tensor
        tables, local = tensors[:count], tensors[count:]
        with torch.no_grad():  # as the eager unshard
            inputs_of = group.gather.inputs_of
            per_param = [inputs_of(group, i, t, chunks[i]) for i, t in enumerate(local)]
            gathered = all_gather_rows(pack(per_param), world, traced.group_name)
            unpacked = unpack(gathered, per_param)
            unsharded = []
            for i, (ins, metadata) in enumerate(per_param):
                # fresh tensors (functional), where eager refills the ones it keeps
                outputs = [
                    as_output(columns.contiguous().view(t.dtype), t)
                    for t, columns in zip(ins, unpacked[i], strict=True)
                ]
                extension = getattr(local[i], POST_ALL_GATHER, None)
                if extension is None:  # the all-gather output is the parameter's data
                    tensor = outputs[0]
                else:
                    tensor, _ = extension(tuple(outputs), metadata, group.param_dtype)
                unsharded.append(torch.as_strided(tensor, group.shapes[i], group.strides[i], 0))
        if not traced.trained:
            return [*unsharded, token.new_empty(0), gathered]
        reduce = reduction(
            world,
            group.device,
            [local[i] for i in traced.trained],
            traced.grad_offsets,
            traced.group_name,
            reduce_op,
            pre,
            post,
            group.reduce_dtype,
            traced.replicate_name,
            all_reduce_op,
            traced.trained,
            tables,
            traced.grad_row_numel,
            None,
        )
        trained = [local[i] for i in traced.trained]
        bridged = _Bridge.apply(reduce, len(unsharded), token, *unsharded, *trained)
        return [*bridged, gathered]

    return torch._dynamo.allow_in_graph(gather)
