"""fsdp-rs against torch FSDP2 on seeded random models and training loops
(``fuzz_scenarios``) on gloo: bit for bit, and in fp32 runs at W = 2 equal to
the unsharded model with all-reduced gradients. 64 seeds at W = 2 and 16 at
W = 4 (HSDP, ``reshard_after_forward=2``); ``FSDP_RS_FUZZ_SEEDS=a:b`` runs
seeds a..b-1 at both instead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_scenarios import config, run
from spawned import seeds_by_world_size, seeds_from_env

SEEDS = seeds_from_env("FSDP_RS_FUZZ_SEEDS", {2: range(64), 4: range(16)})
CASES = [(w, s) for w, seeds in SEEDS.items() for s in seeds]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per world size, each rank's results, spawned once (at the first test of
    that world size)."""
    return seeds_by_world_size(tmp_path_factory, SEEDS, run, "fuzz")


@pytest.mark.parametrize(("world_size", "seed"), CASES, ids=[f"W{w}-seed{s}" for w, s in CASES])
def test_random_training_matches_fsdp2(results, world_size, seed):
    for rank, per_rank in enumerate(results(world_size)):
        r = per_rank[f"seed{seed}"]
        assert "error" not in r, r.get("error")
        where = f"rank {rank} of {world_size}"
        assert r["vs_torch"] is None, f"{where}: {r['vs_torch']}; {config(seed, world_size)}"
        if r["reference"]:
            assert r["rs_vs_reference"] is None, (
                f"{where}, unsharded reference: {r['rs_vs_reference']}; {config(seed, world_size)}"
            )
