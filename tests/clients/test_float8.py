"""torchao's float8 training with float8 all-gather under FSDP2
(``float8_scenarios.py``): with fsdp-rs switched in, bit for bit torch
FSDP2's. Skipped where torchao is not installed (the newest torch leg
installs it: requirements-torch-newest.txt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao.float8")

sys.path.insert(0, str(Path(__file__).parents[1]))
from clients.client_common import check
from clients.float8_scenarios import SCENARIOS, run
from spawned import each_rank, results_fixture

results = results_fixture(SCENARIOS, run, world_sizes=(2,))


def test_float8_all_gather_matches_fsdp2(results):
    """Losses, the whole gradients and clipped norm of each step, and the
    final full state dict equal FSDP2's bit for bit, with
    ``precompute_float8_dynamic_scale_for_fsdp`` after each step; the weights
    are torchao's float8 all-gather tensors in both runs, and FSDP2's
    gathered float8."""
    check(SCENARIOS, results, "float8_all_gather")
    for rank, result in each_rank(SCENARIOS, results, "float8_all_gather"):
        assert result["float8"] == {"rs": True, "torch": True}, rank
        assert "torch.float8_e4m3fn" in result["torch_gathered"], (rank, result)
