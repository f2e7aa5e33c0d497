"""``bench init`` / ``bench step`` and fake-process-group scale checks: on large
fake groups, fsdp-rs's sharded parameters equal torch FSDP2's (shapes, strides,
placements and local values), and a training step runs at scale.

Each case runs in a fresh interpreter: a process group is global state.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fsdp_rs
from fsdp_rs.bench.cli import STEP_ROUNDS_SMALL

STEP_FIELDS = {
    "bench": str,
    "n_params": int,
    "world_size": int,
    "fsdp_rs_s": float,
    "torch_s": float,
    "speedup": float,
    "unsharded_step_s": float,
    "fsdp_rs_step_s": float,
    "torch_step_s": float,
}


def _python(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    package_root = str(Path(fsdp_rs.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bench_init(tmp_path: Path) -> None:
    out = tmp_path / "init.json"
    argv = ["init", "--params", "40", "--params", "300", "--block-params", "10"]
    proc = _python(["-m", "fsdp_rs.bench", *argv, "--torch-max-params", "100", "--json", str(out)])
    assert "speedup" in proc.stdout
    first, second = json.loads(out.read_text())
    assert first["bench"] == "init" and first["n_params"] == 40 and first["world_size"] == 8
    assert first["groups"] == 5 and first["fsdp_rs_s"] > 0 and first["torch_s"] > 0
    assert first["speedup"] == pytest.approx(first["torch_s"] / first["fsdp_rs_s"])
    assert first["floor_s"] > 0 and second["floor_s"] > 0  # [Note: The floor]
    assert "floor s" in proc.stdout
    # above --torch-max-params torch FSDP2 is not timed
    assert second["n_params"] == 300 and second["torch_s"] is None and second["speedup"] is None


def test_bench_init_and_step_2d(tmp_path: Path) -> None:
    """``--tp 2``: DTensor parameters on a (W/2, 2) mesh, both libraries timed."""
    for bench in ("init", "step"):
        out = tmp_path / f"{bench}.json"
        argv = [bench, "--params", "40", "--block-params", "10", "--world-size", "4", "--tp", "2"]
        extra = ["--repeat", "1"] if bench == "step" else []
        proc = _python(["-m", "fsdp_rs.bench", *argv, *extra, "--json", str(out)])
        assert "mesh (dp=2, tp=2)" in proc.stdout
        (record,) = json.loads(out.read_text())
        assert record["tp"] == 2 and record["world_size"] == 4
        assert record["torch_s"] is not None and record["fsdp_rs_s"] is not None
        assert record["floor_s"] is None  # the floor shards plain parameters on 1-D meshes


def test_bench_step(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    argv = ["step", "--params", "50", "--block-params", "10", "--repeat", "2"]
    proc = _python(["-m", "fsdp_rs.bench", *argv, "--world-size", "4", "--json", str(out)])
    assert "overhead" in proc.stdout
    (record,) = json.loads(out.read_text())
    for field, kind in STEP_FIELDS.items():
        assert isinstance(record[field], kind), field
    assert record["bench"] == "step" and record["world_size"] == 4
    assert record["fsdp_rs_s"] == pytest.approx(
        record["fsdp_rs_step_s"] - record["unsharded_step_s"]
    )
    # per-round figures: one per round, their median the reported overhead
    assert len(record["fsdp_rs_round_s"]) == len(record["torch_round_s"]) == 2
    assert statistics.median(record["torch_round_s"]) == pytest.approx(record["torch_s"])
    assert record["round_speedups"] == pytest.approx(
        [t / f for f, t in zip(record["fsdp_rs_round_s"], record["torch_round_s"], strict=True)]
    )
    assert "rounds: min-max" in proc.stdout
    assert record["floor_s"] is None and record["floor_round_s"] is None  # AdamW: no floor


@pytest.mark.parametrize("model", ["blocks", "linears"])
def test_bench_step_floor(tmp_path: Path, model: str) -> None:
    """Without the optimizer step the floor ([Note: The floor]) is timed beside
    the libraries: one group per block (no root group), its overhead the median
    of its rounds and printed per group."""
    out = tmp_path / "step.json"
    argv = ["step", "--model", model, "--params", "40", "--block-params", "10", "--repeat", "2"]
    argv += ["--optimizer", "none", "--world-size", "2", "--json", str(out)]
    proc = _python(["-m", "fsdp_rs.bench", *argv])
    (record,) = json.loads(out.read_text())
    assert record["floor_groups"] == (4 if model == "blocks" else 20)
    assert len(record["floor_round_s"]) == 2
    assert statistics.median(record["floor_round_s"]) == pytest.approx(record["floor_s"])
    assert record["floor_s"] == pytest.approx(record["floor_step_s"] - record["unsharded_step_s"])
    header, _, row = proc.stdout.strip().splitlines()[-3:]
    assert header.split()[-4:] == ["floor", "overhead", "ms", "us/group"]
    per_group = record["floor_s"] / record["floor_groups"] * 1e6
    assert row.split()[-1] == f"{per_group:.1f}"


def test_bench_step_linears(tmp_path: Path) -> None:
    """pytorch/pytorch#173680's shape: one group per nn.Linear, against the
    groups auto_shard chooses (all of them in one here), the optimizer step
    included."""
    out = tmp_path / "step.json"
    argv = ["step", "--model", "linears", "--params", "40", "--repeat", "1", "--world-size", "2"]
    proc = _python(["-m", "fsdp_rs.bench", *argv, "--json", str(out)])
    assert "nn.Linear(8, 8) modules" in proc.stdout
    (record,) = json.loads(out.read_text())
    assert record["model"] == "linears" and record["optimizer"] == "adamw"
    assert record["groups"] == record["torch_groups"] == 21  # 20 Linears and the root
    assert record["auto_groups"] == 2  # one group of all 20, and the (empty) root
    assert record["fsdp_rs_auto_s"] == pytest.approx(
        record["fsdp_rs_auto_step_s"] - record["unsharded_step_s"]
    )


def test_bench_step_torch_max_params(tmp_path: Path) -> None:
    """Above --torch-max-params torch FSDP2 is not timed: its fields are None
    and its columns '-', while fsdp-rs and the auto column still are."""
    out = tmp_path / "step.json"
    argv = ["step", "--params", "10", "--params", "30", "--block-params", "10"]
    argv += ["--repeat", "1", "--world-size", "2", "--torch-max-params", "20"]
    proc = _python(["-m", "fsdp_rs.bench", *argv, "--json", str(out)])
    small, large = json.loads(out.read_text())
    assert small["torch_s"] is not None and small["torch_step_s"] is not None
    for field in ("torch_s", "torch_step_s", "torch_round_s", "torch_groups", "speedup"):
        assert large[field] is None, field
    assert large["round_speedups"] == []
    assert large["fsdp_rs_s"] == pytest.approx(large["fsdp_rs_step_s"] - large["unsharded_step_s"])
    assert large["fsdp_rs_auto_step_s"] is not None
    last_row = proc.stdout.strip().splitlines()[-1].split()
    assert last_row[0] == "30" and last_row[4] == "-"  # n_params, ..., torch ms


def test_bench_step_default_rounds(tmp_path: Path) -> None:
    """Without --repeat, small models get the many rounds their noise needs."""
    out = tmp_path / "step.json"
    argv = ["step", "--params", "20", "--block-params", "10", "--world-size", "2"]
    _python(["-m", "fsdp_rs.bench", *argv, "--json", str(out)])
    (record,) = json.loads(out.read_text())
    assert record["repeat"] == STEP_ROUNDS_SMALL == len(record["round_speedups"])


OPTIM_FIELDS = (
    "plain_s",
    "torch_s",
    "fsdp_rs_s",
    "fsdp_rs_flat_s",
    "flat_speedup",
    "step_torch_s",
    "step_fsdp_rs_flat_s",
    "step_plain_s",
)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach", "sgd"])
def test_bench_optim(tmp_path: Path, optimizer: str) -> None:
    out = tmp_path / "optim.json"
    argv = ["optim", "--params", "60", "--block-params", "20", "--repeat", "2"]
    argv += ["--world-size", "4", "--optimizer", optimizer, "--json", str(out)]
    proc = _python(["-m", "fsdp_rs.bench", *argv])
    assert "rs flat" in proc.stdout
    (record,) = json.loads(out.read_text())
    assert record["bench"] == "optim" and record["optimizer"] == optimizer
    assert record["n_params"] == 60 and record["world_size"] == 4
    for field in OPTIM_FIELDS:
        assert isinstance(record[field], float) and record[field] > 0, field
    assert record["flat_speedup"] == pytest.approx(record["torch_s"] / record["fsdp_rs_flat_s"])
    assert record["equal"] is True  # the flat and per-parameter steps gave the same shards


def test_bench_bad_input() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rs.bench", "step", "--params", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(fsdp_rs.__file__).resolve().parents[1])},
    )
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


SCALE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_rs import fully_shard

    world_size, rank, n = map(int, sys.argv[1:4])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    shapes = [(1 + (i * 37) % 1500, 1 + i % 3) if i % 4 else (1 + (i * 13) % 2100,)
              for i in range(n)]
    shapes[7] = (0, 2)  # an empty param: the first group fills per param, the rest by chunk_cat

    def build():
        torch.manual_seed(0)
        root = nn.Module()
        root.blocks = nn.ModuleList()
        for start in range(0, n, 250):
            block = nn.Module()
            block.params = nn.ParameterList(torch.randn(s) for s in shapes[start:start + 250])
            root.blocks.append(block)
        return root

    ours, theirs = build(), build()
    for root, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        for block in root.blocks:
            shard(block)
        shard(root)
    ours_params, their_params = list(ours.parameters()), list(theirs.parameters())
    assert len(ours_params) == len(their_params) == n
    for i, (a, b) in enumerate(zip(ours_params, their_params)):
        assert a.shape == b.shape and a.placements == b.placements, i
        la, lb = a.to_local(), b.to_local()
        assert la.shape == lb.shape and la.stride() == lb.stride(), (i, la.shape, lb.shape)
        assert torch.equal(la, lb), i
    print("ok", n)
    """
)


