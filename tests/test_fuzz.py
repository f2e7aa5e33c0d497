"""fsdp-rs against torch FSDP2 on seeded random models and training loops
(``fuzz_scenarios``), W = 2 on gloo: bit for bit, and in fp32 runs equal to
the unsharded model with all-reduced gradients. ``FSDP_RS_FUZZ_SEEDS=a:b``
runs seeds a..b-1 instead of the default set."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_scenarios import config, run
from spawned import gloo_worker, read_ranks, spawn_scenarios

_first, _last = map(int, os.environ.get("FSDP_RS_FUZZ_SEEDS", "0:64").split(":"))
SEEDS = list(range(_first, _last))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz")
    names = [f"seed{s}" for s in SEEDS]
    spawn_scenarios(functools.partial(gloo_worker, run=run), 2, names, out, timeout_s=1200)
    return read_ranks(out, 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_training_matches_fsdp2(results, seed):
    for rank, per_rank in enumerate(results):
        r = per_rank[f"seed{seed}"]
        assert "error" not in r, r.get("error")
        assert r["vs_torch"] is None, f"rank {rank}: {r['vs_torch']}; {config(seed)}"
        if r["reference"]:
            assert r["rs_vs_reference"] is None, (
                f"rank {rank}, unsharded reference: {r['rs_vs_reference']}; {config(seed)}"
            )
