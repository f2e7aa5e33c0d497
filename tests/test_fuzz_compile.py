"""torch.compile of the fuzz's seeded random runs (``fuzz_compile_scenarios``)
at W = 2 on gloo: compiled fsdp-rs trains bit for bit as eager fsdp-rs, at
both compile levels, or (traced hooks with branches on alternate ranks) every
rank raises. 16 seeds; ``FSDP_RS_FUZZ_COMPILE_SEEDS=a:b`` runs seeds a..b-1
instead."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_compile_scenarios import config, problem, run
from spawned import gloo_worker, read_ranks, spawn_scenarios

WORLD_SIZE = 2
_SEEDS = os.environ.get("FSDP_RS_FUZZ_COMPILE_SEEDS")
SEEDS = range(*map(int, _SEEDS.split(":"))) if _SEEDS else range(16)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz_compile")
    worker = functools.partial(gloo_worker, run=run)
    spawn_scenarios(worker, WORLD_SIZE, [f"seed{s}" for s in SEEDS], out, timeout_s=1500)
    return read_ranks(out, WORLD_SIZE)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_compiled_random_training_matches_eager(results, seed):
    cfg = config(seed, WORLD_SIZE)
    found = problem(cfg, [per_rank[f"seed{seed}"] for per_rank in results])
    assert found is None, f"{found}; {cfg}"
