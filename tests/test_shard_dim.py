"""``Shard(d != 0)`` from ``shard_placement_fn`` (``shard_dim_scenarios.py``):
placements, local shards, losses, gradient norms, gradients and final
parameters bit for bit torch FSDP2's, at W = 2 and 4 (every local shard a
whole number of 16-byte units: [Note: Gloo sums by buffer size] in
``test_dropin.py``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from shard_dim_scenarios import SCENARIOS, run
from spawned import gloo_worker, read_ranks, spawn_scenarios

WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    out = tmp_path_factory.mktemp(f"w{world_size}")
    failure = None
    try:
        worker = functools.partial(gloo_worker, run=run)
        names = [n for n, (_, kw) in SCENARIOS.items() if kw.get("min_world", 2) <= world_size]
        spawn_scenarios(worker, world_size, names, out, 600)
    except Exception as e:  # a rank raised: its JSON names the scenario
        failure = e
    return world_size, read_ranks(out, world_size), failure


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_fsdp2(results, name):
    world_size, per_rank, failure = results
    if SCENARIOS[name][1].get("min_world", 2) > world_size:
        pytest.skip(f"needs world size >= {SCENARIOS[name][1]['min_world']}")
    for rank in range(world_size):
        r = per_rank[rank].get(name)
        assert r is not None, f"rank {rank}: scenario {name} did not run ({failure})"
        assert "error" not in r or isinstance(r["error"], bool), f"rank {rank}:\n{r['error']}"
        rs, ref = r["rs"], r["torch"]
        if name == "uneven":
            assert rs == ref == {"error": True}
            continue
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses or norms differ"
        for param, observed in ref["params"].items():
            for key, value in observed.items():
                assert rs["params"][param][key] == value, f"rank {rank}: {param} {key} differ"
        if name.startswith("experts"):
            placements = "(Replicate(), Shard(dim=1))" if "hsdp" in name else "(Shard(dim=1),)"
            assert rs["params"]["blocks.0.w_in"]["placements"] == placements
