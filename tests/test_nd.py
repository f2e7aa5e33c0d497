"""N-D parallelism (``nd_scenarios.py``): ``fully_shard`` over the DP dims of a
(dp, tp) or (dp_replicate, dp_shard, tp) mesh, on parameters that tensor
parallelism made DTensors, is bit for bit torch FSDP2's: the sharded
parameters' placements (``_StridedShard`` where TP and FSDP split one dim),
shapes and strides, their full values, the losses, gradient norms and sharded
gradients through training (with reshard_after_forward=False, bf16 parameters,
meta-device init, HSDP), DCP checkpoints across the two libraries, torch's SPMD
``dp_mesh_dims`` form, and the exception classes of misuse. All scenarios of
one world size run in one spawn of gloo ranks.

``ND_TEST_BOTH_TORCH=1`` runs torch FSDP2 on both sides (a check of the
scenarios' own determinism).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from nd_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


def _assert_same(rank: int, rs, ref, path: str = "") -> None:
    """``rs == ref``, naming the first key path where they differ."""
    if isinstance(ref, dict):
        assert isinstance(rs, dict) and rs.keys() == ref.keys(), f"rank {rank}: keys of {path}"
        for key in ref:
            _assert_same(rank, rs[key], ref[key], f"{path}.{key}" if path else key)
    else:
        assert rs == ref, f"rank {rank}: {path} differs from torch FSDP2: {rs} != {ref}"


def _assert_close(compiled: dict, eager: dict) -> None:
    """Losses, gradient norms and trained values within compile_scenarios'
    fp32 inductor tolerance."""
    from compile_scenarios import INDUCTOR_TOLERANCE

    tol = INDUCTOR_TOLERANCE[False]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(compiled[key], eager[key], **tol)
    for name, p in eager["params"].items():
        actual = torch.tensor(compiled["params"][name]["full"])
        torch.testing.assert_close(actual, torch.tensor(p["full"]), **tol)


def _assert_observed(rank: int, r: dict) -> None:
    """Not a vacuous comparison: losses, norms and every gradient observed."""
    assert r["losses"] and r["grad_norms"], rank
    assert all(g is not None and g["full"] for g in r["grads"].values()), rank
    assert all(p["full"] for p in r["params"].values()), rank


@pytest.mark.parametrize(
    "name",
    [
        "tp_mlp",
        "tp_mlp_keep",
        "tp_mlp_bf16",
        "tp_mlp_replicated_norm",
        "tp_meta_init",
        "hsdp_tp",
        "hsdp_tp_shard",
        "dp_only_2d_mesh_1_tp",
    ],
)
def test_tp_training_matches_fsdp2(results, name):
    """Sharded placements, shapes, strides and values, then losses, gradient
    norms, sharded gradients and trained values equal FSDP2's bit for bit."""
    for rank, r in each_rank(SCENARIOS, results, name):
        _assert_same(rank, r["rs"], r["torch"])
        _assert_observed(rank, r["rs"])


# scenario -> whether set_fullgraph_compile refuses it where torch's FSDP2 (torch
# >= 2.15) reduces a TP partial gradient of bf16 parameters in the reduce dtype
_FULLGRAPH = {
    "tp_fullgraph": False,
    "tp_fullgraph_bf16_replicated_norm": True,
    "spmd_fullgraph": False,
    "spmd_fullgraph_tp": False,
    "spmd_fullgraph_tp_bf16": True,
    "spmd_fullgraph_several": False,
    "spmd_fullgraph_replicated_batch": False,
    "spmd_fullgraph_hsdp": False,
    "spmd_fullgraph_inductor": False,
    "spmd_fullgraph_replicate_only": False,
}


@pytest.mark.parametrize("name", list(_FULLGRAPH))
def test_fullgraph_matches_eager(results, name):
    """``torch.compile(model, fullgraph=True)`` with traced hooks over TP
    parameters and over ``dp_mesh_dims`` ones ([Note: Traced hooks], [Note:
    DP dims under trace]): losses, gradient norms, the last step's sharded
    gradients and the trained parameters equal eager fsdp-rs's bit for bit.
    With ``dp_mesh_dims``, gradients autograd leaves ``Partial`` on the DP
    dims are summed once, by the reduce-scatter (an all-reduce there first
    would double the gradient norm), and those it leaves ``Replicate()`` (one
    batch on every rank) as they are, as eager sums them. Where torch's FSDP2
    reduces a TP partial gradient in the wider reduce dtype (torch >= 2.15,
    bf16 parameters), set_fullgraph_compile refuses. No recompiles after the
    first step."""
    from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy

    refuses = _FULLGRAPH[name] and fsdp2_has_grad_dtype_policy()
    for rank, r in each_rank(SCENARIOS, results, name):
        if refuses:
            assert "reduced over tensor parallelism" in r.get("refused", ""), (rank, r)
            continue
        assert "refused" not in r, (rank, r["refused"] if "refused" in r else None)
        if name.endswith("inductor"):  # within inductor's usual rounding (fp32)
            _assert_close(r["compiled"], r["eager"])
        else:
            _assert_same(rank, r["compiled"], r["eager"])
        _assert_observed(rank, r["compiled"])
        first_step, total = r["dynamo_graphs"]
        assert total == first_step >= 1, r["dynamo_graphs"]  # no recompiles


