"""The process groups ``fully_shard`` works over, taken from a ``DeviceMesh``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_rs.runtime.api.errors import FSDPUsageError

__all__ = [
    "MeshInfo",
    "default_device_type",
    "default_mesh",
    "from_torch_mesh_info",
    "mesh_info",
    "per_mesh",
]


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """A 1-D mesh shards (FSDP); a 2-D mesh replicates over dim 0 and shards over
    dim 1 (HSDP)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup | None  # None: replicate dims only (DDP)
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # ``dp_mesh_dims``: the full mesh passed (``mesh`` is then its DP dims) and
    # the DataParallelMeshDims naming them ([Note: DTensor parameters])
    spmd_mesh: DeviceMesh | None = None
    dp_dims: Any = None
    shard_mesh_: DeviceMesh | None = None

    @cached_property
    def placements(self) -> tuple:
        if self.replicate_group is None:
            return (Shard(0),)
        return (Replicate(), Shard(0))

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (the mesh itself for FSDP)."""
        if self.shard_mesh_ is not None:
            return self.shard_mesh_
        if self.mesh.ndim == 1:
            return self.mesh
        return self.mesh[self.mesh.mesh_dim_names[1]]

    @cached_property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cpu":
            return torch.device("cpu")
        module = getattr(torch, self.mesh.device_type)
        return torch.device(self.mesh.device_type, module.current_device())


# default group -> {device type: its 1-D mesh}. Keyed by the group object: a
# re-initialized process group gets a new mesh, and ranks run as threads (each
# with its own default group) never see each other's.
_DEFAULT_MESHES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, DeviceMesh]] = (
    weakref.WeakKeyDictionary()
)


def default_device_type() -> str:
    """The device type of FSDP2's default mesh: the accelerator torch finds at
    run time (``cuda`` with a visible GPU), whatever the process group's backend,
    else ``cpu``. A model meant to stay on the CPU next to a GPU (gloo) passes
    ``mesh=init_device_mesh("cpu", ...)``, as with FSDP2."""
    get_accelerator = getattr(torch._C, "_get_accelerator", None)
    if get_accelerator is not None:  # what FSDP2's default mesh asks
        return get_accelerator().type
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default group on ``default_device_type()``, made once
    per device type and default group (building one creates groups)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call dist.init_process_group(...) first "
            "(torchrun sets up the environment), or pass mesh=init_device_mesh(...)"
        )
    device_type = default_device_type()
    meshes = _DEFAULT_MESHES.setdefault(dist.distributed_c10d._get_default_group(), {})
    mesh = meshes.get(device_type)
    if mesh is None:
        mesh = meshes[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return mesh


# id(mesh) -> (weakref to that mesh object, what fsdp-rs keeps for it)
_PER_MESH: dict[int, tuple[weakref.ref, dict]] = {}


def per_mesh(mesh: DeviceMesh) -> dict:
    """A dict for what fsdp-rs reads or makes once per mesh object (a model
    sharded per block calls ``fully_shard`` per block over one mesh), dropped
    when the mesh dies. Its values must not reference the mesh, which would then
    never die."""
    key = id(mesh)
    entry = _PER_MESH.get(key)
    if entry is None or entry[0]() is not mesh:
        entry = (weakref.ref(mesh, lambda _: _PER_MESH.pop(key, None)), {})
        _PER_MESH[key] = entry
    return entry[1]


def mesh_info(mesh: DeviceMesh | None, dp_mesh_dims: Any = None) -> MeshInfo:
    """The groups, sizes and ranks of ``mesh`` (the default 1-D mesh for None),
    read once per mesh object. Not the MeshInfo itself is kept: it references
    the mesh. With ``dp_mesh_dims``, those of its data-parallel dims."""
    if mesh is None:
        mesh = default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}; build one with init_device_mesh(device_type, (world_size,)) "
            "or (replicas, shards) for HSDP"
        )
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    kept = per_mesh(mesh)
    groups = kept.get("groups")
    if groups is None:
        groups = kept["groups"] = _mesh_groups(mesh)
    return MeshInfo(mesh, *groups)


def from_torch_mesh_info(own: Any) -> MeshInfo:
    """FSDP2's mesh info (``FSDPMeshInfo`` / ``HSDPMeshInfo``, what a
    ``ShardPlacementResult`` from ``shard_placement_fn`` carries) as fsdp-rs's.

    [Note: Per-parameter meshes]
    ``shard_placement_fn`` may send a parameter to another mesh than the one
    passed (torchtitan shards MoE experts over their expert-data-parallel mesh
    in the same call as the dense weights). As FSDP2, fsdp-rs then makes one
    group per set of process groups (shard, replicate), each with its own mesh,
    reduction and ``reshard_after_forward=int`` size; the state drives them as
    one ([Note: One group per dtype]). The root's plan check still runs over
    the mesh passed to the root."""
    shard_group = getattr(own, "shard_process_group", None)
    if shard_group is None or not isinstance(getattr(own, "mesh", None), DeviceMesh):
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned a mesh_info of type "
            f"{type(own).__name__}; fsdp-rs takes FSDP2's FSDPMeshInfo or HSDPMeshInfo (a "
            "shard dim) per parameter"
        )
    mesh = own.mesh
    replicate_group = getattr(own, "replicate_process_group", None)
    replicate_size = 1 if replicate_group is None else replicate_group.size()
    shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[own.shard_mesh_dim]]
    spmd_mesh = own.spmd_mesh if getattr(own, "is_spmd_mesh", False) else None
    dims = own.dp_mesh_dims if spmd_mesh is not None else None
    return MeshInfo(
        mesh,
        shard_group,
        shard_group.size(),
        shard_group.rank(),
        replicate_group,
        replicate_size,
        spmd_mesh,
        dims,
        shard_mesh,
    )


def _mesh_groups(mesh: DeviceMesh) -> tuple:
    """(shard group, its size, this rank in it, replicate group or None, its size)."""
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return group, group.size(), group.rank(), None, 1
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise FSDPUsageError(
                "fully_shard: a 2-D mesh (HSDP) needs mesh_dim_names: build it with "
                "init_device_mesh(device_type, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard')). Please init the 2D mesh for HSDP "
                "with mesh_dim_names specified"
            )
        shard, replicate = mesh.get_group(1), mesh.get_group(0)
        return shard, shard.size(), shard.rank(), replicate, replicate.size()
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: use a 1-D mesh (FSDP) "
        "or a 2-D mesh (replicate, shard) for HSDP"
    )


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of ``names``: several (FSDP over dp_shard x cp) are flattened
    into one, as FSDP2 does, named by joining them with ``_``. They must be
    adjacent dims in mesh order (the flattened dim takes their place)."""
    if len(names) == 1:
        return mesh[names[0]]
    index = [mesh.mesh_dim_names.index(n) for n in names]
    if index != list(range(index[0], index[0] + len(index))):
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims names {names}, not adjacent dims in the order of the "
            f"mesh's {mesh.mesh_dim_names}; fsdp-rs flattens several DP dims into one in their "
            "place: list adjacent dims in mesh order"
        )
    return mesh[names]._flatten("_".join(names))


