"""Manual backward finalization, kept unsharded storage and torch's pipeline
schedules over fsdp-rs stages, against torch FSDP2 (``finalize_scenarios.py``;
[Note: Manual backward finalization] in ``runtime/step/finalize.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from finalize_scenarios import MICRO, SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


def _each_rank(results, name: str):
    return each_rank(SCENARIOS, results, name)


@pytest.mark.parametrize(
    "name",
    [
        "accumulate",
        "sync",
        "async",
        "accumulate_hsdp",
        "accumulate_bf16_offload",
        "sync_bf16_offload",
    ],
)
def test_manual_finalization_trains_as_fsdp2(results, name):
    """Bit for bit with FSDP2's manual finalization (torch >= 2.15), or with
    FSDP2's gradient accumulation synced at the last micro-step (older torch):
    the finalization reduces the sum of every micro-step once."""
    for rank, r in _each_rank(results, name):
        rs, ref = r["rs"], r["torch"]
        steps = 3 if name.startswith("sync") else 3 * MICRO
        assert len(rs["losses"]) == steps
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ from FSDP2"
        assert rs["params"] == ref["params"], f"rank {rank}: parameters differ from FSDP2"
        if name == "async":  # a forward before wait() raises, in both when both have it
            assert rs["raised"] == [True] * 3
            if r["torch_manual"]:
                assert ref["raised"] == [True] * 3


@pytest.mark.parametrize("name", ["partial_sync", "partial_accumulate"])
def test_manual_finalization_with_gradients_on_some_ranks(results, name):
    """Parameters used on rank 0 only: finalized by hand, bit for bit the
    automatic end of backward's training (every rank reduces every group)."""
    for rank, r in _each_rank(results, name):
        assert r["manual"] == r["automatic"], f"rank {rank}: manual differs from automatic"


def test_finalization_errors(results):
    for rank, r in _each_rank(results, "errors"):
        errors = r["errors"]
        assert errors.pop("before_forward") is None
        expected = {
            "nested_at_lazy_init": "must be called on the root",
            "not_manual": "requires manual backward finalization",
            "nested": "must be called on the root",
            "not_bool": "takes a bool",
            "in_backward": "after backward completes",
            "change_after_backward": "cannot change mode after a backward started",
            "twice": "must be waited on before finalizing backward again",
            "nested_finalize": "must be called on the root",
            "after_reset": "invalidated by reset_iter_state",
        }
        for key, words in expected.items():
            assert errors[key] is not None and words in errors[key], (rank, key, errors[key])


def test_keep_unsharded_storage(results):
    """Kept: memory and data pointers survive every reshard; the same training
    as FSDP2; turned off, the next reshard frees them."""
    for rank, r in _each_rank(results, "keep_storage"):
        rs, ref = r["rs"], r["torch"]
        assert rs["losses"] == ref["losses"] and rs["params"] == ref["params"], rank
        assert rs["kept"] and all(rs["kept"]) and rs["stable"]
        assert rs["freed_after"] and all(rs["freed_after"])
        if r["torch_keep"]:
            assert ref["kept"] == rs["kept"] and ref["stable"]
            assert ref["freed_after"] == rs["freed_after"]
        else:  # FSDP2 without the API frees at every reshard
            assert not any(ref["kept"])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_schedules(results, name):
    """torch's pipeline schedules (which drive manual finalization on torch >=
    2.15) train fsdp-rs stages bit for bit as FSDP2 stages."""
    for rank, r in _each_rank(results, name):
        rs, ref = r["rs"], r["torch"]
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ from FSDP2"
        assert rs["params"] == ref["params"], f"rank {rank}: parameters differ from FSDP2"
