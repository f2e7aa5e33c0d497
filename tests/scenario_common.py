"""What the side-by-side scenario modules share (``dropin_scenarios``,
``extension_scenarios``, ``shard_dim_scenarios``, ``nd_scenarios``): the two
libraries, the CPU meshes, the per-rank inputs, and compiling a model whole
with traced hooks. Imports nothing a supported torch lacks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_rs

# Every shard a multiple of 16 bytes: [Note: Gloo sums by buffer size] in test_dropin.py.
DIM, HIDDEN, OUT, BATCH, STEPS = 16, 32, 8, 6, 4
LIBS = {"rs": fsdp_rs.fully_shard, "torch": torch_fully_shard}


def _mesh(world_size: int, hsdp: bool):
    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    return init_device_mesh("cpu", (world_size,))


def _inputs(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(BATCH, DIM, generator=gen)


def fullgraph_compiled(model: torch.nn.Module, backend="aot_eager") -> torch.nn.Module | str:
    """``model`` (an fsdp-rs root) compiled whole with ``fullgraph=True`` after
    ``set_fullgraph_compile()``, or the message with which that refuses."""
    try:
        model.set_fullgraph_compile()
    except ValueError as e:
        return str(e)
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)


def train_adamw(
    model: torch.nn.Module, step_loss: Callable[[int], float], steps: int, grads: Callable
) -> tuple[list[float], object]:
    """``steps`` AdamW steps (foreach=False) of ``model``'s parameters:
    ``step_loss(step)`` runs a forward and backward and returns the loss;
    ``grads()`` observes the last step's gradients before its optimizer step.
    Returns the losses and that observation."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, observed = [], None
    for step in range(steps):
        losses.append(step_loss(step))
        if step == steps - 1:
            observed = grads()
        optim.step()
        optim.zero_grad()
    return losses, observed
