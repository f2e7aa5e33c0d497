"""The DTensor ends of the traced hooks ([Note: Traced hooks]): the sharded
parameters' local tensors going in, the unsharded parameters as DTensors of
their own specs (or, annotated with spmd_types, plain) coming out, each with
the backward the eager post-backward gives their gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._api import _ToTorchTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["from_local", "local_of", "typed_local"]


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
    on the ``keep`` dims as autograd made them.

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
    reads the gradient's placements when AOT autograd traces it and keeps them
    on the DP dims, bringing only the others (TP) to the parameter's own, as
    eager does. Dynamo puts it in the graph as one call, with the mesh and
    placements as constants, as it does ``from_local``."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride, keep):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.mesh, ctx.placements, ctx.keep = mesh, placements, keep
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, local.dtype))
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None, None
        own = ctx.placements
        target = tuple(grad.placements[i] if i in ctx.keep else p for i, p in enumerate(own))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(ctx.mesh, target)
        return grad.to_local(), None, None, None, None, None


@torch._dynamo.allow_in_graph
def _from_local_keeping(local, mesh, placements, shape, stride, keep):
    return _FromLocalKeeping.apply(local, mesh, placements, shape, stride, keep)


def from_local(local: torch.Tensor, spec: DTensorSpec, keep: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a DTensor of ``spec``. Its backward brings the gradient to
    ``spec``'s placements (a ``Partial`` from sequence parallelism reduced over
    its dim), as the eager post-backward does, except on the ``keep`` dims."""
    meta = spec.tensor_meta
    if keep:
        return _from_local_keeping(local, spec.mesh, spec.placements, meta.shape, meta.stride, keep)
    return DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride
    )


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


def typed_local(nd) -> Callable[[torch.Tensor], torch.Tensor]:
    """``_TypedLocal`` of the annotated parameter ``nd`` (a ``DTensorParam``)
    as a function of the tensor alone, which Dynamo puts in the graph as one
    call (it cannot build the gradient's DTensor itself); AOT autograd traces
    its backward."""

    def typed(local: torch.Tensor) -> torch.Tensor:
        return _TypedLocal.apply(local, nd)

    return torch._dynamo.allow_in_graph(typed)
