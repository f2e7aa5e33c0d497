"""The cross-rank plan check ([Note: Cross-rank plan check]): models that differ
between ranks raise one clear RuntimeError on every rank at the root's first
forward, naming the module and parameter and each rank's value, instead of
aborting in gloo or hanging; matching models pass with one collective per root
and mesh dim, once.

Spawned gloo ranks (W = 2 and 4), every spawn bounded by a timeout so that a
regression (an abort or a hang, what happens without the check) fails rather
than stalls; the fake process group and single-rank meshes in process."""

from __future__ import annotations

import datetime
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_rs.planning import plan_group, shapes_to_arrays
from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy
from fsdp_rs.runtime.checks import plan_check

sys.path.insert(0, str(Path(__file__).parent))
from plan_check_scenarios import Collectives, first_forward_collectives, mlp, shard, worker
from spawned import read_ranks, spawn_scenarios

TIMEOUT_S = 300  # start-up of the ranks dominates; a hang must not stall CI

W2 = [
    "matching@flat",
    "shard_dim@flat",
    "width@flat",
    "order@flat",
    "dtype@flat",
    "requires_grad@flat",
    "reshard@flat",
    "mixed_precision@flat",
    "grad_dtype@flat",
    "offload@flat",
    "ignored@flat",
    "other_mesh@flat",
    "wrapped_on_one_rank@flat",
    "paramless_on_one_rank@flat",
    "wrapped_after_forward@flat",
    "off_switch@flat",
    "matching@hsdp_replicate",
    "width@hsdp_replicate",
    "matching@hsdp_shard",
    "width@hsdp_shard",
]
W4 = ["matching@flat", "width@flat", "matching@hsdp_2d", "width@hsdp_2d", "order@hsdp_2d"]


def _spawn(tmp_path_factory, world_size: int, names: list[str]) -> list[dict]:
    out = tmp_path_factory.mktemp(f"plan_check_w{world_size}")
    spawn_scenarios(worker, world_size, names, out, timeout_s=TIMEOUT_S)
    return read_ranks(out, world_size)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return _spawn(tmp_path_factory, 2, W2)


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return _spawn(tmp_path_factory, 4, W4)


def _raised(per_rank: list[dict], name: str, *expected: str) -> str:
    """Every rank raised the same RuntimeError, which contains ``expected``."""
    results = [r[name] for r in per_rank]
    for rank, result in enumerate(results):
        assert "error" in result, f"rank {rank} raised nothing: {result}"
        assert result["runtime_error"], f"rank {rank}:\n{result['traceback']}"
    messages = {r["message"] for r in results}
    assert len(messages) == 1, f"the ranks raised different errors: {messages}"
    message = messages.pop()
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"
    assert plan_check.ENV_VAR in message
    return message


def _ok(per_rank: list[dict], name: str) -> list:
    for rank, r in enumerate(per_rank):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['traceback']}"
    return [r[name]["result"] for r in per_rank]


# ------------------------------------------------------------------ W = 2


def test_matching_models_pass_with_one_collective(w2):
    for result in _ok(w2, "matching@flat"):
        assert result["extra_first"] == 1  # the check: one all-gather, at the first forward
        # per step, the trainable-set check's all-reduce, before the first
        # reduce-scatter ([Note: One trainable set on every rank])
        assert result["extra_later"] == 1 and result["later"] > 1


def test_layer_width(w2):
    _raised(
        w2,
        "width@flat",
        "fully_shard module '0', parameter '0.weight'",
        "rank 0: shape (16, 8), dtype torch.float32, requires_grad=True",
        "rank 1: shape (24, 8), dtype torch.float32, requires_grad=True",
    )


def test_parameter_order(w2):
    _raised(
        w2,
        "order@flat",
        "fully_shard module '0', parameter '0.weight'",
        "registered in another order",
        "rank 0: 0.weight",
        "rank 1: 0.bias",
    )


def test_dtype(w2):
    _raised(
        w2,
        "dtype@flat",
        "parameter '0.weight'",
        "rank 0: shape (16, 8), dtype torch.float32",
        "rank 1: shape (16, 8), dtype torch.float64",
    )


