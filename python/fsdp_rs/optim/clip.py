"""``clip_grad_norm_`` in O(groups): torch's signature, result and semantics.

[Note: Clipping over group buffers]
``torch.nn.utils.clip_grad_norm_`` on FSDP2's DTensor gradients takes one norm
per gradient (a DTensor dispatch each, and a collective per gradient to turn
each partial norm into a full one), stacks them, takes their norm, then scales
every gradient. Here, where a group's gradients are one buffer ([Note: Whole
gradient buffers]), the local part of the total is one ``vector_norm`` per
buffer; the ``p``-th powers of all local parts on one mesh are summed and
all-reduced once over its shard dimension (max for the inf-norm), the meshes'
results are combined, and each buffer is scaled with one ``mul_``. Gradients
outside whole buffers (replaced by the user, or only some of a group's passed)
go through torch's own ``get_total_norm`` and ``_foreach_mul_`` and are
combined the same way; when no gradient is in a whole buffer the result is
torch's own, bit for bit.

Differences from torch, by design: the total sums the same elements in another
order, so it equals torch's to fp32 rounding (relative 1e-6 is what the tests
allow), and the scaled gradients equal torch's wherever the two totals round
to the same clip coefficient. The returned total is a replicated DTensor on the
gradients' mesh for every norm type (torch returns the inf-norm as a
``Partial(max)`` DTensor whose local value is this rank's maximum); its
``full_tensor()`` is the same as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fsdp_rs.runtime.grad_buffers import GradBuffer, local_tensor, sharded_grad_buffers

__all__ = ["clip_grad_norm_"]


def _grads_of(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def _local_power(buffers: list[GradBuffer], norm_type: float, device: torch.device):
    """Sum (max for inf) over ``buffers`` of this rank's ``|x|^p`` (a 0-dim tensor)."""
    parts = [torch.linalg.vector_norm(b.buffer, norm_type) for b in buffers]
    parts = torch.stack([p.to(device) for p in parts])
    if math.isinf(norm_type):
        return parts.max()
    return parts.pow(norm_type).sum()


def _mesh_total(buffers: list[GradBuffer], norm_type: float) -> torch.Tensor:
    """The ``p``-th power of the norm (the norm for inf) of the gradients of
    ``buffers``, which share one mesh: one all-reduce over its shard dim."""
    info = buffers[0].info
    value = _local_power(buffers, norm_type, buffers[0].buffer.device)
    if info.shard_size > 1:
        on_mesh = value.to(info.device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(on_mesh, op=op, group=info.shard_group)
        value = on_mesh.to(value.device)
    return value


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | torch.nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (or of a module's parameters) to a
    total ``norm_type`` norm of ``max_norm``, in place; return the total norm.

    As ``torch.nn.utils.clip_grad_norm_``, computed per fsdp-rs parameter group
    instead of per gradient ([Note: Clipping over group buffers]). Every rank
    must call it with the same parameters (it runs collectives)."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    grads = _grads_of(parameters)
    if not grads:
        return torch.tensor(0.0)
    with torch.no_grad():
        return _clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip(grads, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
    if not norm_type > 0:  # 0 counts nonzeros, negative orders the zero padding
        return _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    whole, rest = sharded_grad_buffers(grads)
    if not whole:
        return _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    if any(not isinstance(g, DTensor) for g in rest):
        raise RuntimeError(
            "fsdp_rs.clip_grad_norm_: the parameters mix plain tensor gradients with "
            "fully_shard's DTensor gradients (as torch's clip_grad_norm_, which raises "
            "here too); clip the plain ones separately, or shard their module"
        )
    device = whole[0].buffer.device
    is_inf = math.isinf(norm_type)
    by_mesh: dict[int, list[GradBuffer]] = {}
    for b in whole:
        by_mesh.setdefault(id(b.info.mesh), []).append(b)
    totals = [_mesh_total(bs, norm_type) for bs in by_mesh.values()]
    if rest:
        norm = torch.nn.utils.get_total_norm(rest, norm_type, False, foreach)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = norm.to(device)
        totals.append(norm if is_inf else norm.pow(norm_type))
    stacked = torch.stack(totals)
    total = stacked.max() if is_inf else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = _coefficient(max_norm, total)
    _scale([b.buffer for b in whole], coef, foreach)
    _scale(rest, coef, foreach)
    return _as_dtensor(total, [whole[0].grads[0]])


def _scale(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Multiply ``grads`` by ``coef`` in place, as torch's ``clip_grads_with_norm_``
    does (per device, with ``_foreach_mul_`` unless ``foreach`` is False), on the
    local tensors of DTensors: the same products, without a dispatch each."""
    if isinstance(coef, DTensor):
        coef = coef.to_local()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for local in map(local_tensor, grads):
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        c = coef.to(device)
        if foreach is False:
            for t in tensors:
                t.mul_(c)
        else:
            torch._foreach_mul_(tensors, c)


def _as_dtensor(total: torch.Tensor, like: list[torch.Tensor]) -> torch.Tensor:
    """``total`` as torch returns it for DTensor gradients: replicated on their mesh."""
    g = like[0]
    if not isinstance(g, DTensor):
        return total
    mesh = g.device_mesh
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
    """torch's own path over the gradients (no whole buffer to use)."""
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    full = total.full_tensor() if isinstance(total, DTensor) else total
    _scale(grads, _coefficient(max_norm, full), foreach)
    return total


def _coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """torch's clip coefficient (``clip_grads_with_norm_``'s formula)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
