"""``bench modules`` at a tiny size: 8 blocks, 2 timed steps on 2 spawned gloo
ranks; every column's record, and the sharded columns' losses equal bit for
bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import fsdp_rs
from fsdp_rs.bench.cli import main
from fsdp_rs.bench.modules import COLUMNS, SHARDED, hand_groups, make_model

BLOCKS, STEPS, WARMUP = 8, 2, 2
BLOCK_BYTES = (16 * 16 + 16 + 16 + 16) * 4  # Linear(16, 16) and LayerNorm(16), fp32
GROUP_BYTES = 2 * BLOCK_BYTES + 100  # two blocks a group: 4 groups

FIELDS = {
    "bench": str,
    "column": str,
    "world_size": int,
    "blocks": int,
    "dim": int,
    "steps": int,
    "warmup": int,
    "group_bytes": int,
    "step_s": float,
    "step_s_each": list,
    "shard_s": float,
    "ratio_to_ddp": float,
    "all_gathers": int,
    "reduce_scatters": int,
    "all_reduces": int,
    "final_loss": float,
    "losses": list,
    "peak_bytes": list,
}


def test_hand_groups_greedy() -> None:
    """The hand column shards the planner's groups: consecutive blocks up to
    the budget, a module over it alone."""
    model = make_model(5, 16)
    sizes = [len(g) for g in hand_groups(model, GROUP_BYTES)]
    assert sizes == [2, 2, 1]
    # under a budget smaller than a block, the planner splits each block: its
    # Linear and its LayerNorm alone
    assert [len(g) for g in hand_groups(model, 1)] == [1] * 10
    big = nn.Sequential(nn.Linear(64, 64), *model)
    assert [len(g) for g in hand_groups(big, GROUP_BYTES)] == [1, 2, 2, 1]


def test_unknown_column_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["modules", "--columns", "ddp,fsdp3"])
    assert e.value.code == 2


def test_bench_modules_tiny(tmp_path: Path) -> None:
    out = tmp_path / "modules.json"
    env = dict(os.environ)
    package_root = str(Path(fsdp_rs.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    argv = ["--blocks", str(BLOCKS), "--steps", str(STEPS), "--warmup", str(WARMUP)]
    argv += ["--group-bytes", str(GROUP_BYTES), "--columns", ",".join(COLUMNS), "--memory"]
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rs.bench", "modules", *argv, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fsdp_rs_root" in proc.stdout and "x DDP" in proc.stdout
    records = {r["column"]: r for r in json.loads(out.read_text())}
    assert list(records) == list(COLUMNS)
    for name, r in records.items():
        for field, kind in FIELDS.items():
            assert isinstance(r[field], kind), (name, field, r[field])
        assert r["bench"] == "modules" and r["world_size"] == 2 and r["blocks"] == BLOCKS
        assert r["block_bytes"] == BLOCK_BYTES
        assert len(r["losses"]) == WARMUP + STEPS and r["final_loss"] == r["losses"][-1]
        assert len(r["step_s_each"]) == STEPS and r["step_s"] > 0
        assert len(r["peak_bytes"]) == 2 and all(b > 0 for b in r["peak_bytes"])
    assert records["ddp"]["ratio_to_ddp"] == 1.0 and records["ddp"]["groups"] is None
    assert records["ddp"]["all_gathers"] == 0 and records["ddp"]["all_reduces"] >= 1

    # groups and collectives: per block 8 groups (the root has no parameters of
    # its own), each gathered in forward and again in backward
    groups = {"fsdp2": 8, "fsdp_rs": 8, "fsdp_rs_root": 1, "fsdp_rs_auto": 4, "fsdp_rs_hand": 4}
    assert {c: records[c]["groups"] for c in SHARDED} == groups
    for column in SHARDED:
        assert records[column]["reduce_scatters"] == groups[column]
        gathers = 1 if column == "fsdp_rs_root" else 2 * groups[column]  # the root stays
        assert records[column]["all_gathers"] == gathers, column

    # the same math in every sharded column: the same losses, bit for bit
    losses = {c: records[c]["losses"] for c in SHARDED}
    assert all(v == losses["fsdp2"] for v in losses.values()), losses
    assert all(records[c]["losses_equal"] is True for c in SHARDED)
    assert len(set(losses["fsdp2"])) > 1  # it trains
