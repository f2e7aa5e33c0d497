"""QLoRA (``qlora_scenarios.py``): frozen quantized base weights whose
all-gather extension gathers flat inner tensors (torchao's NF4 and a
test-local subclass with its contract), with trainable LoRA adapters, each
block ``fully_shard``ed: training is bit for bit torch FSDP2's in fp32 and with
bf16 parameters. All scenarios of one world size run in one spawn of gloo
ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from qlora_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run)


@pytest.mark.parametrize(
    ("name", "base_type"),
    [
        ("blockwise", "Blockwise"),
        ("blockwise_bf16", "Blockwise"),
        ("blockwise_keep", "Blockwise"),
        ("padded", "PaddedBlockwise"),
        ("padded_bf16", "PaddedBlockwise"),
        ("nf4", "NF4Tensor"),
        ("nf4_bf16", "NF4Tensor"),
    ],
)
def test_qlora_matches_fsdp2(results, name, base_type):
    """Losses, every local shard (each inner tensor of a quantized base weight)
    and sharded gradient equal FSDP2's bit for bit; the base weights' local
    shards keep their type, get no gradient, and the post-all-gather gets
    FSDP2's ``param_dtype``. ``padded``: uneven shards at W = 4, whose flat
    inputs the pre-all-gather pads; ``nf4``: torchao's ``to_nf4`` (skipped
    where torchao is not importable)."""
    for rank, r in each_rank(SCENARIOS, results, name):
        rs, ref = r["rs"], r["torch"]
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ"
        for key in ("params", "grads"):
            for param in ref[key]:
                assert rs[key][param] == ref[key][param], f"rank {rank}: {key} of {param} differ"
        assert rs["base_type"] == ref["base_type"] == base_type, rank
        assert rs["post_dtypes"] == ref["post_dtypes"], rank
        frozen = {n for n in ref["grads"] if n.endswith("lin1.weight") or n.endswith("lin2.weight")}
        assert frozen == {n for n, g in rs["grads"].items() if g is None}, rank
