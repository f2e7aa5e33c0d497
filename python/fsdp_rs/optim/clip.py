"""``clip_grad_norm_`` in O(groups): torch's signature, result and semantics.

[Note: Clipping over group buffers]
``torch.nn.utils.clip_grad_norm_`` on FSDP2's DTensor gradients takes one norm
per gradient (a DTensor dispatch each, and a collective per gradient to turn
each partial norm into a full one), stacks them, takes their norm, then scales
every gradient. Here each rank sums the ``p``-th powers of its local parts (max
for the inf-norm): one ``vector_norm`` per group whose gradients are one buffer
([Note: Whole gradient buffers]), one per local shard for the other gradients
(replaced by the user, made by the rare per-parameter path, only some of a
group's passed). The sums are all-reduced once per mesh and sharded mesh dim,
keyed by the gradients' meshes in the order they were passed, and each buffer
is scaled with one ``mul_``. Which gradients are whole buffers is a local
observation (a rank that had no gradient for an expert gets the rare path where
another gets a whole buffer), so it only chooses how each rank computes its
part: the collectives are the same on every rank.

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
import operator
from collections.abc import Iterable
from itertools import repeat

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_rs.runtime.group.grad_buffers import local_tensor, sharded_grad_buffers
from fsdp_rs.runtime.group.params import is_none

__all__ = ["clip_grad_norm_"]


_GRAD = operator.attrgetter("grad")
_SPEC = operator.attrgetter("_spec")


def _grads_of(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [g for g in map(_GRAD, parameters) if g is not None]


def _reduce_keys(grads: list[torch.Tensor]) -> list[tuple | None]:
    """``_reduce_dims`` of each DTensor gradient, worked out once per distinct
    spec (a group's gradients share a few) and interned: equal keys are one
    object, so they compare by identity."""
    specs = list(map(_SPEC, grads))
    ids = list(map(id, specs))
    table: dict[int, tuple | None] = {}
    interned: dict[tuple, tuple] = {}
    # each spec's first gradient (the earliest index is written last)
    first = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1), strict=True))
    for i in dict.fromkeys(ids):
        key = _reduce_dims(grads[first[i]])
        table[i] = None if key is None else interned.setdefault(key, key)
    return list(map(table.__getitem__, ids))


def _reduce_dims(g: torch.Tensor) -> tuple | None:
    """(mesh, mesh dims ``g`` is sharded over): where its norm's parts are summed;
    None for a placement other than Shard or Replicate."""
    dims = []
    for d, placement in enumerate(g.placements):
        # torch >= 2.13's _StridedShard (FSDP over tensor parallelism) is no Shard
        if placement.is_shard() or isinstance(placement, _StridedShard):
            dims.append(d)
        elif not placement.is_replicate():
            return None
    return g.device_mesh, tuple(dims)


def _local_part(norms: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """This rank's ``sum |x|^p`` (max for inf) from per-tensor norms."""
    if not norms:
        return torch.zeros((), device=device)
    parts = torch.stack([n.to(device) for n in norms])
    return parts.max() if math.isinf(norm_type) else parts.pow(norm_type).sum()


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
    # [Note: Clipping over group buffers] the path and the collectives follow from
    # what every rank passes, never from which of its gradients are whole buffers
    dtensors = [isinstance(g, DTensor) for g in grads]
    if not norm_type > 0 or not any(dtensors):  # 0 counts nonzeros, < 0 sees padding
        return _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    if not all(dtensors):
        raise RuntimeError(
            "fsdp_rs.clip_grad_norm_: the parameters mix plain tensor gradients with "
            "fully_shard's DTensor gradients (as torch's clip_grad_norm_, which raises "
            "here too); clip the plain ones separately, or shard their module"
        )
    keys = _reduce_keys(grads)
    if any(map(is_none, keys)):  # e.g. Partial: torch's own path
        return _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    whole, rest = sharded_grad_buffers(grads)
    # keys are interned: identity for equality, without hashing a DeviceMesh per gradient
    distinct = {id(k): k for k in keys}  # in the gradients' order
    norms: dict[int, list[torch.Tensor]] = {i: [] for i in distinct}
    key_of = dict(zip(map(id, grads), keys, strict=True))
    # A buffer whose gradients are summed over different mesh dims (tensor-parallel
    # ones next to replicated ones, [Note: DTensor parameters]) goes per gradient.
    mixed = [
        not all(
            map(
                operator.is_,
                map(key_of.__getitem__, map(id, b.grads)),
                repeat(key_of[id(b.grads[0])]),
            )
        )
        for b in whole
    ]
    if any(mixed):
        rest = rest + [g for b, m in zip(whole, mixed, strict=True) if m for g in b.grads]
        whole = [b for b, m in zip(whole, mixed, strict=True) if not m]
    for b in whole:
        norms[id(key_of[id(b.grads[0])])].append(torch.linalg.vector_norm(b.buffer, norm_type))
    for g in rest:
        local = g._local_tensor
        if local.numel():  # an empty shard adds nothing (and has no inf-norm)
            norms[id(key_of[id(g)])].append(torch.linalg.vector_norm(local, norm_type))
    device = grads[0]._local_tensor.device
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    totals = []
    for i, parts in norms.items():  # the same keys, in one order, on every rank
        mesh, dims = distinct[i]
        value = _local_part(parts, norm_type, device)
        if dims:
            on_mesh = value.to(mesh.device_type)
            for d in dims:
                dist.all_reduce(on_mesh, op=op, group=mesh.get_group(d))
            value = on_mesh.to(device)
        totals.append(value)
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
    return _as_dtensor(total, grads)


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
