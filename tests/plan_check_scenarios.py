"""Models that differ between ranks, run by spawned gloo ranks (CPU) for
``test_plan_check.py`` ([Note: Cross-rank plan check]).

Each scenario builds an MLP (``Sequential(Linear(8, width), ReLU,
Linear(width, 4))``), applies ``fully_shard`` per linear layer and to the root
(each rank as the scenario says) and runs forward and backward. It records
``{"error": type name, "message": ...}`` when that raised, else what it
measured (collectives issued by the first forward, with the check on and off).
Without the check a mismatched model aborts the gloo process or hangs, which
the spawning test bounds with a timeout.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_rs
from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy
from fsdp_rs.runtime.checks.plan_check import ENV_VAR
from spawned import finish

WIDTH = 16


class Collectives(TorchDispatchMode):
    """Counts the c10d collectives issued while active (gloo's are dispatcher
    ops: ``c10d._allgather_base_``, ``c10d.allreduce_``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.count += 1
        return func(*args, **(kwargs or {}))


class BiasFirst(nn.Linear):
    """A linear layer that registers its bias before its weight."""

    def __init__(self, a: int, b: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = a, b
        self.bias = nn.Parameter(torch.zeros(b))
        self.weight = nn.Parameter(torch.randn(b, a) / a**0.5)


def mlp(width: int = WIDTH, bias_first: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    first = BiasFirst(8, width) if bias_first else nn.Linear(8, width)
    return nn.Sequential(first, nn.ReLU(), nn.Linear(width, 4))


def shard(model: nn.Sequential, mesh, layers=(0, 2), kwargs: dict | None = None, **root) -> None:
    """``fully_shard`` on ``layers`` (with ``kwargs[i]`` where given), then the root."""
    for i in layers:
        fsdp_rs.fully_shard(model[i], mesh=mesh, **(kwargs or {}).get(i, {}))
    fsdp_rs.fully_shard(model, mesh=mesh, **root)


def step(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    model(torch.randn(4, 8, dtype=dtype)).sum().backward()


def first_forward_collectives(model: nn.Module, check: bool) -> int:
    """Collectives of ``model``'s first forward, with the check on or off."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1" if check else "0"
    try:
        with Collectives() as counted:
            out = model(torch.randn(4, 8))
    finally:
        if before is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = before
    out.sum().backward()
    return counted.count


# ------------------------------------------------------------------ scenarios
# Each takes (rank, mesh) and returns what it measured, or raises.


def matching(rank: int, mesh) -> dict:
    """Same model on every rank: the check issues one collective per mesh dim
    with more than one rank, at the first forward only; the trainable-set
    check, one per such dim per synced backward."""
    checked, unchecked = mlp(), mlp()
    shard(checked, mesh)
    shard(unchecked, mesh)
    on = first_forward_collectives(checked, check=True)
    off = first_forward_collectives(unchecked, check=False)
    with Collectives() as later:
        step(checked)
    with Collectives() as later_unchecked:
        step(unchecked)
    return {
        "extra_first": on - off,
        "extra_later": later.count - later_unchecked.count,
        "later": later.count,
    }


def width(rank: int, mesh) -> dict:
    """Rank 1 (the last rank, at W > 2) configured a wider first layer."""
    model = mlp(WIDTH + 8 if rank == dist.get_world_size() - 1 else WIDTH)
    shard(model, mesh)
    messages = []
    for _ in range(2):  # a retried forward checks again
        try:
            step(model)
        except RuntimeError as e:
            messages.append(str(e))
    if len(messages) == 2 and messages[0] == messages[1]:
        raise RuntimeError(messages[0])
    return {"messages": messages}


def order(rank: int, mesh) -> None:
    model = mlp(bias_first=rank == 1)
    shard(model, mesh)
    step(model)


def dtype(rank: int, mesh) -> None:
    model = mlp()
    if rank == 1:
        model[0].double()
    shard(model, mesh)
    step(model)


def requires_grad(rank: int, mesh) -> None:
    model = mlp()
    shard(model, mesh)
    if rank == 1:
        model[0].weight.requires_grad_(False)  # the sharded parameter, after fully_shard
    step(model)


def reshard(rank: int, mesh) -> None:
    model = mlp()
    shard(model, mesh, kwargs={0: {"reshard_after_forward": rank == 0}})
    step(model)


def mixed_precision(rank: int, mesh) -> None:
    model = mlp()
    mp = fsdp_rs.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if rank == 1 else None)
    shard(model, mesh, kwargs={0: {"mp_policy": mp}, 2: {"mp_policy": mp}}, mp_policy=mp)
    step(model)


def grad_dtype(rank: int, mesh) -> None:
    """[Note: Gradient dtype policy] (torch >= 2.15): one rank's bf16 weight
    keeps fp32 gradients, so its module is two groups there. Not run where
    FSDP2 keeps no grad_dtype (fully_shard refuses it on the one rank)."""
    if not fsdp2_has_grad_dtype_policy():
        return
    model = mlp().to(torch.bfloat16)
    if rank == 1:
        model[0].weight.grad_dtype = torch.float32
    shard(model, mesh)
    step(model, torch.bfloat16)


def offload(rank: int, mesh) -> None:
    model = mlp()
    policy = fsdp_rs.CPUOffloadPolicy(pin_memory=False) if rank == 1 else fsdp_rs.OffloadPolicy()
    shard(model, mesh, kwargs={0: {"offload_policy": policy}})
    step(model)


def ignored(rank: int, mesh) -> None:
    model = mlp()
    ignore = {model[2].bias} if rank == 1 else set()
    shard(model, mesh, kwargs={2: {"ignored_params": ignore}})
    step(model)


def other_mesh(rank: int, flat) -> None:
    """Rank 1 shards the first layer over an HSDP mesh (1, W): the root's
    (flat) mesh checks it."""
    hsdp = init_device_mesh("cpu", (1, flat.size()), mesh_dim_names=("replicate", "shard"))
    model = mlp()
    for i in (0, 2):
        fsdp_rs.fully_shard(model[i], mesh=hsdp if rank == 1 and i == 0 else flat)
    fsdp_rs.fully_shard(model, mesh=flat)
    step(model)


def wrapped_on_one_rank(rank: int, mesh) -> None:
    """Rank 0 applies fully_shard to the first layer too; rank 1 does not."""
    model = mlp()
    shard(model, mesh, layers=(0, 2) if rank == 0 else (2,))
    step(model)


def paramless_on_one_rank(rank: int, mesh) -> None:
    """Rank 0 also applies fully_shard to the ReLU (no parameters)."""
    model = mlp()
    shard(model, mesh, layers=(0, 1, 2) if rank == 0 else (0, 2))
    step(model)


def wrapped_after_forward(rank: int, mesh) -> None:
    """After a first forward, every rank adds a head and shards it, rank 1 a
    wider one: the head's first forward checks it."""
    model = mlp()
    shard(model, mesh)
    step(model)
    model.add_module("head", nn.Linear(4, 3 if rank == 1 else 2))
    fsdp_rs.fully_shard(model.head, mesh=mesh)
    step(model)


class Experts(nn.Module):
    """Stacked expert weights ``(4, 8, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eij->bj", x, self.w)


def shard_dim(rank: int, mesh) -> None:
    """Rank 0 shards the experts on dim 1, rank 1 on dim 2: the same planned
    (W, numel / W) rows, a different parameter in them."""
    model = Experts()
    fsdp_rs.fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1 + rank % 2))
    step(model)


def off_switch(rank: int, mesh) -> dict:
    """FSDP_RS_CHECK_PLANS=0: a requires_grad mismatch (which issues the same
    collectives in forward) goes through; turned on again, it is caught."""
    results = {}
    for value in ("0", "1"):
        model = mlp()
        shard(model, mesh)
        if rank == 1:
            model[0].weight.requires_grad_(False)
        os.environ[ENV_VAR] = value
        try:
            with torch.no_grad(), Collectives() as counted:
                model(torch.randn(4, 8))
            results[value] = {"collectives": counted.count}
        except RuntimeError as e:
            results[value] = {"error": str(e)}
        finally:
            del os.environ[ENV_VAR]
    return results


SCENARIOS: dict[str, Callable[[int, Any], Any]] = {
    f.__name__: f
    for f in (
        matching,
        width,
        order,
        dtype,
        requires_grad,
        reshard,
        mixed_precision,
        grad_dtype,
        offload,
        ignored,
        other_mesh,
        wrapped_on_one_rank,
        paramless_on_one_rank,
        wrapped_after_forward,
        shard_dim,
        off_switch,
    )
}

# name -> mesh shape ((replicate, shard) for HSDP) as a function of the world size
MESHES: dict[str, Callable[[int], tuple[int, ...]]] = {
    "flat": lambda w: (w,),
    "hsdp_replicate": lambda w: (w, 1),
    "hsdp_shard": lambda w: (1, w),
    "hsdp_2d": lambda w: (2, w // 2),
}


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    """``names`` are ``scenario@mesh``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    meshes = {}
    results = {}
    for name in names:
        scenario, _, mesh_name = name.partition("@")
        shape = MESHES[mesh_name](world_size)
        if shape not in meshes:
            dim_names = ("replicate", "shard") if len(shape) == 2 else None
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=dim_names)
        try:
            results[name] = {"result": SCENARIOS[scenario](rank, meshes[shape])}
        except Exception as e:
            results[name] = {
                "error": type(e).__name__,
                "runtime_error": isinstance(e, RuntimeError),
                "message": str(e),
                "traceback": traceback.format_exc(),
            }
        dist.barrier()
    finish(out_dir, rank, results)
