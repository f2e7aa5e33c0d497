"""``bench modules``: pytorch/pytorch#173680's shape (a model of many tiny
modules, each its own ``fully_shard`` group) trained on real gloo ranks, DDP,
FSDP2 and fsdp-rs side by side.

``WORLD_SIZE`` ranks are spawned on CPU (gloo, one torch/OpenMP thread each).
The model is ``blocks`` blocks ``nn.Sequential(nn.Linear(d, d),
nn.LayerNorm(d))``; the loss ``model(x).square().mean()`` of an ``(8, d)``
batch, drawn per step and rank from a fixed seed, so every column sees the same
data; ``AdamW(lr=1e-3)`` (torch's default ``foreach``), for the fsdp-rs columns
through ``FlatOptimizer`` unless ``optimizer="adamw"`` (the same updates bit for
bit, in O(groups)). Every column builds the
model from the same seed (the same initial weights) and trains it ``warmup``
untimed steps, then ``steps`` timed ones (forward, backward, optimizer step,
``zero_grad``; ``time.perf_counter``, a ``dist.barrier`` before each, the
garbage collector paused inside, as ``timing.time_call`` does). A step's time
is the slowest rank's; a column's is the median over its timed steps.

Columns (``COLUMNS``):
- ``ddp``: torch ``DistributedDataParallel``;
- ``fsdp2``: torch FSDP2 ``fully_shard`` on every block, then the root;
- ``fsdp_rs``: ``fsdp_rs.fully_shard`` on every block, then the root;
- ``fsdp_rs_root``: ``fsdp_rs.fully_shard(model)`` alone: one group;
- ``fsdp_rs_auto``: ``fsdp_rs.auto_shard(model, group_bytes=B)``;
- ``fsdp_rs_hand``: the groups ``fsdp_rs.auto_shard_groups`` plans, each
  passed to ``fsdp_rs.fully_shard([...])`` here, then the root: the same
  grouping by hand.

The sharded columns compute the same math (the reductions average the same two
values elementwise, whatever the groups), so their losses must be equal bit for
bit (``losses_equal``; DDP's all-reduce sums then divides, and may round
otherwise). After the timed steps every column runs one more, untimed step
under ``CommDebugMode``, which counts the c10d collectives (gloo's included)
that the step issued: all-gathers, reduce-scatters, all-reduces per step.

With ``memory``, each rank's peak: the most bytes of live tensors
(``MemTracker``: every storage allocated, with the parameters, gradients and
optimizer state) from the model's construction to the end of the warm-up
steps; the tracker is off in the timed steps. It is opt-in: a dispatch mode
and hooks on every module slow sharding and the warm-up steps, and at 100
blocks made the whole run 2.5 times as long (95 s against 38 s).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_rs.bench.timing import fresh_dtensor_caches

__all__ = [
    "COLUMNS",
    "SHARDED",
    "WORLD_SIZE",
    "bench_modules",
    "hand_groups",
    "make_model",
]

WORLD_SIZE = 2
BATCH = 8
COLUMNS = ("ddp", "fsdp2", "fsdp_rs", "fsdp_rs_root", "fsdp_rs_auto", "fsdp_rs_hand")
SHARDED = COLUMNS[1:]
GLOO_TIMEOUT_S = 300  # FSDP2's fully_shard of thousands of blocks takes a while per rank

# Warnings every step of this model would print on every rank: FSDP2's about
# the root's output being a view of the last block's, and autograd's about a
# full backward hook on a module whose input needs no gradient.
_QUIET = ("FSDP2-wrapped module", "Full backward hook is firing")


def make_model(blocks: int, dim: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim)) for _ in range(blocks))
    )


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def hand_groups(model: nn.Module, group_bytes: int) -> list[list[nn.Module]]:
    """The groups ``auto_shard`` would make of ``model`` ([Note: Module
    grouping]), for the ``fsdp_rs_hand`` column to shard by hand."""
    import fsdp_rs

    return fsdp_rs.auto_shard_groups(model, group_bytes=group_bytes)


def _shard(column: str, model: nn.Sequential, mesh, group_bytes: int) -> nn.Module:
    """``model`` wrapped or sharded as ``column`` says."""
    if column == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    import fsdp_rs

    if column == "fsdp_rs_auto":
        return fsdp_rs.auto_shard(model, group_bytes=group_bytes, mesh=mesh)
    if column == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdp_rs.fully_shard
    if column in ("fsdp2", "fsdp_rs"):
        for block in model:
            fully_shard(block, mesh=mesh)
    elif column == "fsdp_rs_hand":
        for group in hand_groups(model, group_bytes):  # one module: itself, as auto_shard
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root (the only call for fsdp_rs_root)
    return model


def _groups(column: str, model: nn.Module) -> int | None:
    """``fully_shard`` calls that manage parameters (None for DDP)."""
    if column == "ddp":
        return None
    if column == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        groups = set()
        for m in model.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                found = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13
                if found is None:
                    found = [state._fsdp_param_group]
                groups.update(id(g) for g in found if g is not None)
        return len(groups)
    return len(model._groups(recurse=True))


def _batch(step: int, rank: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, dim, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _peak(tracker) -> int:
    return int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


_KINDS = (("allgather", "all_gathers"), ("reducescatter", "reduce_scatters"),
          ("allreduce", "all_reduces"))  # fmt: skip


def _collectives(counts: dict) -> dict[str, int]:
    """``CommDebugMode``'s counts (per op) summed per kind."""
    out = {name: 0 for _, name in _KINDS}
    out["other_collectives"] = 0
    for op, n in counts.items():
        key = str(op).replace("_", "").lower()
        name = next((name for kind, name in _KINDS if kind in key), "other_collectives")
        out[name] += n
    return out


