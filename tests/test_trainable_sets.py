"""Ranks that train different parameters stop with one error before any rank
reduces ([Note: One trainable set on every rank]); ranks that change
``requires_grad`` alike train on (``trainable_set_scenarios.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from spawned import each_rank, results_fixture
from trainable_set_scenarios import SCENARIOS, run

results = results_fixture(SCENARIOS, run)


def _named(name: str, rank: int, world_size: int) -> str:
    """What rank ``rank``'s error must name: the parameter, with each rank's
    value over the process group that differs (with replicas, the rank's
    replicate group: it and its peer in the other replica)."""
    if name == "replicas":
        first = rank % (world_size // 2)
        return f"0.weight is rank {first}: True, rank {first + world_size // 2}: False"
    frozen = {"per_rank": lambda r: r % 2 == 0, "one_rank": lambda r: r == 0}[name]
    return "0.weight is " + ", ".join(f"rank {r}: {not frozen(r)}" for r in range(world_size))


@pytest.mark.parametrize("name", ["per_rank", "one_rank", "replicas"])
def test_differing_trainable_sets_raise_on_every_rank(results, name):
    """Every rank raises, naming the parameter, and no rank stepped: the
    reduce-scatters that would have mixed the gradients (equal sizes) or not
    matched (gloo aborts the process) never ran."""
    world_size = results[0]
    for rank, r in each_rank(SCENARIOS, results, name):
        raised = r["raised"]
        assert raised is not None, f"rank {rank} trained on"
        assert "the ranks train different parameters" in raised, raised
        assert f"requires_grad of {_named(name, rank, world_size)}." in raised, raised
        assert "Set requires_grad the same way on every rank" in raised, raised
        assert not any(r["moved"]), (rank, r["moved"])
        assert not any(r["grads"]), (rank, r["grads"])


def test_the_same_change_on_every_rank_trains_on(results):
    """The check passes where the ranks froze alike: the frozen weight does not
    move, the others step, on every rank."""
    for rank, r in each_rank(SCENARIOS, results, "every_rank"):
        assert r["raised"] is None, (rank, r["raised"])
        assert r["moved"] == [False, True, True, True, True, True], (rank, r["moved"])