def test_requires_grad(w2):
    _raised(
        w2,
        "requires_grad@flat",
        "parameter '0.weight'",
        "rank 0: shape (16, 8), dtype torch.float32, requires_grad=True",
        "rank 1: shape (16, 8), dtype torch.float32, requires_grad=False",
    )


def test_reshard_after_forward(w2):
    _raised(
        w2,
        "reshard@flat",
        "fully_shard module '0' (parameters '0.weight', '0.bias'), reshard_after_forward:",
        "rank 0: True",
        "rank 1: False",
    )


def test_mixed_precision(w2):
    # The root has no parameters of its own: the first group that differs is layer 0's.
    _raised(
        w2,
        "mixed_precision@flat",
        "fully_shard module '0' (parameters '0.weight', '0.bias'), mp_policy:",
        "rank 0: param_dtype=None",
        "rank 1: param_dtype=torch.bfloat16",
    )


def test_grad_dtype(w2):
    """[Note: Gradient dtype policy]: one rank's weight keeps fp32 gradients;
    the report says which dtypes each rank's groups reduce and keep in."""
    if not fsdp2_has_grad_dtype_policy():
        pytest.skip("this torch's FSDP2 keeps no per-parameter grad_dtype")
    _raised(
        w2,
        "grad_dtype@flat",
        "fully_shard module '0' (parameters '0.weight', '0.bias'), dtypes:",
        "rank 0: torch.bfloat16 (all-gather torch.bfloat16, reduce torch.bfloat16)\n",
        "rank 1: torch.bfloat16 (all-gather torch.bfloat16, reduce torch.float32, gradients "
        "torch.float32) | torch.bfloat16 (all-gather torch.bfloat16, reduce torch.float32)",
    )


def test_offload(w2):
    _raised(
        w2,
        "offload@flat",
        "fully_shard module '0' (parameters '0.weight', '0.bias'), offload_policy:",
        "rank 0: none",
        "rank 1: CPUOffloadPolicy(pin_memory=False)",
    )


def test_ignored_params(w2):
    _raised(
        w2,
        "ignored@flat",
        "fully_shard module '2', parameter '2.bias'",
        "rank 0: shape (4,), dtype torch.float32, requires_grad=True",
        "rank 1: not in this group",
    )


def test_mesh(w2):
    _raised(
        w2,
        "other_mesh@flat",
        "fully_shard module '0' (parameters '0.weight', '0.bias'), mesh:",
        "rank 0: cpu mesh of shape (2,)",
        "rank 1: cpu mesh of shape (1, 2), dims ('replicate', 'shard')",
    )


def test_module_wrapped_on_one_rank(w2):
    _raised(
        w2,
        "wrapped_on_one_rank@flat",
        "the root fully_shard module, parameter '0.weight'",
        "rank 0: not in this group",
        "rank 1: shape (16, 8)",
        "fully_shard module '0' is one on rank 0 only",
    )


def test_module_without_parameters_wrapped_on_one_rank(w2):
    # Root, '0', then the third state: '1' (the ReLU) on rank 0, '2' on rank 1.
    _raised(
        w2,
        "paramless_on_one_rank@flat",
        "the fully_shard module at position 2 under the root:",
        "rank 0: fully_shard module '1'",
        "rank 1: fully_shard module '2'",
        "fully_shard module '1' is one on rank 0 only",
    )


def test_module_wrapped_after_first_forward(w2):
    # The head is a root of its own at its first forward: its fqns are its own.
    _raised(
        w2,
        "wrapped_after_forward@flat",
        "the root fully_shard module, parameter 'weight'",
        "rank 0: shape (2, 4)",
        "rank 1: shape (3, 4)",
    )


def test_shard_dim(w2):
    """Parameters sharded on another dim are planned as (W, numel / W) rows,
    the same whatever the dim: the check compares the dims and full shapes."""
    _raised(
        w2,
        "shard_dim@flat",
        "shard_placement_fn",
        "rank 0: w: Shard(1) of (4, 8, 8)",
        "rank 1: w: Shard(2) of (4, 8, 8)",
    )


