"""Running scenario workers in spawned gloo processes, one per rank, shared by
the spawned test modules: each worker takes ``(rank, world_size, port, names,
out_dir)`` and writes ``rank{r}.json`` with its results per scenario."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_scenarios(worker: Callable, world_size: int, names: list[str], out: Path) -> None:
    """Run ``worker`` on ``world_size`` spawned ranks; raises if a rank did."""
    mp.spawn(worker, args=(world_size, free_port(), names, str(out)), nprocs=world_size)


def read_ranks(out: Path, world_size: int) -> list[dict]:
    """Each rank's results; ``{}`` for a rank that wrote none."""
    paths = [out / f"rank{r}.json" for r in range(world_size)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]
