"""``spmd_types`` parameters (``spmd_types_scenarios.py``): plain parameters
annotated per mesh axis, sharded with ``dp_mesh_dims`` over a (dp, tp) mesh,
train bit for bit as with torch FSDP2 (storage placements, losses, sharded
gradients, trained values; fp32 and bf16 parameters, reshard_after_forward
False, tensor parallelism by hand with a ``Partial`` gradient on ``tp``), the
module computes with plain unsharded parameters, and misuse is refused as
FSDP2 refuses it. Skipped where torch or the environment lacks spmd_types."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from spawned import each_rank, results_fixture
from spmd_types_scenarios import SCENARIOS, run

results = results_fixture(SCENARIOS, run)


@pytest.mark.parametrize(
    "name",
    [
        "dp",
        "dp_keep",
        "dp_bf16",
        "dp_tp",
        "dp_tp_bf16",
        "dp_typechecked",
        "dp_tp_typechecked",
        "dp_cp",
        "dp_cp_typechecked",
        "dp_typechecked_two_dtypes",
        "dp_tp_typechecked_two_dtypes",
    ],
)
def test_training_matches_fsdp2(results, name):
    for rank, r in each_rank(SCENARIOS, results, name):
        rs, ref = r["rs"], r["torch"]
        for key in ("sharded", "losses", "unsharded_types", "compute_types", "grads", "params"):
            assert rs[key] == ref[key], f"rank {rank}: {key} differs from torch FSDP2"
        # not vacuous: DTensors on the full mesh, a gradient for every parameter
        assert all(p["type"] == "DTensor" for p in rs["sharded"].values()), rank
        assert all(g is not None and g["full"] for g in rs["grads"].values()), rank
        assert rs["unsharded_types"] == ["Parameter"] * len(rs["losses"]), rank


def test_storage_placements(results):
    """The sharded parameters' placements on (dp, tp) follow the types:
    ``Shard(0)`` on dp (``_StridedShard`` where tp splits dim 0 too), then
    ``S(d)`` -> ``Shard(d)``, ``R`` and ``I`` ->
    ``Replicate()`` on tp."""
    expected = {
        "w1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "w2.weight": "(Shard(dim=0), Shard(dim=1))",
        "w2.bias": "(Shard(dim=0), Replicate())",
        "scale": "(Shard(dim=0), Replicate())",
    }
    for rank, r in each_rank(SCENARIOS, results, "dp_tp"):
        for param, placements in expected.items():
            assert r["rs"]["sharded"][f"blocks.0.{param}"]["placements"] == placements, rank


def test_errors_match_fsdp2(results):
    for rank, r in each_rank(SCENARIOS, results, "errors"):
        for case, ref in r["torch"].items():
            got = r["rs"][case]
            assert ref is not None and got is not None, f"rank {rank}, {case}: {got} / {ref}"
            assert got.split(":")[0] == ref.split(":")[0], f"rank {rank}, {case}: {got} vs {ref}"


@pytest.mark.parametrize("name", ["dp", "dp_tp", "dp_cp"])
def test_training_matches_unsharded_reference(results, name):
    """The math itself: losses and trained ``full_tensor()`` values equal, to
    fp32 rounding, one rank training the unsharded model on all DP ranks'
    batches. With TP this checks the ``Partial`` gradient of ``scale`` (typed
    R on tp) is reduced over tp exactly once."""
    for rank, r in each_rank(SCENARIOS, results, name):
        ref = r["reference"]
        assert r["rs"]["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        for param, values in ref["params"].items():
            got = r["rs"]["params"][param]["full"]
            assert got == pytest.approx(values, rel=1e-4, abs=1e-5), f"rank {rank}: {param}"


@pytest.mark.parametrize("name", ["dp_typechecked_two_dtypes", "dp_tp_typechecked_two_dtypes"])
def test_types_restored_in_every_group(results, name):
    """Under type checking, the module computes with every parameter typed as
    annotated, also those of a second group (a frozen float64 parameter: one
    group per dtype)."""
    for rank, r in each_rank(SCENARIOS, results, name):
        for step in r["rs"]["compute_types"]:
            assert all(types != "[]" for types in step.values()), (rank, step)


@pytest.mark.parametrize(
    "name", ["fullgraph", "fullgraph_bf16", "fullgraph_tp", "fullgraph_cp", "fullgraph_tp_bf16"]
)
def test_fullgraph_matches_eager(results, name):
    """``torch.compile(model, fullgraph=True)`` after ``set_fullgraph_compile()``
    with spmd_types parameters (type checking off): the unsharded parameters are
    plain, and each gradient is read in its backward types and brought to the
    storage placements in the backward graph, as eager does (``scale``'s
    ``Partial`` on tp summed there). Losses, the sharded gradients and the
    trained parameters equal eager fsdp-rs's bit for bit; no recompiles. With
    bf16 parameters and TP, where torch 2.15's FSDP2 sums that partial gradient
    in the fp32 reduce dtype, set_fullgraph_compile refuses."""
    for rank, r in each_rank(SCENARIOS, results, name):
        if name == "fullgraph_tp_bf16":
            assert "reduced over tensor parallelism" in r.get("refused", ""), (rank, r)
            continue
        assert "refused" not in r, (rank, r.get("refused"))
        assert r["compiled"] == r["eager"], rank
        assert all(g is not None for g in r["compiled"]["grads"].values()), rank
        first_step, total = r["dynamo_graphs"]
        assert total == first_step >= 1, r["dynamo_graphs"]