def test_meta_init_stays_on_meta(results):
    for rank, r in each_rank(SCENARIOS, results, "tp_meta_init"):
        assert r["rs"]["meta"] and r["torch"]["meta"], rank


def test_strided_placements(results):
    """Where TP and FSDP both shard dim 0, the placements are FSDP2's
    (``_StridedShard``) and ``full_tensor()`` is the original weight."""
    for rank, r in each_rank(SCENARIOS, results, "tp_strided"):
        _assert_same(rank, r["rs"], r["torch"])
        for name, p in r["rs"]["params"].items():
            assert p["is_original"], f"rank {rank}: {name}"
        if results[0] == 4:
            assert "_StridedShard" in r["torch"]["params"]["blocks.0.w1.weight"]["placements"]


def test_dcp_across_libraries(results):
    """A DCP checkpoint of either library loads into the other's model."""
    for rank, r in each_rank(SCENARIOS, results, "dcp_2d"):
        assert r == {
            "rs_to_torch_equal": True,
            "rs_to_torch_trains_equal": True,
            "torch_to_rs_equal": True,
            "torch_to_rs_trains_equal": True,
        }, rank


_REPLICATE_ONLY = [n for n in SCENARIOS if n.startswith("spmd_replicate_only")]


@pytest.mark.parametrize(
    "name",
    [
        "spmd_dp_mesh_dims",
        "spmd_dp_mesh_dims_tp",
        "spmd_several_shard_dims",
        "spmd_hsdp",
        *_REPLICATE_ONLY,
    ],
)
def test_spmd_dp_mesh_dims_matches_fsdp2(results, name):
    for rank, r in each_rank(SCENARIOS, results, name):
        _assert_same(rank, r["rs"], r["torch"])
        _assert_observed(rank, r["rs"])


@pytest.mark.parametrize("name", _REPLICATE_ONLY)
def test_replicate_only_keeps_replicas_equal(results, name):
    """``dp_mesh_dims`` naming replicate dims only ([Note: Replicate dims
    only]) trains as DDP: the ranks see different batches (different losses)
    and end with the same parameters, every one ``Replicate()`` on the DP dims."""
    ranks = [r for _, r in each_rank(SCENARIOS, results, name)]
    losses = {str(r["rs"]["losses"]) for r in ranks}
    params = {str(r["rs"]["params"]) for r in ranks}
    assert len(losses) > 1
    assert len(params) == 1, f"{name}: the replicas diverged"
    if name.endswith(("replicate_only", "_bf16", "_two_dims", "_custom_comms", "_reshard_int")):
        for p in ranks[0]["rs"]["sharded"].values():
            assert "Shard" not in p["placements"], p["placements"]


def test_clip_grad_norm_over_mixed_meshes(results):
    """fsdp-rs's ``clip_grad_norm_`` over gradients on two meshes: the norm of
    the full gradients (to fp32 rounding of a differently ordered sum) and
    every gradient scaled by the clip coefficient."""
    for rank, r in each_rank(SCENARIOS, results, "clip_mixed_meshes"):
        assert set(r["meshes"]) == {"('dp',)", "('dp', 'tp')"}, rank
        assert r["total"] == pytest.approx(r["expected"], rel=1e-5), rank
        assert r["total"] > 0.5  # clipping happened
        assert r["scaled_error"] < 1e-6, rank


def test_errors_match_fsdp2(results):
    """An exception that is an instance of FSDP2's class (by name) for a
    parameter on an unrelated mesh and for misuse of ``dp_mesh_dims``. (On an
    unrelated mesh FSDP2 fails inside ``DeviceMesh._concatenate`` with a
    TypeError or a RuntimeError; fsdp-rs raises a ValueError that is both.)"""
    for rank, r in each_rank(SCENARIOS, results, "errors"):
        assert all(r["torch"].values()), f"FSDP2 raised nothing in some case: {r['torch']}"
        for case, classes in r["torch"].items():
            raised = r["rs"][case]
            assert raised and classes[0] in raised, f"rank {rank}, {case}: {raised} vs {classes}"
