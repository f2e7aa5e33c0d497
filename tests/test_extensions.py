"""All-gather extensions (``extension_scenarios.py``): training with them is
bit for bit torch FSDP2's, the hooks get FSDP2's arguments (the shard mesh,
the full size, the owning module), and misuse is refused on every rank. All
scenarios of one world size run in one spawn of gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
