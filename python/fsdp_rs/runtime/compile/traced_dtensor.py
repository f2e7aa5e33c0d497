"""The DTensor ends of the traced hooks ([Note: Traced hooks]): the sharded
parameters' local tensors going in, the unsharded parameters as DTensors of
their own specs (or, annotated with spmd_types, plain) coming out, each with
the backward the eager post-backward gives their gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._api import _ToTorchTensor

__all__ = ["local_of", "unsharded_as"]


class _LocalOf(_ToTorchTensor):
    """``DTensor.to_local()`` whose backward passes a missing gradient on as
    missing ([Note: The local tensors' missing gradients])."""

    @staticmethod
    def forward(ctx, dtensor, grad_placements):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return _ToTorchTensor.forward(ctx, dtensor, grad_placements)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None
        return _ToTorchTensor.backward(ctx, grad)


@torch._dynamo.allow_in_graph
def local_of(param: torch.Tensor) -> torch.Tensor:
    """[Note: The local tensors' missing gradients]
    The copy-out's formula gives no gradient to the local tensor of a parameter
    nothing used ([Note: Unused parameters under trace]); that must reach the
    DTensor parameter as no gradient. ``DTensor.to_local()``'s backward on torch
    before 2.10 turns a missing gradient into zeros (its autograd function
    materializes them), so there such a parameter got a zero gradient, which
    optimizers step (weight decay, momentum) where eager skips it. This is the
    same function with missing gradients passed on, as torch 2.10+ does; Dynamo
    puts it in the graph as one call, as it does ``to_local``."""
    return _LocalOf.apply(param, None)


class _FromLocalKeeping(torch.autograd.Function):
    """``DTensor.from_local`` whose backward leaves the gradient's placements
    on the DP dims as autograd made them.

    [Note: DP dims under trace]
    With ``dp_mesh_dims`` an unsharded parameter is a DTensor on the full mesh,
    ``Replicate()`` on the DP dims. The module's inputs are sharded there, so
    autograd hands its gradient ``Partial`` on the DP dims; eager reads the
    local tensor as it is and the reduce-scatter sums it, once
    (``DTensorParam.local_grad``). ``DTensor.from_local``'s backward would
    first bring it to the forward's ``Replicate()``, an all-reduce, and the
    reduce-scatter would then sum that sum: every gradient times the DP size.
    Its ``grad_placements`` (torch >= 2.13) cannot say "as it comes": a
    gradient ``Replicate()`` there (inputs replicated over DP) would be
    divided to a ``Partial``, where eager sums it as it is. So this backward
    is eager's own ``local_grad``, run when AOT autograd traces it: the DP
    dims' placements kept, the others (TP) brought to the parameter's own."""

    @staticmethod
    def forward(ctx, local, nd, spec):  # type: ignore[override]
        ctx.nd = nd
        ctx.set_materialize_grads(False)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None
        return ctx.nd.local_grad(grad), None, None


class _TypedLocal(torch.autograd.Function):
    """An annotated parameter's plain unsharded tensor, passed through; its
    backward reads the plain gradient as the DTensor of the parameter's
    backward types and brings it to the local tensor eager reduces
    (``DTensorParam.typed_grad`` then ``local_grad``, [Note: spmd_types
    parameters])."""

    @staticmethod
    def forward(ctx, local, nd):  # type: ignore[override]
        ctx.nd = nd
        ctx.set_materialize_grads(False)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None
        return ctx.nd.local_grad(ctx.nd.typed_grad(grad)), None


def unsharded_as(nd, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the module computes with, made from the unsharded local tensor of
    the DTensor parameter ``nd`` (a ``DTensorParam``; None: a plain one, used
    as it is), in the parameter dtype ``dtype``, with the backward that hands
    the copy-out the local tensor of its gradient as the eager post-backward
    reads it:

    - TP / EP: a DTensor of the parameter's own spec, by ``DTensor.from_local``
      (whose backward brings the gradient to those placements: a ``Partial``
      from sequence parallelism reduced over its dim);
    - ``dp_mesh_dims``: the same, but ``_FromLocalKeeping``;
    - spmd_types: the plain tensor, ``_TypedLocal``.

    The last two are functions of the tensor alone, which Dynamo puts in the
    graph as one call each (it cannot build the gradient's DTensor itself);
    AOT autograd traces their backward."""
    if nd is None:
        return None
    if nd.annotation is not None:

        def typed(local: torch.Tensor) -> torch.Tensor:
            return _TypedLocal.apply(local, nd)

        return torch._dynamo.allow_in_graph(typed)
    spec = nd.unsharded_spec(dtype)
    if nd.keep_on_dims:

        def keeping(local: torch.Tensor) -> torch.Tensor:
            return _FromLocalKeeping.apply(local, nd, spec)

        return torch._dynamo.allow_in_graph(keeping)
    meta = spec.tensor_meta

    def own(local: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride
        )

    return own