def _run_column(
    column: str,
    rank: int,
    mesh,
    blocks: int,
    dim: int,
    steps: int,
    warmup: int,
    group_bytes: int,
    seed: int,
    memory: bool,
    optimizer: str = "flat",
) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp_rs.kernels import _cpu_index

    fresh_dtensor_caches()  # [Note: One process, two libraries]
    _cpu_index.clear()  # each column's peak from a clean start, as bench memory's
    gc.collect()
    with contextlib.ExitStack() as stack:  # the memory tracker: to the end of warm-up
        tracker = None
        if memory and warmup:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            stack.enter_context(tracker)
        model = make_model(blocks, dim, seed)
        dist.barrier()
        start = time.perf_counter()
        model = _shard(column, model, mesh, group_bytes)
        shard_s = time.perf_counter() - start
        if optimizer == "flat" and column.startswith("fsdp_rs"):
            from fsdp_rs.optim import FlatOptimizer

            opt = FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if tracker is not None:
            tracker.track_external(model, opt)
        losses = []
        for s in range(warmup):
            if tracker is not None:
                tracker.reset_mod_stats()  # its per-module stats take one forward each
            losses.append(_step(model, opt, _batch(s, rank, dim)).item())
        peak = _peak(tracker) if tracker is not None else None
    seconds = []
    gc.collect()
    for s in range(warmup, warmup + steps):
        x = _batch(s, rank, dim)
        dist.barrier()
        gc.disable()
        try:
            start = time.perf_counter()
            loss = _step(model, opt, x)
            seconds.append(time.perf_counter() - start)
        finally:
            gc.enable()
        losses.append(loss.item())
    with CommDebugMode() as comm:  # one more step, untimed: its collectives
        _step(model, opt, _batch(warmup + steps, rank, dim))
    result = {
        "groups": _groups(column, model),
        "shard_s": shard_s,
        "step_s": seconds,
        "losses": losses,
        "peak_bytes": peak,
        **_collectives(comm.get_comm_counts()),
    }
    del model, opt
    gc.collect()
    return result


