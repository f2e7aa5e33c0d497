"""Gradients present on some ranks only ([Note: Gradient agreement]): every rank
ends a backward with the same ``.grad`` state, holding all ranks' contributions,
trained against an unsharded reference and DDP(find_unused_parameters=True).
Scenarios in ``partial_grad_scenarios.py``; all of one world size run in one spawn.

Tolerances: the reference sums the ranks' gradients in another order than the
reduce-scatter (and, in bf16, rounds each rank's gradient before the cast as
FSDP2 does), so gradients agree to fp32 rounding of values of order 1 (1e-6);
AdamW divides by the gradients' running RMS, which turns such rounding in
gradients near zero into parameter differences up to a small part of its step
(lr = 1e-2), hence 1e-4 on parameters after 5 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from partial_grad_scenarios import EXPERTS, SCENARIOS, STEPS, UNUSED, worker
from spawned import read_ranks, spawn_scenarios

WORLD_SIZES = (2, 4)
GRAD_TOL = {"fp32": 1e-6, "bf16": 1e-6}
PARAM_TOL = 1e-4


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    names = [n for n, s in SCENARIOS.items() if s.get("min_world", 2) <= world_size]
    out = tmp_path_factory.mktemp(f"w{world_size}")
    failure = None
    try:
        spawn_scenarios(worker, world_size, names, out)
    except Exception as e:  # a rank raised: its JSON names the scenario
        failure = e
    return world_size, read_ranks(out, world_size), failure


def _result(results, name: str, rank: int) -> dict:
    _, per_rank, failure = results
    result = per_rank[rank].get(name)
    assert result is not None, f"rank {rank}: scenario {name} did not run ({failure})"
    assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return result


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_partial_gradients_match_reference(results, name):
    world_size = results[0]
    spec = SCENARIOS[name]
    if spec.get("min_world", 2) > world_size:
        pytest.skip(f"needs world size >= {spec['min_world']}")
    first = _result(results, name, 0)
    for rank in range(world_size):
        r = _result(results, name, rank)
        # the .grad state is the same on every rank, and the reference's
        assert r["no_grad"] == first["no_grad"], f"rank {rank}: .grad None on other params"
        assert r["no_grad"] == r["ref_no_grad"], f"rank {rank}: .grad None differs from ref"
        tol = GRAD_TOL["bf16" if spec.get("mp") else "fp32"]
        assert max(r["grad_diff"]) <= tol, f"rank {rank}: gradients differ {r['grad_diff']}"
        assert r["param_diff"] <= PARAM_TOL, f"rank {rank}: parameters differ {r['param_diff']}"
        if spec.get("ddp"):
            assert r["no_grad"] == r["ddp_no_grad"]
            assert max(r["ddp_grad_diff"]) <= tol, r["ddp_grad_diff"]
            assert r["ddp_param_diff"] <= PARAM_TOL, r["ddp_param_diff"]


def test_unused_everywhere_expert(results):
    """The expert no rank routes to: no .grad anywhere, every step, and AdamW
    (weight decay included) leaves it bit for bit as it was."""
    world_size = results[0]
    for rank in range(world_size):
        r = _result(results, "fp32", rank)
        assert len(r["no_grad"]) == STEPS
        for missing in r["no_grad"]:
            unused = {n for n in missing if f"experts.{UNUSED}." in n}
            assert len(unused) == 2 * 2 * 2, missing  # 2 layers x 2 linears x (w, b)
            # every other expert got a gradient somewhere (expert 3 on one rank)
            assert all(f"experts.{UNUSED}." in n for n in missing), missing
        assert r["unused_unchanged"] == [True] * 8
    assert UNUSED == EXPERTS - 1
