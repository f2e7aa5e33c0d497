"""Running scenario workers in spawned gloo processes, one per rank, shared by
the spawned test modules: each worker takes ``(rank, world_size, port, names,
out_dir)`` and writes ``rank{r}.json`` with its results per scenario.

[Note: Ranks from a forkserver]
Each rank is a fresh interpreter (fork is unsafe once the test process has run
torch's thread pools), and importing torch and its distributed packages costs
about 3 s of CPU per rank: about 30 spawns of 2 or 4 ranks per pytest run, on a
2-core CI machine. The ranks are therefore forked from multiprocessing's
forkserver, a clean process that has imported those packages once and run
nothing. A forked rank would see the environment of when the forkserver
started, so each rank takes the test process's environment as it is at the
spawn (``_in_environment``)."""

from __future__ import annotations

import datetime
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the forkserver imports once for every rank ([Note: Ranks from a forkserver]).
mp.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.device_mesh",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "fsdp_rs",
    ]
)


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
    args = (worker, dict(os.environ), world_size, free_port(), names, str(out))
    context = mp.start_processes(
        _in_environment, args=args, nprocs=world_size, join=False, start_method="forkserver"
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not context.join(
            timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ):
            if deadline is not None and time.monotonic() >= deadline:
                _stop(context.processes)
                raise TimeoutError(
                    f"the {world_size} ranks did not finish in {timeout_s} s\n"
                    f"{_progress(out, world_size, len(names))}"
                )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise RuntimeError(f"{e}\n{_progress(out, world_size, len(names))}") from e


def _stop(processes: list) -> None:
    """SIGTERM (each rank writes its stacks, ``_in_environment``), then SIGKILL
    for a rank still alive 10 s later."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def _in_environment(rank: int, worker: Callable, environ: dict, *args) -> None:
    """``worker(rank, *args)`` in the spawning process's environment; should the
    rank die of a signal, its threads' Python stacks are in ``faults_path``: a
    fault's, or SIGTERM's, which ``torch.multiprocessing`` sends the ranks still
    running when another failed (where they were waiting is the clue)."""
    os.environ.clear()
    os.environ.update(environ)
    _compile_in_process()
    out_dir = args[-1]  # (world_size, port, names, out_dir)
    with open(faults_path(out_dir, rank), "w") as faults:
        faulthandler.enable(faults, all_threads=True)
        faulthandler.register(signal.SIGTERM, faults, all_threads=True, chain=True)
        try:
            worker(rank, *args)
        finally:  # before the file closes: its descriptor may be reused after
            faulthandler.unregister(signal.SIGTERM)
            faulthandler.disable()


def _compile_in_process() -> None:
    """Inductor compiles in the rank's own process.

    [Note: One compile thread per rank]
    By default each process that compiles with inductor starts a pool, a sidecar
    process with one worker per core, and waits on it for the generated code.
    The ranks of a spawn already share the CI machine's two cores (one thread
    each), so the pools only add processes; and a sidecar that dies leaves the
    rank waiting forever on a pipe that never closes (fixed in torch by
    pytorch/pytorch#189290, July 2026, after the oldest torch CI runs), while
    the other ranks time out in a collective. A spawned rank therefore compiles
    with one thread, which skips the pool; the code it generates is the same.
    Set through the variable that inductor's config reads when first imported,
    so that the many ranks that never compile do not import it (0.6 to 1.3 s
    each); should the forkserver have imported it already, directly."""
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = 1


def _progress(out: Path, world_size: int, total: int) -> str:
    """How far each rank got, from the results it wrote (``scenario_done``), with
    the tracebacks of the scenarios it recorded as raising: a rank killed by a
    signal after writing all of them died in its exit, not in a scenario."""
    parts = []
    for rank in range(world_size):
        try:
            results = json.loads(results_path(out, rank).read_text())
        except (OSError, ValueError):  # none yet, or cut off mid-write
            results = {}
        parts.append(f"rank {rank} wrote {len(results)} of {total} results")
        if results:
            parts[-1] += f", the last {list(results)[-1]}"
        for name, result in results.items():
            if isinstance(result, dict) and "error" in result:
                parts[-1] += f"; its scenario {name} raised:\n{str(result['error'])[-3000:]}\n"
        try:
            stacks = faults_path(out, rank).read_text().strip()
        except OSError:
            stacks = ""
        if stacks:
            parts[-1] += f"; its stacks when it died:\n{stacks[-6000:]}\n"
    return "\n".join(parts)


def faults_path(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s Python stacks go should it die of a signal."""
    return Path(out_dir, f"rank{rank}.faults")


def results_path(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its results."""
    return Path(out_dir, f"rank{rank}.json")


def write_results(out_dir: str | Path, rank: int, results: dict) -> None:
    results_path(out_dir, rank).write_text(json.dumps(results))


def scenario_done(out_dir: str, rank: int, results: dict) -> None:
    """A spawned rank's step after each scenario: its results so far on disk,
    then a barrier. A rank that raised mid-scenario records the traceback and
    reaches the barrier while the others wait in a collective; should that
    barrier time out, ``spawn_scenarios`` shows what each rank wrote."""
    write_results(out_dir, rank, results)
    dist.barrier()


def finish(out_dir: str, rank: int, results: dict) -> NoReturn:
    """A spawned rank's last step: write its results, leave the process group
    and exit at once.

    [Note: Leaving a spawned rank]
    A spawned child normally ends in the interpreter's teardown, which frees
    what is left of gloo (worker threads, pending work holding tensors) while
    the interpreter is half gone. A CI run on torch 2.15 lost a rank to SIGABRT
    ("terminate called without an active exception", a C++ thread never
    joined), which nothing in a scenario raises; it did not recur in 37 runs
    here. Nothing after the results is under test, so a rank leaves the group
    while everything is alive and skips the teardown (``os._exit``); should a
    rank die again, ``spawn_scenarios`` says how far each rank got."""
    write_results(out_dir, rank, results)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def read_ranks(out: Path, world_size: int) -> list[dict]:
    """Each rank's results; ``{}`` for a rank that wrote none."""
    paths = [results_path(out, r) for r in range(world_size)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]


def gloo_worker(
    rank: int,
    world_size: int,
    port: int,
    names: list[str],
    out_dir: str,
    run: Callable[[int, int, str], dict],
) -> None:
    """A worker for ``spawn_scenarios`` (bind ``run`` with ``functools.partial``):
    joins a gloo group (60 s timeout, so a mismatch fails instead of hanging), runs
    ``run(world_size, rank, name)`` per name with a barrier after each, and writes
    the results; a scenario that raises is recorded with its traceback, then
    re-raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    results: dict = {}
    for name in names:
        try:
            results[name] = run(world_size, rank, name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            write_results(out_dir, rank, results)
            raise
        scenario_done(out_dir, rank, results)
    finish(out_dir, rank, results)


def run_named(scenarios: dict, world_size: int, rank: int, name: str) -> dict:
    """Run scenario ``name`` of ``scenarios`` (name -> (function, kwargs); a
    ``min_world`` kwarg is for the test, not the function), then a barrier."""
    fn, kwargs = scenarios[name]
    kwargs = {k: v for k, v in kwargs.items() if k != "min_world"}
    result = fn(world_size, rank, **kwargs)
    dist.barrier()
    return result


def min_world(scenarios: dict, name: str) -> int:
    return scenarios[name][1].get("min_world", 2)


def spawn_results(scenarios: dict, run: Callable, world_size: int, out: Path) -> tuple:
    """Every scenario that fits ``world_size``, run in one spawn of gloo ranks:
    ``(world_size, per-rank results, the spawn's exception or None)``."""
    names = [n for n in scenarios if min_world(scenarios, n) <= world_size]
    failure = None
    try:
        spawn_scenarios(functools.partial(gloo_worker, run=run), world_size, names, out, 600)
    except Exception as e:  # a rank raised: its JSON names the scenario
        failure = e
    return world_size, read_ranks(out, world_size), failure


def results_fixture(scenarios: dict, run: Callable, world_sizes: tuple = (2, 4)):
    """A module-scoped pytest fixture ``results`` (assign it to that name): per
    world size of ``world_sizes``, ``spawn_results`` of the scenarios."""
    import pytest

    @pytest.fixture(scope="module", params=world_sizes, ids=lambda w: f"W{w}")
    def results(request, tmp_path_factory):
        world_size = request.param
        return spawn_results(scenarios, run, world_size, tmp_path_factory.mktemp(f"w{world_size}"))

    return results


def each_rank(scenarios: dict, results: tuple, name: str):
    """Each rank's result of scenario ``name`` as ``(rank, result)``; skips the
    test where the world is too small or the scenario returned ``{"skipped":
    why}`` (a feature this torch lacks), fails it where a rank did not run it or
    raised."""
    import pytest

    world_size, per_rank, failure = results
    if min_world(scenarios, name) > world_size:
        pytest.skip(f"needs world size >= {min_world(scenarios, name)}")
    for rank in range(world_size):
        result = per_rank[rank].get(name)
        assert result is not None, f"rank {rank}: scenario {name} did not run ({failure})"
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        if isinstance(result, dict) and result.get("skipped"):
            pytest.skip(str(result["skipped"]))
        yield rank, result


def seeds_from_env(variable: str, default: dict[int, range]) -> dict[int, Sequence[int]]:
    """The seeds a fuzzer runs per world size: ``default`` (in CI, the leg's
    share of it), or where the environment variable ``variable`` reads ``a:b``,
    seeds a..b-1 at each."""
    value = os.environ.get(variable)
    if not value:
        from ci_legs import fuzz_seeds  # [Note: CI legs]

        return fuzz_seeds(default)
    first, last = map(int, value.split(":"))
    return {w: range(first, last) for w in default}


def seeds_by_world_size(
    tmp_path_factory, seeds: dict[int, Sequence[int]], run: Callable, label: str
):
    """For seeded scenario modules (the fuzzers): a function of the world size
    that spawns ``run`` over that size's seeds once, at its first call, and
    returns each rank's results; a failed spawn raises at every call, without
    spawning again."""
    done: dict[int, list[dict] | Exception] = {}

    def of(world_size: int) -> list[dict]:
        if world_size not in done:
            out = tmp_path_factory.mktemp(f"{label}_w{world_size}")
            names = [f"seed{s}" for s in seeds[world_size]]
            worker = functools.partial(gloo_worker, run=run)
            try:
                spawn_scenarios(worker, world_size, names, out, timeout_s=1500)
                done[world_size] = read_ranks(out, world_size)
            except Exception as e:  # once, not again for every seed
                done[world_size] = e
        if isinstance(done[world_size], Exception):
            raise done[world_size]
        return done[world_size]

    return of


def run_seeds_cli(run: Callable, argv: list[str]) -> tuple[list[str], list[dict], int]:
    """``FIRST LAST [W]`` from ``argv``: seeds FIRST..LAST-1 run by ``run`` on W
    (default 2) spawned gloo ranks; (names, each rank's results, W)."""
    import tempfile

    first, last = int(argv[1]), int(argv[2])
    world_size = int(argv[3]) if len(argv) > 3 else 2
    names = [f"seed{s}" for s in range(first, last)]
    out = Path(tempfile.mkdtemp())
    spawn_scenarios(functools.partial(gloo_worker, run=run), world_size, names, out)
    return names, read_ranks(out, world_size), world_size