def _spmd_mesh_info(mesh: DeviceMesh, dims: Any) -> MeshInfo:
    """``fully_shard(mesh=full_mesh, dp_mesh_dims=...)``: the DP dims of the full
    mesh, checked as FSDP2 checks them ([Note: DTensor parameters]); several
    shard (or replicate) dims act as one, flattened.

    [Note: Replicate dims only]
    ``dp_mesh_dims`` naming replicate dims only is FSDP2's DDP form: nothing is
    sharded (a group of one shard: its own row is the all-gather output, as in
    FSDP2, which runs no all-gather either) and the gradients are all-reduced
    over the replicate dims with FSDP2's division for them. The parameters stay
    ``Replicate()`` on those dims; there is no shard process group."""
    shard, replicate = _names(dims.shard), _names(dims.replicate)
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in shard + replicate:
        if name not in mesh.mesh_dim_names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}"
            )
    if not shard:  # [Note: Replicate dims only]
        rep_mesh = _one_dim(mesh, replicate)
        group = rep_mesh.get_group(0)
        return MeshInfo(rep_mesh, None, 1, 0, group, group.size(), mesh, dims, rep_mesh)
    shard_mesh = _one_dim(mesh, shard)
    group = shard_mesh.get_group(0)
    rep_group, rep_size, dp_mesh = None, 1, shard_mesh
    if replicate:
        rep_mesh = _one_dim(mesh, replicate)
        rep_group, rep_size = rep_mesh.get_group(0), rep_mesh.size()
        concatenate = getattr(DeviceMesh, "_concatenate", None)
        if concatenate is not None:
            dp_mesh = concatenate([rep_mesh, shard_mesh])
        else:
            dp_mesh = mesh[(replicate[0], shard[0])]
    info = MeshInfo(
        dp_mesh, group, group.size(), group.rank(), rep_group, rep_size, mesh, dims, shard_mesh
    )
    return info