@pytest.mark.parametrize(
    ("world_size", "rank", "n_params"),
    [(8, 3, 5000), (1024, 0, 1000), (1024, 1023, 1000), (1000, 517, 1000)],
)
def test_fake_process_group_scale(world_size: int, rank: int, n_params: int) -> None:
    """Sharded parameters equal torch FSDP2's on large fake groups: padded ranks
    (d0 < W), the last rank, a world size that is not a power of two."""
    proc = _python(["-c", SCALE_SCRIPT, str(world_size), str(rank), str(n_params)])
    assert f"ok {n_params}" in proc.stdout


FRESH_CACHES = """
import torch
from torch.distributed.tensor import DTensor, debug
from fsdp_rs.bench.timing import fresh_dtensor_caches
from fsdp_rs.bench.training import BenchModel, fake_process_group, shard_model

fake_process_group(2)
model = BenchModel(4, 2)
shard_model(model, "torch")
params = [p.detach() for p in model.parameters()]
torch._foreach_mul_(params, 1.0)  # cached now
torch._foreach_mul_(params, 1.0)
python_cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
fresh_dtensor_caches()
assert python_cache.cache_info().currsize == 0
stats = getattr(debug, "_get_fast_path_sharding_prop_cache_stats", None)
if stats is not None:
    misses = stats()[1]
    torch._foreach_mul_(params, 1.0)
    assert stats()[1] == misses + 1, "the C++ cache still held the entry"
print("emptied")
"""


