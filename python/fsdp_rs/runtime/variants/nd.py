"""Parameters that are already DTensors: ``fully_shard`` over the data-parallel
dims of a mesh whose other dims carry tensor or expert parallelism.

[Note: DTensor parameters]
After ``parallelize_module`` (TP) or expert sharding (EP) a parameter is a
DTensor on another mesh than the one passed to ``fully_shard``; with
``dp_mesh_dims`` (torch >= 2.13) it is a DTensor on the very mesh passed,
replicated on the named data-parallel dims. Either way fsdp-rs shards its
*local* tensor on dim 0 over the DP shard group, exactly as a plain parameter
of that shape: the planner, the buffers, the copies and the collectives see
local shapes only, and TP's own collectives (in the module's forward and
backward) are untouched. What differs is the DTensor metadata, taken from
FSDP2 so that ``full_tensor()``, ``clip_grad_norm_``, DCP and checkpoints
interchange exactly:

- the sharded parameter lives on the mesh of all its dims (DP dims first,
  then the parameter's own; with ``dp_mesh_dims``, the mesh passed), with
  ``Shard(0)`` on the DP shard dim, or ``_StridedShard(0, split_factor=k)``
  where the other dims already split dim 0 ``k`` ways, ``Replicate()`` on a
  replicate dim, and the parameter's own placements on the others; its global
  shape and stride are the parameter's;
- with several DP shard dims (``dp_mesh_dims`` naming dp_shard and cp) the
  sharded parameter's mesh has the DP mesh, whose shard dim flattens them, in
  their place (``mesh.mesh_info``'s ``_one_dim``), as FSDP2's;
- the unsharded parameter is a DTensor with the parameter's own spec (in the
  parameter dtype) over the unsharded buffer;
- a gradient is brought to the parameter's own placements first (a
  ``Partial`` from sequence parallelism is reduced over its TP dim; with
  ``dp_mesh_dims`` a DP dim stays as autograd left it, the reduce-scatter
  sums it), then its local tensor is reduced as a plain one.

Gradients of such parameters are not pre-placed ([Note: Pre-placed
gradients]): autograd hands over DTensors, which a plain alias cannot stand for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_rs.runtime.api.errors import FSDPMeshError
from fsdp_rs.runtime.comm.mesh import MeshInfo

__all__ = ["DTensorParam", "dtensor_params"]


@dataclass(eq=False)
class DTensorParam:
    """The specs of one DTensor parameter, sharded and unsharded."""

    unsharded: DTensorSpec  # the parameter's own
    mesh: DeviceMesh  # of the sharded parameter
    placements: tuple
    keep_on_dims: frozenset = frozenset()  # dp_mesh_dims: DP dims left to the reduction
    annotation: Any = None  # [Note: spmd_types parameters]
    _specs: dict = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        return self.unsharded.tensor_meta.shape

    @property
    def stride(self) -> tuple[int, ...]:
        return self.unsharded.tensor_meta.stride

    @property
    def reduces_outside_dp(self) -> bool:
        """Whether its gradient may be reduced over a non-DP dim before FSDP's
        reduction (a replicated placement there can get a ``Partial`` gradient,
        e.g. a sequence-parallel norm's weight): FSDP2 (torch >= 2.15) then has
        autograd leave it in the reduce dtype, so that reduction runs in it too.
        An annotated parameter's types say it: a ``Partial`` backward type."""
        if self.annotation is not None:
            return any(
                isinstance(p, Partial)
                for i, p in enumerate(self.annotation.grad_placements)
                if i not in self.keep_on_dims
            )
        return any(
            isinstance(p, Replicate)
            for i, p in enumerate(self.unsharded.placements)
            if i not in self.keep_on_dims
        )

    def sharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        spec = self._specs.get(dtype)
        if spec is None:
            meta = TensorMeta(self.shape, self.stride, dtype)
            spec = self._specs[dtype] = DTensorSpec(self.mesh, self.placements, tensor_meta=meta)
        return spec

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        meta = self.unsharded.tensor_meta
        if meta is None or meta.dtype == dtype:
            return self.unsharded
        key = ("unsharded", dtype)
        spec = self._specs.get(key)
        if spec is None:
            meta = TensorMeta(meta.shape, meta.stride, dtype)
            spec = self._specs[key] = replace(self.unsharded, tensor_meta=meta)
        return spec

    def typed_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """An annotated parameter's plain gradient as a DTensor of its backward
        types ([Note: spmd_types parameters]); any other as it is."""
        if grad is None or self.annotation is None or isinstance(grad, DTensor):
            return grad
        return self.annotation.grad(grad, self.unsharded)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor to reduce of an unsharded gradient (a DTensor)."""
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        if not isinstance(grad, DTensor):
            raise RuntimeError(
                f"fsdp_rs: the gradient of a DTensor parameter is a {type(grad).__name__}, "
                "expected a DTensor with the parameter's placements"
            )
        own = self.unsharded.placements
        target = tuple(
            grad.placements[i] if i in self.keep_on_dims else own[i] for i in range(len(own))
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad._local_tensor


def _concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh of ``meshes``' dims together (they share a root mesh)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate(meshes)
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.13

    root = _mesh_resources.get_root_mesh(meshes[0])
    names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
    if root is None or len(names) != sum(m.ndim for m in meshes):
        raise ValueError(
            "fully_shard: N-D parallelism needs named mesh dims from one root mesh "
            "(init_device_mesh(..., mesh_dim_names=...) and slices of it)"
        )
    return root[names]


def _dp_placement(spec: DTensorSpec, shard_dim: int, after: range) -> Shard:
    """FSDP's placement on a DP shard dim: ``Shard(dim)``, or ``_StridedShard``
    where the parameter's own dims in ``after`` already split ``dim``."""
    split = 1
    for j in after:
        p = spec.placements[j]
        if isinstance(p, Shard | _StridedShard) and p.dim == shard_dim:
            split *= spec.mesh.size(j)
    return _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)


