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


def test_python_dash_m(tmp_path: Path) -> None:
    """The documented entry point, in a fresh interpreter."""
    env = dict(os.environ)
    package_root = str(Path(fsdp_rs.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
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
