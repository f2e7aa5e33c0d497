"""torch.compile of the fuzz's seeded random runs (``fuzz_compile_scenarios``)
on gloo: compiled fsdp-rs trains bit for bit as eager fsdp-rs, at both
compile levels, or (traced hooks with branches on alternate ranks) every rank
raises. 16 seeds at W = 2 and 8 at W = 4 (HSDP, ``reshard_after_forward=2``);
``FSDP_RS_FUZZ_COMPILE_SEEDS=a:b`` runs seeds a..b-1 at both instead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_compile_scenarios import config, problem, run
from spawned import seeds_by_world_size, seeds_from_env

SEEDS = seeds_from_env("FSDP_RS_FUZZ_COMPILE_SEEDS", {2: range(16), 4: range(8)})
CASES = [(w, s) for w, seeds in SEEDS.items() for s in seeds]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per world size, each rank's results, spawned once (at the first test of
    that world size)."""
    return seeds_by_world_size(tmp_path_factory, SEEDS, run, "fuzz_compile")


@pytest.mark.parametrize(("world_size", "seed"), CASES, ids=[f"W{w}-seed{s}" for w, s in CASES])
def test_compiled_random_training_matches_eager(results, world_size, seed):
    cfg = config(seed, world_size)
    found = problem(cfg, [per_rank[f"seed{seed}"] for per_rank in results(world_size)])
    assert found is None, f"{found}; {cfg}"
