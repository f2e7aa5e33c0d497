"""Per-parameter meshes from ``shard_placement_fn`` (``per_param_mesh_scenarios.py``):
torchtitan's MoE sharding (dense weights over the DP mesh, expert-parallel
experts over their expert-data-parallel mesh, on dim 0 or 1, in one
``fully_shard`` call) and plain parameters on an HSDP mesh of their own train
bit for bit as with torch FSDP2: placements, meshes, local shapes, losses,
gradients and trained values. Two mesh-info objects over one process group
are refused as FSDP2 refuses them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from per_param_mesh_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


@pytest.mark.parametrize("name", ["experts", "experts_dim1", "hsdp_head"])
def test_matches_fsdp2(results, name):
    for rank, r in each_rank(SCENARIOS, results, name):
        rs, ref = r["rs"], r["torch"]
        for key in ("sharded", "losses", "grads", "params"):
            assert rs[key] == ref[key], f"rank {rank}: {key} differs from torch FSDP2"
        assert all(g is not None for g in rs["grads"].values()), rank
        meshes = {tuple(p["mesh"]) for p in rs["sharded"].values()}
        assert len(meshes) == 2, f"rank {rank}: not two meshes: {meshes}"


def test_two_infos_one_process_group(results):
    for rank, r in each_rank(SCENARIOS, results, "two_infos_one_mesh"):
        assert r["torch"] == "ValueError" and r["rs"] == "ValueError", (rank, r)
