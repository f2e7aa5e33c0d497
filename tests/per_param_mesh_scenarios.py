"""``shard_placement_fn`` returning a ``ShardPlacementResult`` with a mesh of
its own ([Note: Per-parameter meshes]): torchtitan's MoE setup, where one
``fully_shard`` call shards the dense weights over the whole data-parallel
mesh and the expert weights (already expert-parallel DTensors) over their
expert-data-parallel mesh; and plain parameters sent to an HSDP mesh. Run with
fsdp-rs and with torch FSDP2 side by side in one spawned gloo process; each
scenario returns per library the losses, every parameter's placements, mesh,
local shape and ``full_tensor()``, and the last step's gradients, compared bit
for bit by ``test_per_param_mesh.py``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from scenario_common import LIBS, _inputs, train_adamw
from spawned import run_named

try:  # torch >= 2.13
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:
    ShardPlacementResult = None

DIM, EXPERTS, HIDDEN, STEPS = 16, 4, 32, 3


class MoE(nn.Module):
    """A dense projection and ``EXPERTS`` stacked experts, split over ``ep``
    (each rank computes its local experts on its own tokens)."""

    def __init__(self, ep: DeviceMesh | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM, DIM)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.1)
        self.head = nn.Linear(DIM, DIM)
        if ep is not None:
            for name in ("w_in", "w_out"):
                full = getattr(self, name).detach()
                setattr(self, name, nn.Parameter(distribute_tensor(full, ep, [Shard(0)])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.w_in, self.w_out
        if isinstance(w_in, DTensor):
            w_in, w_out = w_in.to_local(), w_out.to_local()
        x = torch.relu(self.dense(x))
        h = torch.relu(torch.einsum("bd,edh->beh", x, w_in))
        x = x + torch.einsum("beh,ehd->bd", h, w_out)
        return self.head(x)


def _observe(model: nn.Module, grads: bool = False) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        out[name] = None if t is None else {
            "placements": str(t.placements),
            "mesh": list(t.device_mesh.mesh_dim_names or ()),
            "local_shape": list(t.to_local().shape),
            "full": t.full_tensor().double().flatten().tolist(),
        }  # fmt: skip
    return out


def _train(lib: str, model: nn.Module, rank: int, **kwargs) -> dict:
    LIBS[lib](model, **kwargs)
    sharded = _observe(model)

    def step_loss(step: int) -> float:
        loss = model(_inputs(rank, step)).pow(2).mean()
        loss.backward()
        return loss.item()

    observe = functools.partial(_observe, model, grads=True)
    losses, grads = train_adamw(model, step_loss, STEPS, observe)
    return {"sharded": sharded, "losses": losses, "grads": grads, "params": _observe(model)}


@functools.cache
def _ep_meshes(world_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(efsdp, ep) and the flattened DP mesh of all ranks."""
    world = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("efsdp", "ep"))
    return world, world["efsdp", "ep"]._flatten("dp")


def experts(world_size: int, rank: int, dim: int = 0) -> dict:
    """Dense weights over the whole DP mesh (the mesh passed); the EP-sharded
    experts over ``efsdp`` (``ShardPlacementResult``), on dim ``dim``."""
    if ShardPlacementResult is None:
        return {"skipped": "this torch has no ShardPlacementResult"}
    world, dp = _ep_meshes(world_size)
    efsdp = FSDPMeshInfo(world["efsdp"], shard_mesh_dim=0)
    out = {}
    for lib in LIBS:
        model = MoE(world["ep"])
        expert_params = {model.w_in, model.w_out}

        def placement(p, experts=expert_params):
            if p in experts:
                return ShardPlacementResult(placement=Shard(dim), mesh_info=efsdp)
            return None

        out[lib] = _train(lib, model, rank, mesh=dp, shard_placement_fn=placement)
    return out


def hsdp_head(world_size: int, rank: int) -> dict:
    """Plain parameters: the head on an HSDP mesh (2, W / 2) of its own, the
    rest on the 1-D mesh passed."""
    if ShardPlacementResult is None:
        return {"skipped": "this torch has no ShardPlacementResult"}
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    hsdp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    head_info = HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
    out = {}
    for lib in LIBS:
        model = MoE(None)
        head = set(model.head.parameters())

        def placement(p, head=head):
            if p in head:
                return ShardPlacementResult(placement=Shard(0), mesh_info=head_info)
            return Shard(0)

        out[lib] = _train(lib, model, rank, mesh=flat, shard_placement_fn=placement)
    return out


def two_infos_one_mesh(world_size: int, rank: int) -> dict:
    """Two FSDPMeshInfo objects over the same process group: FSDP2's
    ValueError, from both libraries (the exception class names)."""
    if ShardPlacementResult is None:
        return {"skipped": "this torch has no ShardPlacementResult"}
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    first, second = (FSDPMeshInfo(flat, shard_mesh_dim=0) for _ in range(2))
    out = {}
    for lib in LIBS:
        model = MoE(None)
        head = set(model.head.parameters())

        def placement(p, head=head):
            info = first if p in head else second
            return ShardPlacementResult(placement=Shard(0), mesh_info=info)

        try:
            LIBS[lib](model, mesh=flat, shard_placement_fn=placement)
            out[lib] = None
        except Exception as e:
            out[lib] = type(e).__name__
    return out


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "experts": (experts, {"min_world": 4}),
    "experts_dim1": (experts, {"dim": 1, "min_world": 4}),
    "hsdp_head": (hsdp_head, {}),
    "two_infos_one_mesh": (two_infos_one_mesh, {}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)


__all__ = ["SCENARIOS", "run"]