def test_off_switch(w2):
    for result in _ok(w2, "off_switch@flat"):
        assert "error" not in result["0"], result["0"]
        assert "requires_grad=False" in result["1"]["error"]
    # Off, the mismatched forward issues its all-gathers only (no check).
    assert [r["0"]["collectives"] for r in _ok(w2, "off_switch@flat")] == [2, 2]


def test_error_persists_when_retried(w2):
    # width() runs its forward twice and re-raises when both raised alike.
    _raised(w2, "width@flat", "parameter '0.weight'")


@pytest.mark.parametrize("mesh", ["hsdp_replicate", "hsdp_shard"])
def test_hsdp(w2, mesh):
    for result in _ok(w2, f"matching@{mesh}"):
        # one mesh dim of two ranks: one all-gather, then one all-reduce per step
        assert result["extra_first"] == 1 and result["extra_later"] == 1
    _raised(
        w2,
        f"width@{mesh}",
        "parameter '0.weight'",
        "rank 0: shape (16, 8)",
        "rank 1: shape (24, 8)",
    )


# ------------------------------------------------------------------ W = 4


def test_w4_one_rank_differs(w4):
    _raised(
        w4,
        "width@flat",
        "parameter '0.weight'",
        "ranks 0-2: shape (16, 8)",
        "rank 3: shape (24, 8)",
    )


def test_w4_hsdp_2x2(w4):
    for result in _ok(w4, "matching@hsdp_2d"):
        assert result["extra_first"] == 2  # one all-gather per mesh dim
        assert result["extra_later"] == 2  # one all-reduce per mesh dim per step
    # Rank 3 differs: it shares no shard group with rank 0, yet all four raise.
    _raised(w4, "width@hsdp_2d", "ranks 0-2: shape (16, 8)", "rank 3: shape (24, 8)")
    _raised(w4, "order@hsdp_2d", "ranks 0, 2-3: 0.weight", "rank 1: 0.bias")


def test_w4_matching(w4):
    for result in _ok(w4, "matching@flat"):
        assert result["extra_first"] == 1 and result["extra_later"] == 1


# ------------------------------------------------------------------ in process


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake2():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.fixture
def gloo1():
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    yield
    dist.destroy_process_group()


def _cpu_mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def test_fake_process_group_is_not_checked(fake2):
    # The fake group's all-gather returns no other rank's data: no check, no
    # collective, no false alarm.
    mesh = _cpu_mesh(2)
    checked, unchecked = mlp(), mlp()
    shard(checked, mesh)
    shard(unchecked, mesh)
    assert first_forward_collectives(checked, check=True) == first_forward_collectives(
        unchecked, check=False
    )
    assert plan_check.enabled()


def test_single_rank_mesh_is_not_checked(gloo1):
    mesh = _cpu_mesh(1)
    checked, unchecked = mlp(), mlp()
    shard(checked, mesh)
    shard(unchecked, mesh)
    assert first_forward_collectives(checked, check=True) == first_forward_collectives(
        unchecked, check=False
    )


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)]
)
def test_env_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(plan_check.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(plan_check.ENV_VAR, value)
    assert plan_check.enabled() is on


def test_plan_fingerprint_is_rank_independent():
    ndims, dims = shapes_to_arrays([(17, 3), (5,), (0, 4), (3, 2, 2)])
    for world in (1, 2, 4, 8):
        prints = {plan_group(ndims, dims, world, r).fingerprint() for r in range(world)}
        assert len(prints) == 1
    base = plan_group(ndims, dims, 4, 0).fingerprint()
    assert plan_group(ndims, dims, 4, 0, param_elem_size=2).fingerprint() != base
    assert plan_group(ndims, dims, 2, 0).fingerprint() != base
    ndims2, dims2 = shapes_to_arrays([(18, 3), (5,), (0, 4), (3, 2, 2)])
    assert plan_group(ndims2, dims2, 4, 0).fingerprint() != base
    assert 0 <= base < 2**64


def test_ranks_text():
    assert plan_check._ranks_text([3]) == "rank 3"
    assert plan_check._ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_collectives_counter_counts_gloo_collectives(gloo1):
    with Collectives() as counted:
        dist.all_reduce(torch.ones(1))
    assert counted.count == 1