def test_fresh_dtensor_caches_empties_the_sharding_caches() -> None:
    """[Note: One process, two libraries]: after the call the next DTensor op
    misses, so the model timed next fills the caches with its own specs."""
    assert "emptied" in _python(["-c", FRESH_CACHES]).stdout


FLOOR_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, world_size, port, model_kind):
        from torch.distributed.device_mesh import init_device_mesh
        from fsdp_rs.bench.floor import bare_shard
        from fsdp_rs.bench.training import MODELS

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        mesh = init_device_mesh("cpu", (world_size,))
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(MODELS[model_kind](30, 7))
        ref, floor = models
        bare_shard(floor, mesh)
        x = torch.randn(4, generator=torch.Generator().manual_seed(1))
        for step in range(2):  # the second step: after the first's reshards
            ref.zero_grad(set_to_none=True)
            floor.zero_grad(set_to_none=True)
            out_ref, out = ref(x), floor(x)
            assert torch.equal(out_ref, out), (step, out_ref, out)
            out_ref.sum().backward()
            out.sum().backward()
            grads = [world_size * p.grad for p in ref.parameters()]
            got = [p.grad.to_local() for p in floor.parameters()]
            assert len(got) == len(grads)
            expected_rows = torch._chunk_cat(grads, 0, world_size)[rank]
            assert torch.equal(torch.cat([g.reshape(-1) for g in got]), expected_rows), step
        dist.destroy_process_group()

    if __name__ == "__main__":
        world_size, port, model_kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        mp.spawn(rank_main, args=(world_size, port, model_kind), nprocs=world_size)
        print("floor ok", model_kind)
    """
)


@pytest.mark.parametrize("model_kind", ["blocks", "linears"])
def test_floor_gathers_and_reduces(tmp_path: Path, model_kind: str) -> None:
    """[Note: The floor]: ``bare_shard`` makes the calls it times for real: on
    two gloo ranks the forward equals the unsharded model's and the sharded
    gradients hold this rank's rows of the summed gradients (the first
    group's, whose input needs no gradient, reduced at the end of backward)."""
    from spawned import free_port

    script = tmp_path / "floor_check.py"
    script.write_text(FLOOR_SCRIPT)
    proc = _python([str(script), "2", str(free_port()), model_kind])
    assert f"floor ok {model_kind}" in proc.stdout
