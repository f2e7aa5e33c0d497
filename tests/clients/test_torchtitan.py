"""torchtitan's own trainer with its debugmodel defaults, on a tiny Llama 3 on
CPU (``torchtitan_scenarios.py``, [Note: torchtitan on CPU] there for what a
CPU needs): with fsdp-rs switched in, bit for bit torch FSDP2's. Skipped
where torchtitan is not installed (the newest torch leg installs it:
requirements-torch-newest.txt)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

sys.path.insert(0, str(Path(__file__).parents[1]))
import torch

from clients.client_common import check_summary, summary
from clients.torchtitan_scenarios import SCENARIOS, run
from spawned import each_rank, gloo_worker, read_ranks, spawn_scenarios

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each library's run in a spawn of its own: (per-rank results of each
    spawn, the records folder)."""
    records = tmp_path_factory.mktemp("titan_records")
    os.environ["FSDP_RS_CLIENT_RECORDS"] = str(records)
    out = {}
    try:
        for name in SCENARIOS:
            folder = tmp_path_factory.mktemp(name)
            failure = None
            try:
                worker = functools.partial(gloo_worker, run=run)
                spawn_scenarios(worker, WORLD_SIZE, [name], folder, timeout_s=600)
            except Exception as e:  # a rank raised: its JSON names the scenario
                failure = e
            out[name] = (WORLD_SIZE, read_ranks(folder, WORLD_SIZE), failure)
    finally:
        del os.environ["FSDP_RS_CLIENT_RECORDS"]
    return out, records


def test_trainer_matches_fsdp2(runs):
    """Each step's global average and max loss and clipped gradient norm as
    torchtitan logs them, the whole gradients before each optimizer step and
    the final full state dict equal FSDP2's bit for bit; every module
    torchtitan's ``parallelize_llama`` sharded is fsdp-rs's in one run and
    torch's in the other."""
    results, records = runs
    ranks = {name: dict(each_rank(SCENARIOS, results[name], name)) for name in SCENARIOS}
    for rank in range(WORLD_SIZE):
        rs = {
            "record": torch.load(records / f"rs{rank}.pt"),
            "sharded_by": ranks["trainer_rs"][rank]["sharded_by"],
        }
        ref = {
            "record": torch.load(records / f"torch{rank}.pt"),
            "sharded_by": ranks["trainer_torch"][rank]["sharded_by"],
        }
        check_summary(rank, summary(rs, ref))
