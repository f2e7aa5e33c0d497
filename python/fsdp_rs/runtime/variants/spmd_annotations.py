"""Plain parameters annotated with ``spmd_types`` (torch >= 2.15, torchtitan's
default ``spmd_backend``).

[Note: spmd_types parameters]
Under ``spmd_types`` a module computes on plain tensors that carry a type per
mesh axis (``R`` replicated, ``I`` invariant, ``S(d)`` sharded, ``P``
partial) instead of DTensors, and ``fully_shard`` is called with the full mesh
and ``dp_mesh_dims``. As FSDP2 does, fsdp-rs turns such a parameter into the
DTensor it stands for on that mesh and from there on treats it as any
``dp_mesh_dims`` DTensor parameter ([Note: DTensor parameters]), with three
differences:

- the storage placements come from the types: ``R`` on every DP dim (the only
  type allowed there, FSDP owning the DP reduction), the parameter's own type
  on each other dim, which must be annotated;
- the unsharded parameter the module computes with is plain, as the module
  expects, and gets its types back before each forward when type checking is on
  (``restore``); FSDP's own hooks run with type checking paused;
- its gradient arrives plain and is read as a DTensor of the backward types
  (``R`` -> ``Partial``, ``P`` -> ``R``, ``I`` and ``S(d)`` unchanged) before
  the DTensor path brings its non-DP dims to the storage placements.

Under ``set_fullgraph_compile`` the traced hooks do the same in the graph
(``traced_dtensor.unsharded_as``), with type checking off.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_rs.runtime.comm.mesh import MeshInfo

__all__ = ["Annotation", "annotated_params", "spmd_types_module", "untyped"]


def spmd_types_module() -> Any:
    """The ``spmd_types`` package where it is imported, or None (not imported,
    or torch predates it). A parameter carries an annotation, and type checking
    is on, only once the user imported the package: asking the import system
    whether it is installed costs about 0.1 ms (a search of ``sys.path``) and
    ran at every ``fully_shard``, a tenth of its time at 1e5 parameters."""
    if getattr(dist, "_is_spmd_types_available", None) is None:
        return None
    return sys.modules.get("spmd_types")


def untyped() -> Any:
    """A context pausing ``spmd_types`` type checking (FSDP's own tensor work)."""
    return dist._spmd_no_typecheck()


@dataclass(eq=False)
class Annotation:
    """What a parameter's ``spmd_types`` annotation says for FSDP."""

    grad_placements: tuple
    restore_type: dict  # mesh axis -> type, put back on the unsharded parameter
    partition_spec: Any
    _grad_specs: dict = field(default_factory=dict)

    def restore(self, spmd: Any, tensor: torch.Tensor) -> None:
        if self.restore_type and spmd.is_type_checking():
            spmd.assert_type(tensor, self.restore_type, partition_spec=self.partition_spec)

    def grad(self, grad: torch.Tensor, own: DTensorSpec) -> DTensor:
        """The plain gradient ``grad`` read as the DTensor it is."""
        spec = self._grad_specs.get(grad.dtype)
        if spec is None:
            meta = own.tensor_meta
            meta = TensorMeta(meta.shape, meta.stride, grad.dtype)
            spec = DTensorSpec(own.mesh, self.grad_placements, tensor_meta=meta)
            self._grad_specs[grad.dtype] = spec
        return DTensor.__new__(DTensor, grad, spec, requires_grad=False)


def _same_ranks(spmd: Any, lhs: tuple, rhs: tuple) -> bool:
    from spmd_types._mesh_axis import flatten_axes

    lhs_mesh = spmd.normalize_mesh(frozenset(lhs))
    rhs_mesh = spmd.normalize_mesh(frozenset(rhs))
    if not lhs_mesh or not rhs_mesh:
        return lhs_mesh == rhs_mesh
    return flatten_axes(tuple(lhs_mesh)) == flatten_axes(tuple(rhs_mesh))


def _resolve(spmd: Any, fqn: str, param: torch.Tensor, local: dict, info: MeshInfo):
    """(storage placements, Annotation) of one annotated parameter; FSDP2's
    checks, as ValueErrors naming the parameter."""
    from spmd_types._mesh_axis import flatten_axes
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types

    storage = info.spmd_mesh
    if storage is None or storage.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard: parameter {fqn} carries spmd_types annotations, which need "
            "fully_shard(module, mesh=<the full named mesh>, dp_mesh_dims="
            "DataParallelMeshDims(shard=..., replicate=...)) naming its data-parallel dims"
        )
    names = storage.mesh_dim_names
    axis_of = {n: spmd.MeshAxis.of(storage.get_group(n)) for n in names}
    storage_axes = tuple(axis_of.values())
    spec = get_partition_spec(param)
    types = dict(local)
    if spec is not None:
        types.update(partition_spec_to_shard_types(spec))
    # the mesh the module type-checks on: the annotation's own, else the current one
    if _same_ranks(spmd, tuple(types), storage_axes):
        restore_mesh = tuple(types)
    elif (current := spmd.current_mesh()) is not None:
        restore_mesh = tuple(current)
    else:
        raise ValueError(
            f"fully_shard: parameter {fqn} is annotated on axes {tuple(types)} only, which "
            f"do not cover the storage mesh {storage_axes}: annotate every axis, or call "
            "fully_shard inside spmd_types.set_current_mesh(...)"
        )
    outside = [a for a in local if a not in restore_mesh]
    if outside:
        raise ValueError(
            f"fully_shard: parameter {fqn} is annotated on axes {tuple(outside)} outside its "
            f"compute mesh {restore_mesh}; annotate only that mesh's axes"
        )
    if not _same_ranks(spmd, restore_mesh, storage_axes):
        raise ValueError(
            f"fully_shard: parameter {fqn} is type-checked on mesh {restore_mesh}, which "
            f"spans other ranks than the mesh passed to fully_shard {storage_axes}"
        )
    dp_names = {*info.dp_dims.shard_names, *info.dp_dims.replicate_names}
    dp_axis = flatten_axes(tuple(axis_of[n] for n in names if n in dp_names))
    others = {axis_of[n] for n in names if n not in dp_names}
    own: dict = {}
    for axis, kind in types.items():
        if axis <= dp_axis:  # within the DP dims
            if kind is not spmd.R:
                raise ValueError(
                    f"fully_shard: parameter {fqn} has type {kind} on data-parallel axis "
                    f"{axis}; FSDP reduces over the DP dims, so annotate it spmd.R there"
                )
        elif axis in others:
            own[axis] = kind
        else:
            raise ValueError(
                f"fully_shard: parameter {fqn} is annotated on axis {axis}, which is neither a "
                "data-parallel dim nor another dim of the mesh passed to fully_shard"
            )
    kinds = [spmd.R if n in dp_names else own.get(axis_of[n]) for n in names]
    missing = [n for n, k in zip(names, kinds, strict=True) if k is None]
    if missing:
        raise ValueError(
            f"fully_shard: parameter {fqn} has no spmd_types annotation on mesh dims "
            f"{missing} (not data-parallel): annotate its type there"
        )
    to_placement = spmd.spmd_type_to_dtensor_placement
    placements = tuple(map(to_placement, kinds))
    grads = tuple(to_placement(k.backward_type()) for k in kinds)
    restore = {axis: local.get(axis, spmd.R) for axis in restore_mesh}
    return placements, Annotation(grads, restore, spec)


def annotated_params(
    fqns: list[str], params: list[torch.Tensor], info: MeshInfo
) -> tuple[list[torch.Tensor], list[Annotation | None]] | None:
    """``params`` with every ``spmd_types``-annotated plain one replaced by its
    DTensor on the mesh passed, and per parameter its Annotation (None for the
    others); None when no parameter is annotated."""
    spmd = spmd_types_module()
    if spmd is None:
        return None
    if any(map(isinstance, params, repeat(DTensor))):
        locals_ = [None if isinstance(p, DTensor) else spmd.get_local_type(p) for p in params]
    else:  # the usual case: no loop of fsdp-rs's per parameter (spmd_types' call remains)
        locals_ = list(map(spmd.get_local_type, params))
    if not any(locals_):
        return None
    out, annotations = list(params), [None] * len(params)
    for i, (fqn, p, local) in enumerate(zip(fqns, params, locals_, strict=True)):
        if local:
            placements, annotations[i] = _resolve(spmd, fqn, p, local, info)
            dtensor = DTensor.from_local(p.data, info.spmd_mesh, placements, run_check=False)
            out[i] = nn.Parameter(dtensor, requires_grad=p.requires_grad)
    return out, annotations
