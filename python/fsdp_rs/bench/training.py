"""``bench init`` and ``bench step``: fsdp-rs's ``fully_shard`` against torch
FSDP2's on the same model, in one process over torch's fake process group
(collectives return at once, so what is timed is the Python and copy work of
sharding, not communication; the all-gathered values are not real, so the
sharded models' outputs are not comparable to the unsharded one's).

The model has many small parameter tensors: blocks of ``BLOCK_SHAPES`` (a
transformer layer's shapes at width 8), each block one ``fully_shard`` group,
then the root. A block's forward uses every parameter once:
``x + cat(flattened params).sum()``. With ``tp > 1`` the mesh is ``(W / tp,
tp)``: every parameter is first a DTensor sharded on dim 0 over ``tp`` (as
tensor parallelism leaves it), then ``fully_shard`` shards it over ``dp`` ([Note:
DTensor parameters]); the unsharded model has the same DTensor parameters.

``model="linears"`` is pytorch/pytorch#173680's shape instead: a chain of
``n_params / 2`` ``nn.Linear(8, 8)`` modules (two parameters each), each its
own ``fully_shard`` group.

Both benchmarks also time ``floor.bare_shard`` ([Note: The floor]) on the
1-D mesh: the torch calls any FSDP makes, without fsdp-rs's bookkeeping
(``bench step`` only without the optimizer step, which the floor does not
provide).

[Note: Bookkeeping overhead]
``bench step`` times a training step of four copies of the model (unsharded,
fsdp-rs, torch FSDP2, and fsdp-rs with the groups ``auto_shard`` chooses):
``zero_grad(set_to_none=True)``, forward, backward and, with
``optimizer="adamw"``, an AdamW step (foreach; fsdp-rs's through
``FlatOptimizer``, the others per parameter as torch steps them).
A round runs each model in turn for one untimed step and ``STEPS_PER_ROUND``
timed ones: consecutive steps of one model, as in training (alternating models
step by step would also charge every step the cache misses of re-reading its
model's tens of thousands of tensor objects after the other models evicted
them). Rounds alternate the models so that a slow stretch of the machine hits
all three alike. The per-step bookkeeping overhead of a sharding library is the
median over rounds of its round time (median of the timed steps) minus the
unsharded model's in the same round. Records also keep every round's overheads
and their ratio (``round_speedups``), whose range the table prints: on a shared
machine it shows how far one round can be from the median.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_rs.bench.timing import fresh_dtensor_caches

__all__ = [
    "BLOCK_SHAPES",
    "BenchModel",
    "LinearChain",
    "bench_init",
    "bench_step",
    "fake_process_group",
    "shard_model",
]

BLOCK_SHAPES: tuple[tuple[int, ...], ...] = (
    (8,),  # norm
    (24, 8),  # qkv
    (24,),
    (8, 8),  # out projection
    (8,),
    (8,),  # norm
    (32, 8),  # mlp up
    (32,),
    (8, 32),  # mlp down
    (8,),
)


class Block(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], tp_mesh=None) -> None:
        super().__init__()
        params = [torch.randn(s) * 0.02 for s in shapes]
        if tp_mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            params = [distribute_tensor(p, tp_mesh, [Shard(0)]) for p in params]
        self.params = nn.ParameterList(map(nn.Parameter, params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.cat([p.reshape(-1) for p in self.params]).sum()
        if hasattr(total, "full_tensor"):  # a DTensor (tp > 1)
            total = total.full_tensor()
        return x + total


class BenchModel(nn.Module):
    """``n_params`` parameter tensors in blocks of ``block_params`` (DTensors on
    ``tp_mesh`` if given)."""

    def __init__(self, n_params: int, block_params: int, tp_mesh=None) -> None:
        super().__init__()
        shapes = [BLOCK_SHAPES[i % len(BLOCK_SHAPES)] for i in range(n_params)]
        self.blocks = nn.ModuleList(
            Block(shapes[i : i + block_params], tp_mesh) for i in range(0, n_params, block_params)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LinearChain(nn.Module):
    """``n_params / 2`` ``nn.Linear(8, 8)`` modules applied in turn: the
    many-small-modules model of pytorch/pytorch#173680; each is a block."""

    def __init__(self, n_params: int, block_params: int = 2, tp_mesh=None) -> None:
        super().__init__()
        if tp_mesh is not None:
            raise ValueError("the linears model has no tensor-parallel form: use --tp 1")
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(max(1, n_params // 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(-1).expand(*x.shape, 8) if x.dim() == 1 else x
        for block in self.blocks:
            x = block(x)
        return x


MODELS = {"blocks": BenchModel, "linears": LinearChain}


def fake_process_group(world_size: int) -> None:
    """Rank 0 of a fake process group of ``world_size`` (replacing any other)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _fully_shard(library: str) -> Callable[..., Any]:
    if library == "fsdp_rs":
        from fsdp_rs import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def meshes(world_size: int, tp: int) -> tuple[Any, Any]:
    """(the mesh fully_shard shards over, the TP mesh or None): the default 1-D
    mesh for ``tp == 1``, else the dims of a ``(W / tp, tp)`` mesh."""
    if tp == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def shard_model(model: nn.Module, library: str, mesh=None) -> float:
    """Apply ``library``'s fully_shard per block, then to the root; seconds.
    ``fsdp_rs_auto``: fsdp-rs's ``auto_shard`` with its default budget;
    ``floor``: ``floor.bare_shard`` per block ([Note: The floor])."""
    if library == "floor" and mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gc.collect()
    start = time.perf_counter()
    if library == "floor":
        from fsdp_rs.bench.floor import bare_shard

        bare_shard(model, mesh)
        return time.perf_counter() - start
    if library == "fsdp_rs_auto":
        from fsdp_rs import auto_shard

        auto_shard(model, mesh=mesh)
        return time.perf_counter() - start
    fully_shard = _fully_shard(library)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return time.perf_counter() - start


def _groups(model: nn.Module) -> int:
    """fully_shard groups of a sharded model (modules whose class fully_shard
    swapped; a list call's modules share one state, counted once)."""
    from fsdp_rs.runtime.group.params import state_of

    states = {id(state_of(m)) for m in model.modules() if state_of(m) is not None}
    return len(states) or sum(type(m).__name__.startswith("FSDP") for m in model.modules())


def _optimizer(model: nn.Module, library: str, optimizer: str):
    if optimizer == "none":
        return None
    if library.startswith("fsdp_rs"):
        from fsdp_rs.optim import FlatOptimizer

        return FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _warm_up() -> None:
    """One-time imports and caches (DTensor, dynamo's disable wrappers, the
    default mesh) on a tiny model, so neither library pays them in its timing."""
    for library in ("fsdp_rs", "torch", "floor"):
        model = BenchModel(2 * len(BLOCK_SHAPES), len(BLOCK_SHAPES))
        shard_model(model, library)
        model(torch.zeros(4)).sum().backward()


def _record(
    bench: str, n_params: int, world_size: int, block_params: int, tp: int
) -> dict[str, Any]:
    """The fields every init and step record starts with."""
    return {
        "bench": bench,
        "n_params": n_params,
        "world_size": world_size,
        "tp": tp,
        "block_params": block_params,
        "groups": -(-n_params // block_params) + 1,  # the blocks and the root
    }


def bench_init(
    n_params: int, world_size: int, block_params: int, torch_too: bool, seed: int = 0, tp: int = 1
) -> dict[str, Any]:
    """Seconds of fully_shard on a fresh model, fsdp-rs, torch FSDP2 (if
    ``torch_too``) and the floor (1-D meshes: [Note: The floor])."""
    fake_process_group(world_size)
    _warm_up()
    dp_mesh, tp_mesh = meshes(world_size, tp)
    times = {}
    libraries = ("fsdp_rs", "torch") if torch_too else ("fsdp_rs",)
    for library in libraries + (("floor",) if tp == 1 else ()):
        torch.manual_seed(seed)
        model = BenchModel(n_params, block_params, tp_mesh)
        times[library] = shard_model(model, library, dp_mesh)
        del model
        gc.collect()
    torch_s = times.get("torch")
    return {
        **_record("init", n_params, world_size, block_params, tp),
        "fsdp_rs_s": times["fsdp_rs"],
        "torch_s": torch_s,
        "floor_s": times.get("floor"),
        "speedup": None if torch_s is None else torch_s / times["fsdp_rs"],
    }


def _step(model: nn.Module, x: torch.Tensor, opt=None) -> float:
    start = time.perf_counter()
    if opt is None:
        model.zero_grad(set_to_none=True)
    else:
        opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    if opt is not None:
        opt.step()
    return time.perf_counter() - start


STEPS_PER_ROUND = 2
LIBRARIES = ("unsharded", "fsdp_rs", "torch", "fsdp_rs_auto", "floor")


def bench_step(
    n_params: int,
    world_size: int,
    block_params: int,
    repeat: int,
    seed: int = 0,
    tp: int = 1,
    model: str = "blocks",
    optimizer: str = "adamw",
    torch_too: bool = True,
) -> dict[str, Any]:
    """Median training-step seconds of the unsharded model, fsdp-rs, torch
    FSDP2 (if ``torch_too``; its fields are None otherwise), fsdp-rs grouped
    by ``auto_shard`` and the floor (1-D, no optimizer: [Note: The floor]; None
    otherwise); see [Note: Bookkeeping overhead]."""
    fake_process_group(world_size)
    _warm_up()
    dp_mesh, tp_mesh = meshes(world_size, tp)
    floor_too = tp == 1 and optimizer == "none"
    skip = {"torch"} if not torch_too else set()
    if not floor_too:
        skip.add("floor")
    libraries = tuple(x for x in LIBRARIES if x not in skip)
    models, opts, groups = {}, {}, {}
    for library in libraries:
        torch.manual_seed(seed)
        models[library] = MODELS[model](n_params, block_params, tp_mesh)
        if library != "unsharded":
            shard_model(models[library], library, dp_mesh)
            groups[library] = _groups(models[library])
        opts[library] = _optimizer(models[library], library, optimizer)
    x = torch.randn(4)
    for name, m in models.items():  # first step: lazy init, gradient views
        _step(m, x, opts[name])
    samples: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeat):
        for name, m in models.items():
            fresh_dtensor_caches()  # [Note: One process, two libraries]
            _step(m, x, opts[name])  # untimed: brings this model back into the caches
            timed = [_step(m, x, opts[name]) for _ in range(STEPS_PER_ROUND)]
            samples[name].append(statistics.median(timed))
    step = {name: statistics.median(s) for name, s in samples.items()}
    rounds = {
        name: [a - b for a, b in zip(samples[name], samples["unsharded"], strict=True)]
        for name in libraries[1:]
    }
    fsdp_rs_s = statistics.median(rounds["fsdp_rs"])
    torch_s = statistics.median(rounds["torch"]) if torch_too else None
    auto_s = statistics.median(rounds["fsdp_rs_auto"])
    floor_s = statistics.median(rounds["floor"]) if floor_too else None
    record = _record("step", n_params, world_size, block_params, tp)
    if model == "linears":
        record["block_params"] = 2
    record["groups"] = groups["fsdp_rs"]
    return {
        **record,
        "model": model,
        "optimizer": optimizer,
        "repeat": repeat,
        "unsharded_step_s": step["unsharded"],
        "fsdp_rs_step_s": step["fsdp_rs"],
        "torch_step_s": step.get("torch"),
        "fsdp_rs_auto_step_s": step["fsdp_rs_auto"],
        "auto_groups": groups["fsdp_rs_auto"],
        "torch_groups": groups.get("torch"),
        "fsdp_rs_s": fsdp_rs_s,
        "torch_s": torch_s,
        "fsdp_rs_auto_s": auto_s,
        "floor_step_s": step.get("floor"),
        "floor_groups": len(models["floor"].blocks) if floor_too else None,
        "floor_s": floor_s,
        "speedup": torch_s / fsdp_rs_s if torch_s is not None and fsdp_rs_s > 0 else None,
        # per round, to show the machine's noise: the overheads and their ratio
        "fsdp_rs_round_s": rounds["fsdp_rs"],
        "torch_round_s": rounds.get("torch"),
        "fsdp_rs_auto_round_s": rounds["fsdp_rs_auto"],
        "floor_round_s": rounds.get("floor"),
        "round_speedups": [
            t / f if f > 0 else None
            for f, t in zip(rounds["fsdp_rs"], rounds["torch"], strict=True)
        ]
        if torch_too
        else [],
    }
