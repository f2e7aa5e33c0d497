"""accelerate's FSDP2 plugin with a PEFT LoRA model and gradient accumulation
(``accelerate_scenarios.py``): with fsdp-rs switched in, bit for bit torch
FSDP2's. Skipped where accelerate, peft or transformers is not installed (the
newest torch leg installs them: requirements-torch-newest.txt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parents[1]))
from clients.accelerate_scenarios import SCENARIOS, run
from clients.client_common import check
from spawned import results_fixture

results = results_fixture(SCENARIOS, run, world_sizes=(2,))


def test_lora_gradient_accumulation_matches_fsdp2(results):
    """Losses of every micro-step, the whole gradients and accelerate's
    clipped norm at each sync, the final full state dict (gathered, and
    accelerate's ``get_state_dict``) equal FSDP2's bit for bit; every module
    accelerate sharded is fsdp-rs's in one run and torch's in the other."""
    check(SCENARIOS, results, "lora_accumulation")
