"""Trainable sets that differ between ranks ([Note: One trainable set on every
rank] in ``runtime/checks/agreement.py``), run by spawned gloo ranks.

Each scenario trains an MLP of equal square layers for a step, changes
``requires_grad`` as it says, and runs a second step: ``per_rank`` freezes
layer ``rank % 2``'s weight (two ranks freeze equal sizes, so their
reduce-scatters would match in size and mix the gradients); ``one_rank``
freezes layer 0's weight on rank 0 only (the sizes differ); ``every_rank``
freezes it on every rank (no error); ``replicas`` (HSDP, a (2, W / 2) mesh)
freezes it on the second replica only, whose shard groups agree within.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from spawned import run_named

DIM = 8


def _frozen(kind: str, rank: int, world_size: int) -> list[int]:
    """The layers whose weight ``rank`` freezes after the first step."""
    if kind == "per_rank":
        return [rank % 2]
    if kind == "one_rank":
        return [0] if rank == 0 else []
    if kind == "every_rank":
        return [0]
    return [0] if rank >= world_size // 2 else []  # replicas: the second one


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def differing_sets(world_size: int, rank: int, kind: str) -> dict:
    """Two steps, ``requires_grad`` changed between them; the second step's
    error (if any), and whether any parameter moved in it."""
    from fsdp_rs import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(3)))
    if kind == "replicas":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank)
    for i in _frozen(kind, rank, world_size):
        model[i].weight.requires_grad_(False)
    before = [p.full_tensor() for p in model.parameters()]
    result: dict = {"raised": None}
    try:
        result["loss"] = _step(model, opt, 1, rank)
    except RuntimeError as e:
        result["raised"] = str(e)
        model.reset_iter_state()  # after an aborted backward
    after = [p.full_tensor() for p in model.parameters()]
    result["moved"] = [not torch.equal(a, b) for a, b in zip(after, before, strict=True)]
    result["grads"] = [p.grad is not None for p in model.parameters()]
    dist.barrier()
    return result


SCENARIOS = {
    "per_rank": (differing_sets, {"kind": "per_rank"}),
    "one_rank": (differing_sets, {"kind": "one_rank"}),
    "every_rank": (differing_sets, {"kind": "every_rank"}),
    "replicas": (differing_sets, {"kind": "replicas", "min_world": 4}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
