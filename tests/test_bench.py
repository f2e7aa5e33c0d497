"""``python -m fsdp_rs.bench``: the plan benchmark CLI, its records, plot and shape mixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fsdp_rs
from fsdp_rs.bench import cli, plan, report
from fsdp_rs.bench.shapes import (
    ELEMENT_BUDGET_PER_RANK,
    FAMILIES,
    auto_counts,
    family_shapes,
    make_shapes,
)
from fsdp_rs.bench.timing import time_call

RECORD_TYPES = {
    "n_params": int,
    "world_size": int,
    "rank": int,
    "shape_mix": str,
    "total_elements": int,
    "repeat": int,
    "fsdp_rs_s": float,
    "fsdp_rs_best_s": float,
    "reference_s": float,
    "speedup": float,
    "plan_bytes": int,
    "plan_bytes_per_param": float,
    "outputs_equal": bool,
    "flat_fsdp_rs_s": float,
    "flat_reference_s": float,
    "flat_speedup": float,
    "flat_plan_bytes_per_param": float,
    "flat_outputs_equal": bool,
    "differences": list,
    "python_version": str,
}


def _run(argv: list[str]) -> int:
    return cli.main(["plan", *argv])


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("world_size", [8, 3])
def test_plan_json_and_plot(tmp_path: Path, capsys, world_size: int) -> None:
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["--params", "1000", "--params", "3000", "--world-size", str(world_size)]
    argv += ["--repeat", "2", "--json", str(out_json), "--plot", str(out_png)]
    assert _run(argv) == 0

    records = json.loads(out_json.read_text())
    assert [r["n_params"] for r in records] == [1000, 3000]
    for r in records:
        for key, typ in RECORD_TYPES.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert r["world_size"] == world_size
        assert r["outputs_equal"] is True and r["flat_outputs_equal"] is True
        assert r["differences"] == []
        assert r["fsdp_rs_s"] > 0 and r["reference_s"] > 0
        assert r["speedup"] == pytest.approx(r["reference_s"] / r["fsdp_rs_s"])
        assert r["plan_bytes_per_param"] == pytest.approx(r["plan_bytes"] / r["n_params"])
        assert r["total_elements"] == make_shapes(r["n_params"], world_size).total_elements
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 1000

    stdout = capsys.readouterr().out
    assert "plan_group" in stdout and "plan_flat" in stdout and "speedup" in stdout
    assert "3000" in stdout


def test_plan_record_matches_planner(tmp_path: Path) -> None:
    record = plan.bench_plan(500, 4, repeat=1)
    shapes = make_shapes(500, 4)
    rust = fsdp_rs.plan_group(
        shapes.ndims, shapes.dims, 4, 0, orig_elem_size=4, param_elem_size=2, reduce_elem_size=4
    )
    flat = fsdp_rs.plan_flat(shapes.ndims, shapes.dims, 4, 0, aligned_numel=8)
    assert record.plan_bytes == rust.plan_bytes
    assert record.plan_bytes_per_param == rust.plan_bytes / 500
    assert record.flat_plan_bytes_per_param == flat.plan_bytes / 500
    assert record.outputs_equal and record.flat_outputs_equal


def test_no_reference(tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    argv = ["--params", "200", "--no-reference", "--repeat", "1", "--json", str(out_json)]
    assert _run(argv) == 0
    (r,) = json.loads(out_json.read_text())
    for key in ("reference_s", "speedup", "outputs_equal"):
        assert r[key] is None and r[f"flat_{key}"] is None
    assert r["reference_repeat"] == 0 and r["fsdp_rs_s"] > 0


def test_default_sweep(monkeypatch, tmp_path: Path) -> None:
    assert cli.DEFAULT_PARAMS == (1_000, 10_000, 100_000, 1_000_000)
    monkeypatch.setattr(cli, "DEFAULT_PARAMS", (10, 20))
    out_json = tmp_path / "out.json"
    assert _run(["--no-reference", "--repeat", "1", "--json", str(out_json)]) == 0
    records = json.loads(out_json.read_text())
    assert [(r["n_params"], r["world_size"]) for r in records] == [(10, 8), (20, 8)]


def test_scientific_notation(tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    assert _run(["--params", "1e2", "--params", "1_50", "--json", str(out_json)]) == 0
    assert [r["n_params"] for r in json.loads(out_json.read_text())] == [100, 150]


def test_mismatch_exits_nonzero(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(plan, "_differences", lambda rust, ref: ["row_offsets[3]: got 1, want 2"])
    out_json = tmp_path / "out.json"
    assert _run(["--params", "50", "--repeat", "1", "--json", str(out_json)]) == 1
    (r,) = json.loads(out_json.read_text())
    assert r["outputs_equal"] is False and r["flat_outputs_equal"] is False
    assert r["differences"][0] == "plan_group: row_offsets[3]: got 1, want 2"
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "differ" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--params", "0"],
        ["--params", "-5"],
        ["--params", "1.5"],
        ["--params", "abc"],
        ["--world-size", "0"],
        ["--world-size", "-1"],
        ["--repeat", "0"],
        ["--rank", "8"],
        ["--mix", "cnn"],
    ],
)
def test_bad_input_is_argparse_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _run(["--no-reference", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_subcommand_required(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "plan" in capsys.readouterr().out


def test_plot_without_matplotlib(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(report, "matplotlib_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        _run(["--params", "10", "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "pip install matplotlib" in capsys.readouterr().err

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot_plan_times([], tmp_path / "p.png")


def _fresh_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh interpreter that imports this fsdp_rs."""
    env = dict(os.environ, **extra)
    package_root = str(Path(fsdp_rs.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def test_python_dash_m(tmp_path: Path) -> None:
    """The documented entry point, in a fresh interpreter."""
    env = _fresh_env()
    out_json = tmp_path / "out.json"
    argv = ["plan", "--params", "100", "--world-size", "3", "--repeat", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rs.bench", *argv, "--json", str(out_json)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan_group" in proc.stdout
    assert json.loads(out_json.read_text())[0]["outputs_equal"] is True


@pytest.mark.slow
def test_plan_one_million(tmp_path: Path) -> None:
    """The default sweep's largest N: the reference agrees at scale."""
    record = plan.bench_plan(1_000_000, 8, repeat=1)
    assert record.outputs_equal and record.flat_outputs_equal, record.differences
    assert record.speedup is not None and record.speedup > 1


# ----------------------------------------------------------------------------- report


def test_plan_tables_render_missing_values() -> None:
    record = plan.bench_plan(20, 2, repeat=1, reference=False).as_dict()
    text = report.plan_tables([record])
    assert text.count("n_params") == 2 and " - " in text


def test_time_call() -> None:
    calls = []
    timing, result = time_call(lambda: calls.append(1) or len(calls), repeat=3, warmup=2)
    assert result == 5 and len(timing.seconds) == 3
    assert timing.best <= timing.median
    with pytest.raises(ValueError):
        time_call(lambda: None, repeat=0)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("mix", ["auto", *FAMILIES])
@pytest.mark.parametrize("n", [1, 2, 3, 12, 193, 1000, 12_345])
def test_shape_mix_counts(mix: str, n: int) -> None:
    s = make_shapes(n, 8, mix, seed=1)
    assert s.num_params == n and sum(s.counts.values()) == n
    assert s.ndims.dtype == np.int64 and s.dims.dtype == np.int64
    assert s.ndims.ndim == 1 and s.dims.ndim == 1
    assert int(s.ndims.sum()) == s.dims.size
    assert set(np.unique(s.ndims).tolist()) <= {1, 2}
    assert s.dims.min() >= 1
    numels = [int(np.prod(shape)) for shape in _split(s.ndims, s.dims)]
    assert s.numels.tolist() == numels and s.total_elements == sum(numels)


def _split(ndims: np.ndarray, dims: np.ndarray) -> list[tuple[int, ...]]:
    out, i = [], 0
    for k in ndims.tolist():
        out.append(tuple(dims[i : i + k].tolist()))
        i += k
    return out


@pytest.mark.parametrize("mix", ["auto", *FAMILIES])
def test_shape_mix_deterministic(mix: str) -> None:
    a, b = make_shapes(5000, 8, mix, seed=7), make_shapes(5000, 8, mix, seed=7)
    assert np.array_equal(a.ndims, b.ndims) and np.array_equal(a.dims, b.dims)
    assert a.name == b.name


def test_adapter_seed_changes_targets() -> None:
    a, b = make_shapes(3000, 8, "adapter", seed=0), make_shapes(3000, 8, "adapter", seed=1)
    assert np.array_equal(a.ndims, b.ndims) and not np.array_equal(a.dims, b.dims)


def test_family_templates() -> None:
    rng = np.random.default_rng(0)
    transformer = _split(*family_shapes("transformer", 13, rng))
    assert transformer[0] == (4096, 4096) and transformer[1] == (4096,)
    assert transformer[8:11] == [(11008, 4096), (11008, 4096), (4096, 11008)]
    assert transformer[12] == transformer[0]  # second layer starts
    moe = _split(*family_shapes("moe", 194, rng))
    assert moe[0] == (64, 2048) and moe[1:4] == [(1408, 2048), (1408, 2048), (2048, 1408)]
    assert moe[193] == (64, 2048)
    adapter = _split(*family_shapes("adapter", 30, rng))
    for a, b, scale in zip(adapter[0::3], adapter[1::3], adapter[2::3], strict=True):
        assert a[0] == 16 and b[1] == 16 and scale == (b[0],)
        assert a[1] in (4096, 11008, 2048, 1408)
    with pytest.raises(ValueError):
        family_shapes("cnn", 3, rng)
    with pytest.raises(ValueError):
        make_shapes(3, 8, "cnn")


def test_auto_mix_is_plausible() -> None:
    # Small N: dense layers only; large N: mostly adapters, dense + MoE within budget.
    assert auto_counts(100, 8) == {"transformer": 100, "moe": 0, "adapter": 0}
    for world_size in (1, 3, 8, 64):
        budget = world_size * ELEMENT_BUDGET_PER_RANK
        big = make_shapes(1_000_000, world_size)
        assert big.counts["adapter"] > 0.9 * 1_000_000
        dense_moe = big.counts["transformer"] + big.counts["moe"]
        assert big.numels[:dense_moe].sum() <= 0.9 * budget
        assert big.total_elements < 1e12
        assert big.numels[dense_moe:].mean() < 100_000
    # More ranks hold a bigger dense trunk.
    assert auto_counts(10_000, 64)["transformer"] > auto_counts(10_000, 8)["transformer"]
    w8 = make_shapes(1_000_000, 8)
    assert 1e10 < w8.total_elements < 1e11


def test_million_shapes_are_fast() -> None:
    make_shapes(1000, 8)  # warm up
    start = time.perf_counter()
    s = make_shapes(1_000_000, 8)
    assert s.num_params == 1_000_000
    assert time.perf_counter() - start < 2.0


# ----------------------------------------------------------------------------- copy

COPY_RECORD_TYPES = {
    "case": str,
    "case_name": str,
    "op": str,
    "device": str,
    "device_name": str,
    "world_size": int,
    "n_params": int,
    "total_elements": int,
    "orig_dtype": str,
    "param_dtype": str,
    "reduce_dtype": str,
    "divide_factor": float,
    "scale": float,
    "repeat": int,
    "bytes": int,
    "fsdp_rs_s": float,
    "torch_s": float,
    "copy_s": float,
    "fsdp_rs_host_s": float,
    "torch_host_s": float,
    "fsdp_rs_dispatch_host_s": float,
    "aliases": bool,
    "outputs_equal": bool,
    "torch_impl": str,
    "torch_version": str,
}
TINY = ["--device", "cpu", "--repeat", "1"]


def _copy(argv: list[str]) -> int:
    return cli.main(["copy", *argv])


def _copy_module():
    from fsdp_rs.bench import copy

    return copy


def test_copy_json_and_plot(tmp_path: Path, capsys) -> None:
    copy = _copy_module()
    out_json, out_png = tmp_path / "copy.json", tmp_path / "copy.png"
    argv = [*TINY, "--world-size", "4", "--scale", "0.002"]
    assert _copy([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0

    records = json.loads(out_json.read_text())
    assert [(r["case"], r["op"]) for r in records] == [
        (case, op) for case in "abcde" for op in copy.OPS
    ]
    for r in records:
        for key, typ in COPY_RECORD_TYPES.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert r["outputs_equal"] is True, (r["case"], r["op"])
        assert (r["device"], r["world_size"], r["scale"]) == ("cpu", 4, 0.002)
        assert (r["orig_dtype"], r["param_dtype"], r["reduce_dtype"]) == (
            "float32",
            "bfloat16",
            "float32",
        )
        assert r["divide_factor"] == 1.0
        assert r["n_params"] == len(copy.make_case(r["case"], 0.002).shapes)
        s, w = r["row_numel"], r["world_size"]
        expected_bytes = {
            "all_gather_copy_in": s * (4 + 2),
            "all_gather_copy_out": 2 * w * s * 2,
            "reduce_scatter_copy_in": r["total_elements"] * 2 + w * s * 4,
            "post_reduce": s * (4 + 4),
            "post_reduce_accumulate": s * (4 + 4 + 4),
        }
        assert r["bytes"] == expected_bytes[r["op"]]
        # fp32 gradients reduced in fp32 without a division: the runtime aliases
        assert r["aliases"] is (r["op"] == "post_reduce"), (r["case"], r["op"])
        assert min(r["torch_s"], r["copy_s"]) > 0
        assert r["torch_host_s"] == r["torch_s"]  # on CPU the host time is the op's
        assert r["fsdp_rs_host_s"] == r["fsdp_rs_s"]
        if r["aliases"]:
            assert r["fsdp_rs_s"] == 0.0
            assert r["speedup"] is r["frac_of_copy"] is r["fsdp_rs_gbps"] is None
            continue
        assert r["fsdp_rs_s"] > 0
        assert r["fsdp_rs_dispatch_host_s"] > 0
        assert r["speedup"] == pytest.approx(r["torch_s"] / r["fsdp_rs_s"])
        assert r["frac_of_copy"] == pytest.approx(r["copy_s"] / r["fsdp_rs_s"])
        assert r["fsdp_rs_gbps"] == pytest.approx(r["bytes"] / r["fsdp_rs_s"] / 1e9)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    stdout = capsys.readouterr().out
    texts = ("frac of copy", "speedup", "host us", "alias", "scale 0.002", "param bfloat16")
    for text in (*texts, "CPU impls"):
        assert text in stdout
    assert stdout.count("reduce_scatter_copy_in") == 5


def test_copy_fp16_reduce_divides(tmp_path: Path) -> None:
    """A float16 reduction pre- and post-divides on both sides, and the results agree."""
    out_json = tmp_path / "copy.json"
    argv = [*TINY, "--case", "c", "--case", "a", "--scale", "0.001", "--dtypes", "fp32,fp16,fp16"]
    assert _copy([*argv, "--json", str(out_json)]) == 0
    records = json.loads(out_json.read_text())
    assert [r["case"] for r in records[::5]] == ["c", "a"]
    factors = {r["op"]: r["divide_factor"] for r in records}
    assert factors["reduce_scatter_copy_in"] == 4.0 and factors["post_reduce"] == 2.0
    assert all(r["outputs_equal"] for r in records)
    assert all(r["reduce_dtype"] == "float16" for r in records)
    assert "div_" in records[2]["torch_impl"]


def test_copy_default_scale_and_device(monkeypatch, tmp_path: Path, capsys) -> None:
    import torch

    copy = _copy_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(copy, "CPU_DEFAULT_SCALE", 0.001)
    out_json = tmp_path / "copy.json"
    assert _copy(["--case", "d", "--repeat", "1", "--dtypes", "bf16", "--json", str(out_json)]) == 0
    records = json.loads(out_json.read_text())
    assert {(r["device"], r["scale"], r["param_dtype"]) for r in records} == {
        ("cpu", 0.001, "bfloat16")
    }
    assert "scale 0.001" in capsys.readouterr().out


def test_copy_mismatch_exits_nonzero(monkeypatch, capsys) -> None:
    monkeypatch.setattr(_copy_module(), "_same", lambda a, b: False)
    assert _copy([*TINY, "--case", "c", "--scale", "0.001"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "differ" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--case", "f"],
        ["--case", "e", "--world-size", "3"],
        ["--scale", "0"],
        ["--scale", "1.5"],
        ["--scale", "abc"],
        ["--dtypes", "fp64"],
        ["--dtypes", "fp32,bf16"],
        ["--world-size", "0"],
        ["--repeat", "0"],
        ["--device", "tpu"],
    ],
)
def test_copy_bad_input_is_argparse_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _copy(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_copy_cuda_unavailable_or_no_matplotlib(monkeypatch, tmp_path: Path, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        _copy(["--device", "cuda"])
    assert exc.value.code == 2 and "CUDA" in capsys.readouterr().err

    monkeypatch.setattr(report, "matplotlib_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        _copy([*TINY, "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2 and "pip install matplotlib" in capsys.readouterr().err
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot_copy_speedups([], tmp_path / "p.png")


def test_copy_cases(capsys) -> None:
    copy = _copy_module()
    assert cli.COPY_CASES == tuple(copy.CASES)
    with pytest.raises(SystemExit):
        cli.main(["copy", "--help"])
    assert f"1/{round(1 / copy.CPU_DEFAULT_SCALE)}" in capsys.readouterr().out
    full = {key: copy.make_case(key) for key in copy.CASES}
    assert full["a"].shapes == ((8192, 8192),) * 8 and full["a"].numel == 8 * 2**26
    assert len(full["b"].shapes) == 9 and full["b"].numel == 4 * 4096**2 + 3 * 11008 * 4096 + 8192
    assert full["c"].shapes == ((4096,),) * 10_000
    assert len(full["d"].shapes) == 6_000 and full["d"].numel * 4 < 2**30  # fp32 under 1 GiB
    assert copy.make_case("a", 1 / 64).shapes[0] == (128, 8192)
    assert copy.make_case("b", 1 / 64).shapes[:2] == ((64,), (64, 4096))
    assert len(copy.make_case("c", 1e-3).shapes) == 100
    assert len(copy.make_case("d", 1e-3).shapes) == 102
    assert full["e"].shapes == ((8, 2048, 1024),) * 3 and full["e"].dims == (1, 1, 1)
    assert copy.make_case("e", 1e-3).shapes[0] == (8, 64, 1024)  # dim 1: a multiple of 64
    assert full["a"].dims == ()
    for bad in ({"key": "f"}, {"key": "a", "scale": 0}, {"key": "a", "scale": 2}):
        with pytest.raises(ValueError):
            copy.make_case(**bad)


def test_fsdp2_divide_factors_match_torch() -> None:
    import torch

    copy = _copy_module()
    collectives = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    torch_factors = getattr(collectives, "_get_gradient_divide_factors", None)
    if torch_factors is None:
        pytest.skip("torch has no _get_gradient_divide_factors")

    class Group:
        def __init__(self, size: int) -> None:
            self._size = size

        def size(self) -> int:
            return self._size

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for w in (1, 2, 3, 6, 8, 12, 64, 96):
            pre, post, *_ = torch_factors(Group(w), None, dtype, "cuda")
            assert copy.fsdp2_divide_factors(dtype, w) == (pre or 1.0, post or 1.0), (dtype, w)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_copy_cuda(tmp_path: Path) -> None:
    out_json = tmp_path / "copy.json"
    assert (
        _copy(["--device", "cuda", "--scale", "0.01", "--repeat", "3", "--json", str(out_json)])
        == 0
    )
    records = json.loads(out_json.read_text())
    ops = {r["op"] for r in records}
    assert len(ops) == 5 and len(records) == len(ops) * len(_copy_module().CASES)
    assert all(r["outputs_equal"] for r in records)
    assert all(r["device"] == "cuda" for r in records)


def test_time_call_without_collect(monkeypatch) -> None:
    import gc

    def no_collect() -> None:
        raise AssertionError("collect=False must not run gc.collect")

    monkeypatch.setattr(gc, "collect", no_collect)
    timing, result = time_call(lambda: 7, repeat=2, warmup=1, collect=False)
    assert result == 7 and len(timing.seconds) == 2 and gc.isenabled()


# ----------------------------------------------------------------------------- memory


def test_memory_cli_prints_and_records_the_predicted_peak(tmp_path, capsys):
    """``bench memory``: every phase side by side, and on the peak row the
    planner's prediction (made before the first step) with its error."""
    path = tmp_path / "memory.json"
    argv = ["memory", "--world-size", "2", "--dim", "512", "--layers", "2"]
    assert (
        cli.main([*argv, "--config", "fp32", "--config", "frozen_weights", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    records = json.loads(path.read_text())
    assert [(r["config"], r["phase"]) for r in records] == [
        (c, p)
        for c in ("fp32", "frozen_weights")
        for p in ("init", "forward", "peak", "optimizer", "zero_grad")
    ]
    for r in records:
        assert {
            "bench",
            "model",
            "config",
            "world_size",
            "phase",
            "fsdp_rs_bytes",
            "torch_bytes",
            "ratio",
        } <= set(r)
        assert r["bench"] == "memory" and r["world_size"] == 2
        assert r["ratio"] == pytest.approx(r["fsdp_rs_bytes"] / r["torch_bytes"])
        if r["phase"] == "peak":
            assert abs(r["predicted_bytes"] / r["fsdp_rs_bytes"] - 1) <= 0.05, r
            line = next(s for s in out.splitlines() if s.startswith(r["config"]) and " peak " in s)
            assert f"{r['predicted_bytes'] / 2**20:.2f}" in line
        else:
            assert r["predicted_bytes"] is None


def test_copy_several_world_sizes_and_mixes(tmp_path: Path, capsys) -> None:
    """--world-size and --dtypes repeat: one table and one set of records per
    (W, mix), every output compared with torch's; the fsdp-rs side is timed as
    the runtime calls it and once more through torch.ops.fsdp_rs."""
    out_json = tmp_path / "copy.json"
    argv = [*TINY, "--scale", "0.001", "--case", "c", "--case", "e", "--json", str(out_json)]
    mixes = ["--world-size", "2", "--world-size", "4", "--dtypes", "fp32,fp32,fp32"]
    assert _copy([*argv, *mixes, "--dtypes", "fp32,bf16,bf16"]) == 0
    records = json.loads(out_json.read_text())
    seen = {(r["world_size"], r["param_dtype"], r["reduce_dtype"]) for r in records}
    assert seen == {
        (w, p, r) for w in (2, 4) for p, r in (("float32", "float32"), ("bfloat16", "bfloat16"))
    }
    assert len(records) == 4 * 2 * len(_copy_module().OPS)
    assert all(r["outputs_equal"] for r in records)
    assert capsys.readouterr().out.count("host us via torch.ops") == 4


def test_sweep_copy_kernels_tool() -> None:
    """tools/sweep_copy_kernels.py (run by .ci/gpu): each launch setting it
    times writes what the kernel's own setting writes (under the interpreter)."""
    pytest.importorskip("triton")
    tool = Path(__file__).resolve().parents[1] / "tools" / "sweep_copy_kernels.py"
    env = _fresh_env(TRITON_INTERPRET="1")
    argv = [
        "--device",
        "cpu",
        "--scale",
        "0.001",
        "--world-size",
        "4",
        "--case",
        "a",
        "--case",
        "e",
    ]
    proc = subprocess.run(
        [sys.executable, str(tool), *argv, "--case", "c", "--settings", "1024:2,1024:8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "BLOCK" in line]
    # cases a and c: copy-out and both copy-ins; case e: copy-out only (Shard(1));
    # 3 settings each
    assert len(rows) == 3 * (3 + 1 + 3), proc.stdout
    assert "DIFFERS" not in proc.stdout
    # [Note: Launch settings] case a's tiles are long (16Ki elements here), case c's
    # short; the rows come case by case in the order asked (a, e, c)
    from fsdp_rs.kernels import (
        _triton,
        all_gather_copy_out,
        reduce_scatter_copy_in,
        reduce_scatter_copy_in_flat,
    )

    firsts = rows[::3]
    kernels = (all_gather_copy_out, reduce_scatter_copy_in, reduce_scatter_copy_in_flat)
    for line, module in zip(firsts[:3], kernels, strict=True):
        assert "BLOCK {:>5} warps {:>2}".format(*module.LONG_TILES) in line, line
    for line in firsts[4:]:
        assert "BLOCK {:>5} warps {:>2}".format(*_triton.SMALL_TILES) in line, line


def test_launch_setting_by_tile_length() -> None:
    """[Note: Launch settings]: long tiles take the kernel's own setting, short ones
    the common one; the rule reads two host ints only."""
    from fsdp_rs.kernels._triton import LONG_TILE, SMALL_TILES, launch_setting

    assert launch_setting(LONG_TILE * 5, 5, (8192, 8)) == (8192, 8)
    assert launch_setting(LONG_TILE * 5 - 1, 5, (8192, 8)) == SMALL_TILES
    assert launch_setting(512 * 2500, 2500, (4096, 8)) == SMALL_TILES


def test_copy_steps_with_collectives(tmp_path: Path) -> None:
    """--steps: the ops with their collectives on a one-rank process group (gloo
    here; NCCL on a GPU), each step's result equal to FSDP2's sequence, in a
    fresh interpreter (the bench starts a default process group)."""
    env = _fresh_env()
    out_json = tmp_path / "steps.json"
    argv = [*TINY, "--scale", "0.001", "--world-size", "1", "--steps", "--case", "b"]
    argv += ["--case", "e", "--dtypes", "fp32,bf16,fp32", "--json", str(out_json)]
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rs.bench", "copy", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out_json.read_text())
    steps = [(r["case"], r["op"]) for r in records if r["op"].endswith("_step")]
    assert steps == [("b", "unshard_step"), ("b", "reduce_step")]  # none for Shard(1)
    assert all(r["outputs_equal"] for r in records)

    bad = subprocess.run(
        [sys.executable, "-m", "fsdp_rs.bench", "copy", *TINY, "--world-size", "2", "--steps"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "--world-size 1" in bad.stderr, bad.stderr
