"""Misuse that torch FSDP2 lets pass silently, caught by fsdp-rs (issue 53):
every rank raises the same message, naming the problem and the fix; where
fsdp-rs trains instead (a backward that raised, complex parameters), bit for
bit as FSDP2. Scenarios in ``misuse_scenarios.py``, all in one spawn of two
gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from misuse_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run, world_sizes=(2,))


def _each_rank(results, name: str):
    return each_rank(SCENARIOS, results, name)


def _same_on_every_rank(results, name: str) -> dict:
    """The scenario's result, the same on every rank (errors included)."""
    seen = [r for _, r in _each_rank(results, name)]
    assert all(r == seen[0] for r in seen), f"{name}: the ranks differ: {seen}"
    return seen[0]


def test_optimizer_built_before_fully_shard_raises(results):
    r = _same_on_every_rank(results, "optimizer_before_shard")
    for kind in ("adamw", "flat"):
        first = r[f"{kind}_first"]
        assert first is not None and first.startswith("RuntimeError"), (kind, first)
        for words in (
            "param_groups[0]['params'][0] is parameter weight (shape (32, 16))",
            "fully_shard replaced",
            "build the optimizer after fully_shard",
        ):
            assert words in first, (kind, words, first)
        assert r[f"{kind}_second"] == first  # not marked checked: raises at every step
        assert r[f"{kind}_unchanged"]
    assert r["after"] is None and r["after_changed"] and r["after_marked"]
    assert r["unrelated"] is None


@pytest.mark.parametrize("how", ["twice", "hook"])
def test_backward_that_raised_then_normal_steps(results, how):
    """No ``reset_iter_state()``: the next forward starts clean, and the steps
    after it train bit for bit as FSDP2 without the error."""
    for rank, r in _each_rank(results, f"aborted_backward_{how}"):
        rs, ref = r["rs"], r["torch"]
        assert rs["raised"] is not None, rank
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ from FSDP2"
        assert rs["grads"] == ref["grads"], f"rank {rank}: gradients differ from FSDP2"
        assert rs["params"] == ref["params"], f"rank {rank}: parameters differ from FSDP2"


# what each call was given: (the argument's name, the type's name)
WRONG_TYPES = {
    "set_requires_gradient_sync": ("requires_gradient_sync", "str"),
    "set_requires_gradient_sync_recurse": ("recurse", "NoneType"),
    "set_requires_all_reduce": ("requires_all_reduce", "int"),
    "set_reshard_after_forward": ("reshard_after_forward", "int"),
    "set_reshard_after_backward": ("reshard_after_backward", "str"),
    "set_is_last_backward": ("is_last_backward", "int"),
    "set_unshard_in_backward": ("unshard_in_backward", "NoneType"),
    "set_force_sum_reduction_for_comms": ("enable", "int"),
    "set_reduce_scatter_unused_params": ("reduce_scatter_unused_params", "str"),
    "set_separate_reduce_scatter_group": ("enable", "str"),
    "set_allocate_memory_from_process_group_for_comm": ("enable", "int"),
    "set_gradient_divide_factor": ("factor", "str"),
    "set_reduce_scatter_max_input_buffers": ("max_input_buffers", "float"),
    "set_keep_unsharded_storage": ("keep", "int"),
    "set_manual_backward_finalization": ("enabled", "int"),
    "fully_shard_reshard_after_forward": ("reshard_after_forward", "str"),
    "fully_shard_reshard_after_forward_float": ("reshard_after_forward", "float"),
    "fully_shard_mp_policy": ("mp_policy", "dtype"),
    "fully_shard_offload_policy": ("offload_policy", "str"),
    "fully_shard_pin_memory": ("pin_memory", "str"),
    "fully_shard_cast_forward_inputs": ("cast_forward_inputs", "int"),
}


def test_arguments_of_the_wrong_type_raise_type_error(results):
    r = _same_on_every_rank(results, "argument_types")
    assert set(r["errors"]) == set(WRONG_TYPES)
    for call, (name, type_name) in WRONG_TYPES.items():
        error = r["errors"][call]
        assert error is not None, f"{call} accepted a {type_name}"
        assert error.startswith(("TypeError", "FSDPArgumentTypeError")), (call, error)
        assert name in error and type_name in error, (call, error)
    assert r["accepted"] is None, r["accepted"]


def test_mixed_precision_dtypes_checked_at_fully_shard(results):
    r = _same_on_every_rank(results, "policy_dtypes")
    fields = {
        "param_int64": ("param_dtype", "torch.int64"),
        "param_str": ("param_dtype", "'bfloat16'"),
        "param_complex": ("param_dtype", "torch.complex64"),
        "reduce_int32": ("reduce_dtype", "torch.int32"),
        "reduce_bool": ("reduce_dtype", "torch.bool"),
        "output_int8": ("output_dtype", "torch.int8"),
        "reduce_real_for_complex": ("reduce_dtype", "scale (torch.complex64)"),
    }
    for case, (field, given) in fields.items():
        error = r[case]
        assert error is not None and error.startswith("TypeError"), (case, error)
        assert f"mp_policy.{field}" in error and given in error, (case, error)
    assert r["accepted"] is None, r["accepted"]


@pytest.mark.parametrize(
    "name", ["complex", "complex_accumulate", "complex_divide_factor", "complex128"]
)
def test_complex_parameters_train_as_fsdp2(results, name):
    for rank, r in _each_rank(results, name):
        rs, ref = r["rs"], r["torch"]
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ from FSDP2"
        assert rs["grads"] == ref["grads"], f"rank {rank}: gradients differ from FSDP2"
        assert rs["params"] == ref["params"], f"rank {rank}: parameters differ from FSDP2"


def test_complex_and_real_trainable_parameters_in_one_group_raise(results):
    r = _same_on_every_rank(results, "complex_with_real")
    assert r["torch"] is not None and "uniform original parameter dtype" in r["torch"]
    error = r["rs"]
    assert error is not None, "fsdp-rs accepted complex and real trainable parameters"
    for words in ("rot", "real.weight", "torch.complex64", "torch.float32", "fully_shard"):
        assert words in error, (words, error)
    assert r["rs_frozen"] is None and r["torch_frozen"] is None


def test_root_sharded_before_its_child(results):
    error = _same_on_every_rank(results, "root_first")["message"]
    assert error is not None
    assert "FSDPMeshError" not in error and "init_device_mesh" not in error, error
    for words in ("already", "bottom-up", "children first"):
        assert words in error, (words, error)
