"""What the side-by-side scenario modules share (``dropin_scenarios``,
``extension_scenarios``, ``shard_dim_scenarios``, ``nd_scenarios``): the two
libraries, the CPU meshes, the per-rank inputs, training a model eager and
compiled whole with traced hooks. Imports nothing a supported torch lacks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import fsdp_rs

# Every shard a multiple of 16 bytes: [Note: Gloo sums by buffer size] in test_dropin.py.
DIM, HIDDEN, OUT, BATCH, STEPS = 16, 32, 8, 6, 4
LIBS = {"rs": fsdp_rs.fully_shard, "torch": torch_fully_shard}


def _mesh(world_size: int, hsdp: bool):
    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    return init_device_mesh("cpu", (world_size,))


class CountingAllGather(AllGather):
    """A user's custom all-gather, as FSDP2 takes it."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class CountingReduceScatter(ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def reshard_all(model: torch.nn.Module) -> None:
    """``reshard()`` on every fully_shard module of ``model``, either library's."""
    for module in model.modules():
        if isinstance(module, fsdp_rs.FSDPModule | TorchFSDPModule):
            module.reshard()


def _inputs(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(BATCH, DIM, generator=gen)


def eager_and_compiled(
    build: Callable[[], torch.nn.Module], train: Callable, compiler: str = "aot_eager"
) -> dict:
    """The model ``build()`` makes (an fsdp-rs root) trained by ``train(model,
    run, after_first)`` eager (``run`` the model itself, ``after_first`` None),
    then, built again, compiled whole with ``fullgraph=True`` after
    ``set_fullgraph_compile()`` by ``compiler``, ``after_first()`` to be called
    after its first step. ``{"refused": message}`` where
    ``set_fullgraph_compile`` refuses; else what ``train`` returned per mode,
    ``"dynamo_graphs"``: how many graphs Dynamo had compiled after the first
    step and in all (equal: no recompiles), and ``"graphs"``: the ops of those
    AOT autograd compiled (``fullgraph_scenarios.ListingBackend``; none under
    inductor)."""
    from fullgraph_scenarios import ListingBackend

    backend = ListingBackend(compiler)
    first_step: list[int] = []
    model = build()
    out: dict = {"eager": train(model, model, None)}
    model = build()
    try:
        model.set_fullgraph_compile()
    except ValueError as e:
        return {"refused": str(e)}
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend, fullgraph=True)
    out["compiled"] = train(model, run, lambda: first_step.append(backend.dynamo_graphs))
    out["dynamo_graphs"] = [*first_step, backend.dynamo_graphs]
    out["graphs"] = backend.graphs
    return out


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