def _rank(
    rank: int,
    port: int,
    columns: Sequence[str],
    sizes: dict[str, int],
    out_dir: str,
) -> None:
    """One rank: every column in turn; its results in ``out_dir/rank{r}.json``."""
    from torch.distributed.device_mesh import init_device_mesh

    for message in _QUIET:
        warnings.filterwarnings("ignore", message=f".*{message}")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    torch.set_num_threads(1)
    import fsdp_rs.runtime  # noqa: F401  (imported before timing, as FSDP2 is)

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))  # CPU even next to a GPU
    results = {}
    for column in columns:
        start = time.perf_counter()
        results[column] = _run_column(column, rank, mesh, **sizes)
        if rank == 0:  # what a run cut short by a time limit got to
            r = results[column]
            step = statistics.median(r["step_s"]) * 1e3 if r["step_s"] else float("nan")
            print(
                f"  ({column}: {time.perf_counter() - start:.1f} s in all, sharding "
                f"{r['shard_s']:.2f} s, median step on rank 0 {step:.2f} ms)",
                file=sys.stderr,
                flush=True,
            )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    # [Note: Leaving a spawned rank] (tests/spawned.py): leave the group while
    # everything is alive and skip the interpreter's teardown.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _one_thread():
    """OMP_NUM_THREADS=1 in the environment the ranks are spawned with."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def bench_modules(
    columns: Sequence[str],
    blocks: int = 300,
    dim: int = 16,
    steps: int = 10,
    warmup: int = 2,
    group_bytes: int = 2**20,
    seed: int = 0,
    memory: bool = False,
    optimizer: str = "flat",
) -> list[dict[str, Any]]:
    """One record per column, from ``WORLD_SIZE`` spawned gloo ranks; with
    ``memory`` each rank's peak (``peak_bytes``, else None)."""
    import torch.multiprocessing as mp

    unknown = [c for c in columns if c not in COLUMNS]
    if unknown or not columns:
        raise ValueError(f"columns {list(columns)}: choose from {','.join(COLUMNS)}")
    sizes = dict(
        blocks=blocks,
        dim=dim,
        steps=steps,
        warmup=warmup,
        group_bytes=group_bytes,
        seed=seed,
        memory=memory,
        optimizer=optimizer,
    )
    with tempfile.TemporaryDirectory(prefix="fsdp_rs_bench_modules_") as out, _one_thread():
        args = (_free_port(), list(columns), sizes, out)
        mp.start_processes(_rank, args=args, nprocs=WORLD_SIZE, start_method="spawn")
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return _records(columns, per_rank, sizes)


def _records(columns, per_rank: list[dict], sizes: dict) -> list[dict[str, Any]]:
    block_bytes = _bytes(nn.Sequential(nn.Linear(sizes["dim"], sizes["dim"]),
                                       nn.LayerNorm(sizes["dim"])))  # fmt: skip
    records = []
    for column in columns:
        ranks = [r[column] for r in per_rank]
        first = ranks[0]
        # a step lasts as long as its slowest rank
        step_s = [max(ts) for ts in zip(*(r["step_s"] for r in ranks), strict=True)]
        records.append(
            {
                "bench": "modules",
                "column": column,
                "world_size": WORLD_SIZE,
                **sizes,
                "batch": BATCH,
                "block_bytes": block_bytes,
                "groups": first["groups"],
                "step_s": statistics.median(step_s) if step_s else None,
                "step_s_each": step_s,
                "shard_s": max(r["shard_s"] for r in ranks),
                "all_gathers": first["all_gathers"],
                "reduce_scatters": first["reduce_scatters"],
                "all_reduces": first["all_reduces"],
                "other_collectives": first["other_collectives"],
                "final_loss": first["losses"][-1] if first["losses"] else None,
                "losses": first["losses"],  # rank 0's, every step
                "peak_bytes": [r["peak_bytes"] for r in ranks],
            }
        )
    ddp = next((r["step_s"] for r in records if r["column"] == "ddp"), None)
    sharded = [r for r in records if r["column"] in SHARDED]
    for r in records:
        r["ratio_to_ddp"] = None if ddp is None or r["step_s"] is None else r["step_s"] / ddp
        r["losses_equal"] = r["losses"] == sharded[0]["losses"] if r in sharded else None
        r["losses_equal_to"] = sharded[0]["column"] if r in sharded else None
    return records
