"""Lightning Fabric's ``ModelParallelStrategy`` with gradient accumulation
under ``fabric.no_backward_sync``, on CPU with gloo: the user's
``parallelize_fn`` (Fabric's ``configure_model``) calls ``fsdp_rs.fully_shard``
in one run and torch's ``fully_shard`` in the other, with nothing patched.

Lightning finds the modules to keep from syncing with
``isinstance(module, torch.distributed._composable.fsdp.FSDPModule)`` and calls
``set_requires_gradient_sync(..., recurse=False)`` on each: the accumulated
gradients equal FSDP2's only because fsdp-rs's modules are torch's
``FSDPModule``s ([Note: An FSDPModule to torch]); were they not, fsdp-rs would
reduce-scatter every micro-step and the sums would differ."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_rs
from clients.client_common import full, full_grads, full_state, sharded_by, summary
from fsdp_rs import switch
from spawned import run_named

ACCUM, STEPS = 2, 2  # micro-steps per optimizer step, optimizer steps
DIM, HIDDEN, BATCH = 16, 32, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(3)
    ]
    return nn.Sequential(*blocks, nn.LayerNorm(DIM), nn.Linear(DIM, 1))


def _train(rank: int, shard) -> dict:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model: nn.Module, mesh) -> nn.Module:  # the user's code
        for block in model[:3]:
            shard(block, mesh=mesh["data_parallel"])
        shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = ModelParallelStrategy(
        parallelize, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    record: dict = {"losses": [], "norms": [], "grads": [], "has_grad": []}
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS * ACCUM):
        x = torch.randn(BATCH, DIM, generator=gen)
        syncing = (step + 1) % ACCUM == 0
        with fabric.no_backward_sync(model, enabled=not syncing):
            loss = model(x).square().mean()
            fabric.backward(loss)
        record["losses"].append(loss.detach())
        record["has_grad"].append(torch.tensor([p.grad is not None for p in model.parameters()]))
        if syncing:
            record["grads"].append(full_grads(model))
            record["norms"].append(full(fabric.clip_gradients(model, optimizer, max_norm=1.0)))
            optimizer.step()
            optimizer.zero_grad()
    record["state"] = full_state(model)
    return {"record": record, "sharded_by": sharded_by(model)}


def no_backward_sync(world_size: int, rank: int) -> dict:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0"
    )
    assert not switch.patched()  # nothing patched: the user's code calls fsdp-rs
    rs = _train(rank, fsdp_rs.fully_shard)
    ref = _train(rank, torch_fully_shard)
    return summary(rs, ref)


SCENARIOS = {"no_backward_sync": (no_backward_sync, {})}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
