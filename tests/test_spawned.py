"""The spawn helpers themselves ([Note: Leaving a spawned rank]): a rank that
dies of a signal is reported with how far each rank got and where it died (its
Python stack), and a rank that ends
through ``finish`` (``gloo_worker``'s last step) exits 0 with its results
written."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from spawned import gloo_worker, read_ranks, spawn_scenarios, write_results


def _dying_worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str):
    """Writes its results, then rank 1 dies as CI ranks did: SIGABRT (torch 2.15,
    a C++ thread never joined) or SIGSEGV (torch 2.13)."""
    write_results(out_dir, rank, {"a": 1} if rank else {"a": 1, "b": 2})
    if rank == 1:
        _die_by(names[0])


def _die_by(how: str) -> None:
    if how == "SIGSEGV":
        ctypes.string_at(0)  # reads address 0
    os.kill(os.getpid(), signal.SIGABRT)


def _echo(world_size: int, rank: int, name: str) -> dict:
    return {"rank": rank, "name": name}


@pytest.mark.parametrize("how", ["SIGABRT", "SIGSEGV"])
def test_signal_death_names_each_ranks_progress_and_stack(tmp_path, how):
    with pytest.raises(RuntimeError) as info:
        spawn_scenarios(_dying_worker, 2, [how, "b"], tmp_path, timeout_s=120)
    message = str(info.value)
    assert f"signal {how}" in message
    assert "rank 1 wrote 1 of 2 results; its stacks when it died:" in message
    assert "in _die_by" in message and "in _dying_worker" in message


def test_finish_writes_results_and_exits_cleanly(tmp_path):
    worker = functools.partial(gloo_worker, run=_echo)
    spawn_scenarios(worker, 2, ["x", "y"], tmp_path, timeout_s=120)
    assert read_ranks(tmp_path, 2) == [
        {n: {"rank": r, "name": n} for n in ("x", "y")} for r in range(2)
    ]
