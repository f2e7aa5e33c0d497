"""``auto_shard``: the groups the planner chooses ([Note: Module grouping],
[Note: Grouping units]) and training bit for bit as the same ``fully_shard``
calls written by hand (``auto_shard_scenarios.py``, spawned gloo ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_rs
from auto_shard_scenarios import SCENARIOS, run
from fsdp_rs import MixedPrecisionPolicy, auto_shard, auto_shard_groups, fully_shard
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run, world_sizes=(2,))

BLOCK_BYTES = (16 * 16 + 3 * 16) * 4  # Linear(16, 16) + LayerNorm(16), fp32


@pytest.fixture
def fake_pg_2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _blocks(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(n)])


def _names(model: nn.Module, groups: list[list[nn.Module]]) -> list[list[str]]:
    names = {id(m): n for n, m in model.named_modules()}
    return [[names[id(m)] for m in g] for g in groups]


def test_consecutive_blocks_merge_up_to_the_budget() -> None:
    model = _blocks(7)
    groups = auto_shard_groups(model, group_bytes=3 * BLOCK_BYTES)
    assert _names(model, groups) == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert len(auto_shard_groups(model, group_bytes=BLOCK_BYTES)) == 7
    assert len(auto_shard_groups(model, group_bytes=10**9)) == 1


def test_a_module_over_the_budget_is_split_into_its_children() -> None:
    """A block larger than the budget: its Linear and its LayerNorm are units,
    each alone where its neighbour does not fit beside it; with room for the
    whole block it is one unit."""
    model = nn.Sequential(_blocks(1), nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)))
    big = (64 * 64 + 64) * 4
    groups = auto_shard_groups(model, group_bytes=big)
    assert _names(model, groups) == [["0"], ["1.0"], ["1.1"]]
    groups = auto_shard_groups(model, group_bytes=big + 2 * 64 * 4)
    assert _names(model, groups) == [["0"], ["1"]]


def test_a_leaf_over_the_budget_is_a_group_of_its_own() -> None:
    """An nn.Linear larger than the budget has nothing smaller to split into:
    it gets a group alone, not the root's."""
    model = nn.Sequential(nn.Linear(64, 64), *_blocks(5))
    groups = auto_shard_groups(model, group_bytes=2 * BLOCK_BYTES)
    assert _names(model, groups) == [["0"], ["1", "2"], ["3", "4"], ["5"]]


def test_containers_are_not_units() -> None:
    """A ModuleList has no forward: its elements are the units."""
    model = nn.Module()
    model.layers = nn.ModuleList(_blocks(4))
    groups = auto_shard_groups(model, group_bytes=2 * BLOCK_BYTES)
    assert _names(model, groups) == [["layers.0", "layers.1"], ["layers.2", "layers.3"]]


def test_param_dtype_counts_the_unsharded_bytes() -> None:
    model = _blocks(4)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert len(auto_shard_groups(model, group_bytes=2 * BLOCK_BYTES)) == 2
    assert len(auto_shard_groups(model, group_bytes=2 * BLOCK_BYTES, mp_policy=bf16)) == 1


def test_ignored_parameters_are_not_counted() -> None:
    model = _blocks(2)
    ignored = set(model[0].parameters())
    groups = auto_shard_groups(model, group_bytes=BLOCK_BYTES, ignored_params=ignored)
    assert _names(model, groups) == [["1"]]


def test_example_inputs_order_the_units_as_the_forward_calls_them() -> None:
    class Reversed(nn.Sequential):
        def forward(self, x):
            for block in reversed(self):
                x = block(x)
            return x

    model = Reversed(*_blocks(4))
    before = [p.clone() for p in model.parameters()]
    groups = auto_shard_groups(
        model, group_bytes=2 * BLOCK_BYTES, example_inputs=(torch.zeros(1, 16),)
    )
    assert _names(model, groups) == [["3", "2"], ["1", "0"]]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not any(p.grad is not None for p in model.parameters())


def test_user_sharded_modules_keep_their_groups(fake_pg_2) -> None:
    """A module already passed to fully_shard is a boundary: no group spans it."""
    model = _blocks(5)
    fully_shard(model[2])
    groups = auto_shard_groups(model, group_bytes=10**9)
    assert _names(model, groups) == [["0", "1"], ["3", "4"]]
    auto_shard(model, group_bytes=10**9)
    assert isinstance(model, fsdp_rs.FSDPModule)
    assert all(isinstance(m, fsdp_rs.FSDPModule) for m in (model[0], model[1], model[3]))
    # one group per call: the listed modules share one state
    model(torch.randn(3, 16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_example_inputs_with_user_sharded_modules_raise(fake_pg_2) -> None:
    """A recording forward would make the sharded module a root of its own."""
    model = _blocks(3)
    fully_shard(model[1])
    with pytest.raises(ValueError, match="example_inputs cannot order a model"):
        auto_shard(model, example_inputs=(torch.zeros(1, 16),))
    assert not isinstance(model[0], fsdp_rs.FSDPModule)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_bytes": 0}, ValueError, "group_bytes must be >= 1, got 0"),
        ({"group_bytes": -5}, ValueError, "group_bytes must be >= 1"),
        ({"group_bytes": "1MB"}, TypeError, "group_bytes must be an int"),
        ({"group_bytes": True}, TypeError, "group_bytes must be an int"),
        ({"group_bytes": 1.5e6}, TypeError, "group_bytes must be an int"),
        ({"example_inputs": torch.zeros(1, 16)}, TypeError, "example_inputs must be a tuple"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        auto_shard_groups(_blocks(2), **kwargs)


def test_not_a_module_or_already_sharded(fake_pg_2) -> None:
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        auto_shard([nn.Linear(2, 2)])
    model = _blocks(2)
    fully_shard(model)
    with pytest.raises(ValueError, match="already passed to fully_shard"):
        auto_shard(model)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_trains_bit_for_bit_as_the_same_grouping_by_hand(results, name) -> None:
    for rank, r in each_rank(SCENARIOS, results, name):
        assert r["losses_equal"], (rank, r["losses"])
        assert r["params_equal"], rank
        # two blocks a group; the head joins the last one
        assert r["sizes"] == [2, 2, 2, 2, 2, 3], (rank, r["sizes"])
        if name == "registration":
            assert r["first"][:2] == ["blocks.0", "blocks.2"], r["first"]
        else:  # forward order: the last block runs first
            assert r["first"][:2] == ["blocks.11", "blocks.9"], r["first"]
