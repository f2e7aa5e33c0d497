"""Lightning Fabric's ModelParallelStrategy with gradient accumulation under
``no_backward_sync`` (``lightning_scenarios.py``): the user's code calls
``fsdp_rs.fully_shard``, nothing patched, and training is bit for bit torch
FSDP2's. Skipped where lightning is not installed (the newest torch leg
installs it: requirements-torch-newest.txt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.fabric")

sys.path.insert(0, str(Path(__file__).parents[1]))
from clients.client_common import check
from clients.lightning_scenarios import SCENARIOS, run
from spawned import results_fixture

results = results_fixture(SCENARIOS, run, world_sizes=(2,))


def test_no_backward_sync_matches_fsdp2(results):
    """Losses of every micro-step, which parameters hold a gradient after
    each micro-step (none where Lightning kept the modules from syncing), the
    whole gradients and Fabric's clipped norm at each sync, and the final full
    state dict equal FSDP2's bit for bit."""
    check(SCENARIOS, results, "no_backward_sync")
