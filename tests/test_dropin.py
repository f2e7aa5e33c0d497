"""FSDP2 behaviours fsdp-rs reproduces bit for bit (``dropin_scenarios.py``):
post-accumulate-grad hooks (optimizer in backward) on every gradient path,
``model.to(dtype)`` after sharding, ``state_dict`` after a forward that kept
the parameters unsharded, ``load_state_dict(assign=True)`` keeping the objects
the optimizer holds, and ``param_dtype_override_fn``. All scenarios of one
world size run in one spawn of gloo ranks.

[Note: Gloo sums by buffer size]
At W >= 4, in which order gloo's reduce-scatter adds the ranks' values for an
element depends on the whole buffer's size, not only on the element. fsdp-rs
aligns each parameter's shard to 16 bytes in its rows, FSDP2 does not; where
the alignment adds gaps, the two reduce-scatters can round an element
differently (1 ulp). So these scenarios use shards of whole 16-byte units,
where both buffers have one size and the features are compared bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dropin_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


def _each_rank(results, name: str):
    return each_rank(SCENARIOS, results, name)


def _assert_same(rank: int, rs: dict, ref: dict, keys=None) -> None:
    for key in keys or ref:
        assert rs[key] == ref[key], f"rank {rank}: {key} differs from torch FSDP2"


@pytest.mark.parametrize("name", ["hook_counts", "hook_counts_hsdp"])
def test_post_accumulate_grad_hook_counts(results, name):
    """Once per parameter per reduction: none in a backward without sync (or
    without HSDP's all-reduce), once in the synced one, as FSDP2."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        first, unsynced, synced = r["rs"]["counts"]
        assert set(first.values()) == {1}
        assert unsynced == first
        assert set(synced.values()) == {2}


@pytest.mark.parametrize(
    "name",
    [
        "hook_optim",
        "hook_optim_offload",
        "hook_optim_bf16",
        "hook_optim_accumulate",
        "hook_optim_hsdp",
    ],
)
def test_optimizer_in_backward(results, name):
    """A per-parameter AdamW stepped in the hook trains bit for bit as FSDP2's,
    and as one AdamW stepped after backward."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        _assert_same(rank, r["rs"], r["rs_step"])


@pytest.mark.parametrize("name", ["to_float64", "to_float64_no_swap"])
def test_to_float64_after_fully_shard(results, name):
    for rank, r in _each_rank(results, name):
        rs = r["rs"]
        _assert_same(rank, rs, r["torch"])
        assert rs["param_dtypes"] == rs["local_dtypes"] == ["torch.float64"]
        assert rs["grad_dtypes"] == ["torch.float64"]
        assert rs["same_objects"]


def test_state_dict_after_forward_is_sharded(results):
    for rank, r in _each_rank(results, "state_dict_after_forward"):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["types"] == ["DTensor"]


def test_load_state_dict_assign_keeps_parameters(results):
    """accelerate's RAM-efficient loading: the optimizer's parameters train."""
    for rank, r in _each_rank(results, "load_assign"):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["trained"]
        assert r["rs"]["same_objects"]


def test_param_dtype_override_fn(results):
    for rank, r in _each_rank(results, "param_dtype_override"):
        assert r["rs"]["dtypes"] == {
            "lin1": ["torch.bfloat16", "torch.bfloat16"],
            "head": ["torch.float32", "torch.float32"],
        }
        if "torch" in r:  # torch >= 2.15 has the field
            _assert_same(rank, r["rs"], r["torch"])


def test_meta_init_with_empty_shards(results):
    """Built on meta, to_empty + reset_parameters: the ranks whose router shard
    is empty (W = 4) train with the others, bit for bit like FSDP2."""
    world_size = results[0]
    for rank, r in _each_rank(results, "meta_init"):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["router_shard"][0] == (1 if world_size == 2 or rank < 2 else 0)


@pytest.mark.parametrize("name", ["containers", "containers_bf16"])
def test_dataclass_and_namedtuple_between_modules(results, name):
    """Tensors in dataclasses, dicts and NamedTuples passed between sharded
    modules get their backward hooks and casts: training equals FSDP2's."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])


def test_group_whose_modules_did_not_all_run(results):
    """torchtitan's default: fully_shard([norm, head]) built on meta, the forward
    runs only norm, a chunked loss runs head: resharded at the root's
    post-forward and trained bit for bit like FSDP2."""
    for rank, r in _each_rank(results, "chunked_loss"):
        _assert_same(rank, r["rs"], r["torch"])
        assert r["rs"]["sharded_after_forward"] == [True] * 3


def test_group_of_two_modules_reduces_once(results):
    """fully_shard([norm, head]) with both run in forward, bf16 gradients
    accumulated without sync: FSDP2's bits and collective counts (one
    reduce-scatter per group per synced backward; the old per-call reduction
    ran two and summed in another order)."""
    for rank, r in _each_rank(results, "group_of_two"):
        _assert_same(rank, r["rs"], r["torch"], keys=["losses", "params"])
        (first, *rest), (ref_first, *ref_rest) = r["rs"]["counts"], r["torch"]["counts"]
        assert rest == ref_rest, f"rank {rank}"
        # the first forward's lazy init adds the plan check's all-gather
        # ([Note: Cross-rank plan check])
        ag = "c10d::_allgather_base_"
        assert first == {**ref_first, ag: ref_first[ag] + 1}, f"rank {rank}"


@pytest.mark.parametrize("name", ["called_twice", "called_twice_hsdp", "called_twice_group_hsdp"])
def test_module_called_twice_accumulates_as_fsdp2(results, name):
    """A block run twice per forward, micro-steps without sync or (HSDP, two
    replicas) without the all-reduce: FSDP2's bits. The replicas' partial
    gradients are added to the visit that has gradients, not to the zeros
    the block's first backward visit reduces (before: 6e-8 apart), and from
    torch 2.15 added at the first visit, as its FSDP2 adds them."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])


@pytest.mark.parametrize("name", ["jvp", "jvp_reshard"])
def test_forward_mode_ad(results, name):
    """torch.func.jvp through the sharded model (no forward before it), then a
    step: primal, tangent and training equal FSDP2's."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])


def test_jvp_of_an_input_from_outside_the_transform(results):
    """torch's test_no_warmup_jvp_reshard_after_forward_false: the decoder's
    input comes from outside torch.func.jvp; output, a zero tangent and the
    gradients of a backward after it equal FSDP2's (where FSDP2 runs it)."""
    for rank, r in _each_rank(results, "jvp_outside_input"):
        rs, ref = r["rs"], r["torch"]
        assert rs["dtype"] == "torch.bfloat16" and rs["tangent_zero"]
        assert all(any(v != 0 for v in g) for g in rs["grads"].values()), rank
        if "failed" not in ref:
            _assert_same(rank, rs, ref)


@pytest.mark.parametrize(
    "name",
    [
        "custom_comms",
        "divide_factor",
        "separate_rs_group",
        "pg_alloc",
        "unused_params",
        "reset_in_forward",
        "reset_in_backward",
        "share_comm_ctx",
        "symm_mem_cpu",
        "checkpoint_wrapper",
    ],
)
def test_fsdp_module_api(results, name):
    """FSDPModule's communication and recovery methods (custom comm objects,
    divide factor, separate reduce-scatter group and buffers, process-group
    allocation, unused parameters, reset_iter_state, share_comm_ctx, symmetric
    memory on CPU): the same training (or error) as FSDP2 with them."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        if name == "custom_comms":
            assert all(ag > 0 and rs > 0 for ag, rs in r["rs"]["calls"])
        if name == "unused_params":
            assert all(r["rs"]["has_grad"].values())
        if name == "symm_mem_cpu":
            assert r["rs"]["raised"] == "RuntimeError"


# ------------------------------------------------------------ ranks as threads

THREAD_SCENARIOS = ["hook_optim", "to_float64", "load_assign", "after_checkpoint"]


def _run_threaded(names: list[str], world_size: int) -> list[dict]:
    """Run scenarios with the ranks as threads of this process (torch's
    threaded process group, as torch's and users' unit tests use it)."""
    import threading
    import traceback

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    results: list[dict] = [{} for _ in range(world_size)]
    errors: list[str] = []
    # As torch's MultiThreadedTestCase: group names registered per thread.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    threaded.ProcessLocalGroup.reset()
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            for name in names:
                results[rank][name] = run(world_size, rank, name)
        except BaseException as e:
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            threaded.ProcessLocalGroup.exception_handle(e)  # free the ranks waiting
        finally:
            dist.destroy_process_group()

    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a rank thread hung"
    finally:
        threaded._uninstall_threaded_pg()
        threaded.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch.set_num_threads(threads_before)
    assert not errors, "\n".join(errors)
    return results


@pytest.mark.parametrize(
    "name",
    [
        "trainable_set",
        "trainable_set_bf16",
        "trainable_set_keep",
        "trainable_set_keep_grads",
        "trainable_set_offload",
        "trainable_set_accumulate",
        "trainable_set_flat",
        "trainable_set_flat_sgd",
        "trainable_set_keep_storage",
    ],
)
def test_requires_grad_changed_between_steps(results, name):
    """Freezing and unfreezing sharded parameters between steps: the same
    parameters get gradients and train, bit for bit, as under FSDP2; kept
    unsharded storage keeps its data pointers through the changes."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        if name == "trainable_set_keep_storage":
            per_block = [r["rs_storages"][b::3] for b in range(3)]
            assert all(len(set(s)) == 1 and len(s) == 6 for s in per_block), per_block
        had = r["rs"]["had"]
        if name != "trainable_set_keep_grads":  # there frozen ones keep zeroed .grads
            assert had[0] != had[2] != had[4], "the plan changed which parameters train"


@pytest.mark.parametrize(
    "name",
    [
        "inference_first",
        "inference_first_bf16",
        "inference_first_keep",
        "inference_first_reshard_2",
        "inference_first_offload",
    ],
)
def test_inference_mode_forward_before_training(results, name):
    """An evaluation under ``torch.inference_mode()`` before and between
    training steps: the same bits as FSDP2 evaluating under ``no_grad``."""
    for rank, r in _each_rank(results, name):
        _assert_same(rank, r["rs"], r["torch"])
        assert len(r["rs"]["evaluated"]) == 2, rank


@pytest.mark.parametrize("name", ["trainable_set_after_eval", "trainable_set_after_eval_keep"])
def test_requires_grad_changed_on_unsharded_parameters(results, name):
    """Changed through ``model.named_parameters()`` after an evaluation forward
    left modules unsharded: followed at the next forward, bit for bit as FSDP2
    (and fsdp-rs) follow the same change made on the sharded parameters."""
    for rank, r in _each_rank(results, name):
        # step 0 is before any forward; steps 2 and 4 follow an evaluation
        assert r["rs_unsharded_at_change"] == [False, True, True], rank
        _assert_same(rank, r["rs"], r["torch"])
        _assert_same(rank, r["rs"], r["rs_reshard"])
        had = r["rs"]["had"]
        assert had[0] != had[2] != had[4], "the plan changed which parameters train"
        assert all(r["rs"]["requires_grad"]), "the last unfreezing was kept on the shards"


def test_requires_grad_changed_under_a_pending_graph_raises(results):
    for rank, r in _each_rank(results, "trainable_set_pending_graph"):
        assert r["raised"] and "head.weight changed to False" in r["raised"], rank
        assert "held by the autograd graph" in r["raised"]
        assert r["head_grad"] is False  # followed after reset_iter_state


def test_requires_grad_changed_mid_accumulation_raises(results):
    for rank, r in _each_rank(results, "trainable_set_mid_accumulation"):
        assert r["raised"] and "lin1.weight changed to False" in r["raised"], rank


def test_ranks_as_threads():
    """The core scenarios with the ranks as threads of one process: nothing in
    fsdp-rs is shared between ranks, and each is bit for bit FSDP2's."""
    per_rank = _run_threaded(THREAD_SCENARIOS, 2)
    for rank, results in enumerate(per_rank):
        for name in THREAD_SCENARIOS:
            _assert_same(rank, results[name]["rs"], results[name]["torch"])
