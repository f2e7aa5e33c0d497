"""``Shard(d != 0)`` from ``shard_placement_fn`` (``shard_dim_scenarios.py``):
placements, local shards, losses, gradient norms, gradients and final
parameters bit for bit torch FSDP2's, at W = 2 and 4 (every local shard a
whole number of 16-byte units: [Note: Gloo sums by buffer size] in
``test_dropin.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from shard_dim_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_fsdp2(results, name):
    for rank, r in each_rank(SCENARIOS, results, name):
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
