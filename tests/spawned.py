"""Running scenario workers in spawned gloo processes, one per rank, shared by
the spawned test modules: each worker takes ``(rank, world_size, port, names,
out_dir)`` and writes ``rank{r}.json`` with its results per scenario."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_scenarios(
    worker: Callable,
    world_size: int,
    names: list[str],
    out: Path,
    timeout_s: float | None = None,
) -> None:
    """Run ``worker`` on ``world_size`` spawned ranks; raises if a rank did, or
    (killing the ranks) if they are not done after ``timeout_s`` seconds."""
    args = (world_size, free_port(), names, str(out))
    if timeout_s is None:
        mp.spawn(worker, args=args, nprocs=world_size)
        return
    context = mp.start_processes(worker, args=args, nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the {world_size} ranks did not finish in {timeout_s} s")


def read_ranks(out: Path, world_size: int) -> list[dict]:
    """Each rank's results; ``{}`` for a rank that wrote none."""
    paths = [out / f"rank{r}.json" for r in range(world_size)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]
