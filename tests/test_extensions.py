"""All-gather extensions (``extension_scenarios.py``): training with them is
bit for bit torch FSDP2's, the hooks get FSDP2's arguments (the shard mesh,
the full size, the owning module), and misuse is refused on every rank. All
scenarios of one world size run in one spawn of gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from extension_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


def _each_rank(results, name: str):
    return each_rank(SCENARIOS, results, name)


def _assert_same(rank: int, rs: dict, ref: dict) -> None:
    for key in ref:
        if isinstance(ref[key], dict):
            for name in ref[key]:
                assert rs[key][name] == ref[key][name], f"rank {rank}: {key} of {name} differ"
        else:
            assert rs[key] == ref[key], f"rank {rank}: {key} differs from torch FSDP2"


@pytest.mark.parametrize(
    "name",
    [
        "pair_v1",
        "pair_v1_keep",
        "pair_v2",
        "pair_v2_bf16",
        "bf16",
        "bf16_keep",
        "bf16_offload",
        "bf16_accumulate",
        "bf16_freeze",
        "bf16_inference",
        "pair_v2_inference",
    ],
)
def test_subclass_training_matches_fsdp2(results, name):
    """Losses, local shards (both components of a pair) and sharded gradients
    equal FSDP2's bit for bit; the local shards keep the subclass."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["local_types"] != ["Tensor"]


def test_pre_all_gather_arguments(results):
    """The five-argument pre-all-gather gets the 1-D shard mesh, the full size
    and the Linear that registers the weight, as from FSDP2."""
    for rank, r in _each_rank(results, "pair_v2"):
        seen = r["rs"]["seen"]
        assert seen and seen == r["torch"]["seen"], rank
        assert {ndim for ndim, _, _ in seen} == {1}
        assert {module for _, _, module in seen} == {"Linear"}


@pytest.mark.parametrize("name", ["patched", "patched_hsdp"])
def test_methods_set_on_local_shards(results, name):
    """Methods set on the plain local shards after ``to_empty`` run (found at
    lazy init) and train as FSDP2; under HSDP they see the 1-D shard mesh."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["called"]
        world_size = results[0]
        shard_size = world_size // 2 if name == "patched_hsdp" else world_size
        assert r["rs"]["mesh"] == [[1, shard_size]]


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("one_sided", "ValueError", "fsdp_post_all_gather"),
        ("bad_arity", "TypeError", "fsdp_pre_all_gather(mesh, outer_size"),
        ("patched_on_one_rank", "PlanMismatchError", "some ranks only"),
    ],
)
def test_misuse_is_refused_on_every_rank(results, name, error, words):
    for _, r in _each_rank(results, name):
        assert r["error_type"] == error
        assert words in r["message"]
        assert "head" in r["message"]


@pytest.mark.parametrize(
    "name",
    [
        "fullgraph_bf16",
        "fullgraph_bf16_keep",
        "fullgraph_bf16_offload",
        "fullgraph_bf16_frozen",
        "fullgraph_bf16_hsdp",
        "fullgraph_pair",
        "fullgraph_pair_bf16",
    ],
)
def test_fullgraph_matches_eager(results, name):
    """``torch.compile(model, fullgraph=True)`` after ``set_fullgraph_compile()``
    traces the extensions ([Note: Extensions under trace]): losses, every
    local shard and sharded gradient equal eager fsdp-rs's bit for bit, and
    the graphs AOT autograd compiled hold each group's all-gather in forward
    and its reduce-scatter in backward, and the all-gather again there for the
    blocks' groups where they reshard after forward: their weights, and
    their biases (plain groups of their own, which the backward does not
    read) with them, as FSDP2's backward gathers a module ([Note: Regathered
    on every rank]); the head's, the root's, is kept. Frozen weights
    (``_frozen``) get no gradient, as in eager."""
    biases = 0 if name.startswith("fullgraph_pair") else 2  # the bf16 model has biases
    groups = 3 + biases  # the head's weight and each block's weights, then biases
    for rank, r in _each_rank(results, name):
        assert "refused" not in r, (rank, r.get("refused"))
        assert r["compiled"] == r["eager"], rank
        first_step, total = r["dynamo_graphs"]
        assert total == first_step >= 1, r["dynamo_graphs"]  # no recompiles
        grads = r["compiled"]["grads"]
        frozen = {n for n in grads if name.endswith("frozen") and n.endswith("lin1.weight")}
        assert r["eager"]["losses"] and frozen == {n for n, g in grads.items() if g is None}
        forward = [op for g in r["graphs"] if g["kind"] == "forward" for op in g["ops"]]
        backward = [op for g in r["graphs"] if g["kind"] == "backward" for op in g["ops"]]
        assert sum("all_gather_into_tensor" in op for op in forward) == groups, forward
        # the extension groups gather without the copy-out: the plain ones only
        assert sum("unshard_copy_out" in op for op in forward) == biases, forward
        assert sum("reduce_scatter_tensor" in op for op in backward) == groups, backward
        regathers = sum("all_gather_into_tensor" in op for op in backward)
        assert regathers == (0 if name.endswith("keep") else 2 + biases), backward


def test_fullgraph_inductor_matches_eager(results):
    """The bf16-gathered weights compiled whole by inductor: losses, shards and
    gradients equal eager's within inductor's usual rounding (compile_scenarios'
    fp32 tolerance), no recompiles."""
    from compile_scenarios import INDUCTOR_TOLERANCE

    tol = INDUCTOR_TOLERANCE[False]
    for rank, r in _each_rank(results, "fullgraph_bf16_inductor"):
        assert "refused" not in r, (rank, r.get("refused"))
        first_step, total = r["dynamo_graphs"]
        assert total == first_step >= 1, r["dynamo_graphs"]
        compiled, eager = r["compiled"], r["eager"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], **tol)
        for key in ("params", "grads"):
            for name, value in eager[key].items():
                actual = torch.tensor(compiled[key][name])
                torch.testing.assert_close(actual, torch.tensor(value), **tol)


def test_fullgraph_refuses_an_extension_it_would_lose(results):
    """``PairV1`` is rebuilt as a ``TwoTensor`` from its inner tensors (the
    ``__tensor_unflatten__`` it inherits), which would drop its extension under
    torch.compile: ``set_fullgraph_compile`` says so, on every rank."""
    for rank, r in _each_rank(results, "fullgraph_pair_v1"):
        assert "PairV1.__tensor_unflatten__" in r.get("refused", ""), (rank, r)
        assert "makes a TwoTensor" in r["refused"], rank
