"""The spawn helpers themselves ([Note: Leaving a spawned rank]): a rank that
dies of a signal is reported with how far each rank got and where it died (its
Python stack); a rank that raises, with each rank's last scenario and the
tracebacks of the scenarios they recorded as raising (``scenario_done``), and
the stacks of a rank terminated because another failed; and a rank that ends
through ``finish`` (``gloo_worker``'s last step) exits 0 with its results
written."""

from __future__ import annotations

import ctypes
import datetime
import functools
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from spawned import (
    finish,
    gloo_worker,
    read_ranks,
    scenario_done,
    spawn_scenarios,
    write_results,
)


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
    assert "rank 1 wrote 1 of 2 results, the last a; its stacks when it died:" in message
    assert "in _die_by" in message and "in _dying_worker" in message


def _one_rank_raises(rank: int, world_size: int, port: int, names: list[str], out_dir: str):
    """Scenario ``b`` raises on rank 0 only, which records it and goes on to the
    barrier while rank 1 waits in the scenario's all-reduce: as a compile
    scenario that fails on one rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=5)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    results: dict = {}
    for name in names:
        try:
            if name == "b" and rank == 0:
                raise ValueError("scenario b fails on rank 0 only")
            dist.all_reduce(torch.ones(1))
            results[name] = {"done": True}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        scenario_done(out_dir, rank, results)
    finish(out_dir, rank, results)


def test_raising_rank_reports_what_each_rank_recorded(tmp_path):
    with pytest.raises(RuntimeError) as info:
        spawn_scenarios(_one_rank_raises, 2, ["a", "b", "c"], tmp_path, timeout_s=120)
    message = str(info.value)
    assert "rank 0 wrote 2 of 3 results, the last b; its scenario b raised:" in message
    assert "ValueError: scenario b fails on rank 0 only" in message
    assert "rank 1 wrote" in message


def _stuck_rank(rank: int, world_size: int, port: int, names: list[str], out_dir: str):
    """Rank 1 is stuck until torch.multiprocessing terminates it; rank 0 fails
    once rank 1 is waiting (its marker file written)."""
    marker = Path(out_dir, "rank1.waiting")
    if rank == 0:
        while not marker.exists():
            time.sleep(0.1)
        raise ValueError("rank 0 fails")
    _wait_forever(marker)


def _wait_forever(marker: Path) -> None:
    marker.touch()
    while True:
        time.sleep(0.1)


def test_terminated_rank_writes_its_stack(tmp_path):
    with pytest.raises(RuntimeError) as info:
        spawn_scenarios(_stuck_rank, 2, ["a"], tmp_path, timeout_s=120)
    message = str(info.value)
    assert "ValueError: rank 0 fails" in message
    assert "rank 1 wrote 0 of 1 results; its stacks when it died:" in message
    assert "in _wait_forever" in message and "in _stuck_rank" in message


def test_finish_writes_results_and_exits_cleanly(tmp_path):
    worker = functools.partial(gloo_worker, run=_echo)
    spawn_scenarios(worker, 2, ["x", "y"], tmp_path, timeout_s=120)
    assert read_ranks(tmp_path, 2) == [
        {n: {"rank": r, "name": n} for n in ("x", "y")} for r in range(2)
    ]