def _tp(fqn: str, p: DTensor, info: MeshInfo, dim: int, memo: dict) -> DTensorParam:
    """TP / EP: the parameter's mesh is other dims of the DP mesh's root."""
    spec = p._spec
    if len(spec.placements) > 2:
        raise NotImplementedError(
            f"FSDP only supports 1D TP/EP or 2D EP+TP, not {spec.placements} (parameter {fqn})"
        )
    try:
        # one concatenation per TP mesh and call (building a mesh costs ~0.7 ms)
        mesh = memo.get(id(spec.mesh))
        if mesh is None:
            mesh = memo[id(spec.mesh)] = _concatenate([info.mesh, spec.mesh])
    except Exception as e:
        raise FSDPMeshError(
            f"fully_shard: parameter {fqn} is a DTensor on mesh {spec.mesh}, which is not "
            f"other dims of the root mesh of the data-parallel mesh {info.mesh}; slice both "
            "from one init_device_mesh(..., mesh_dim_names=...) mesh"
        ) from e
    split = spec.num_shards_map[dim]
    dp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    dims = (Replicate(), dp) if info.replicate_group is not None else (dp,)
    return DTensorParam(spec, mesh, (*dims, *spec.placements))


def _spmd(fqn: str, p: DTensor, info: MeshInfo, dim: int, memo: dict) -> DTensorParam:
    """``dp_mesh_dims``: the parameter lives on the mesh passed, replicated on
    the DP dims."""
    spec = p._spec
    mesh = info.spmd_mesh
    if spec.mesh is not mesh and spec.mesh != mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
            f"got different mesh objects (parameter {fqn}: {spec.mesh}, passed: {mesh})"
        )
    names = mesh.mesh_dim_names
    shard_idx = [names.index(n) for n in info.dp_dims.shard_names]
    replicate_idx = [names.index(n) for n in info.dp_dims.replicate_names]
    for i in shard_idx + replicate_idx:
        if not isinstance(spec.placements[i], Replicate):
            raise ValueError(
                f"Expected Replicate() on DP dim '{names[i]}' (index {i}) but got "
                f"{spec.placements[i]} (parameter {fqn})"
            )
    placements = list(spec.placements)
    for i in shard_idx:
        placements[i] = _dp_placement(spec, dim, range(i + 1, mesh.ndim))
    keep = frozenset(shard_idx + replicate_idx)
    if len(shard_idx) <= 1:  # none: [Note: Replicate dims only]
        return DTensorParam(spec, mesh, tuple(placements), keep)
    # Several shard dims (dp_shard x cp): the sharded parameter lives on the mesh
    # with the DP mesh (its flattened shard dim, after the replicate one for HSDP)
    # in their place, as FSDP2's does.
    first, hsdp = min(shard_idx), info.replicate_group is not None
    meshes, sharded = [], []
    for i, name in enumerate(names):
        if i == first:
            meshes.append(info.mesh)
            sharded += [Replicate(), placements[i]] if hsdp else [placements[i]]
        elif i not in shard_idx and not (hsdp and i in replicate_idx):
            meshes.append(mesh[name])
            sharded.append(placements[i])
    key = ("flattened", id(mesh))
    flat = memo.get(key)
    if flat is None:
        flat = memo[key] = _concatenate(meshes)
    return DTensorParam(spec, flat, tuple(sharded), keep)


def dtensor_params(
    fqns: list[str], params: list[torch.Tensor], info: MeshInfo, dims: list[int] | None = None
) -> list[DTensorParam | None] | None:
    """Per parameter its ``DTensorParam`` (None for a plain one); None when
    all are plain (the usual case) and no ``dp_mesh_dims`` was given."""
    if info.spmd_mesh is None and not any(map(isinstance, params, repeat(DTensor))):
        return None
    out: list[DTensorParam | None] = []
    dims = dims or [0] * len(params)
    memo: dict = {}  # this call's meshes (the DTensors keep them alive meanwhile)
    for fqn, p, dim in zip(fqns, params, dims, strict=True):
        if not isinstance(p, DTensor):
            if info.spmd_mesh is not None:
                raise ValueError(
                    "When dp_mesh_dims is provided, all parameters must be DTensors on the "
                    f"full SPMD mesh (e.g. via distribute_module). Got plain tensor for "
                    f"parameter '{fqn}'."
                )
            out.append(None)
            continue
        make = _spmd if info.spmd_mesh is not None else _tp
        out.append(make(fqn, p, info, dim, memo))
    return out
