"""Output of benchmark records: text tables, JSON, and plots (matplotlib, lazily)."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MATPLOTLIB_HINT",
    "copy_table",
    "format_table",
    "matplotlib_available",
    "modules_table",
    "plan_tables",
    "plot_copy_speedups",
    "plot_plan_times",
    "write_json",
]

MATPLOTLIB_HINT = "--plot needs matplotlib: pip install matplotlib (or pip install 'fsdp-rs[plot]')"

Record = Mapping[str, Any]


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns under a header and a rule."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _per_param_ns(seconds: float | None, n: int) -> float | None:
    return None if seconds is None else seconds / max(n, 1) * 1e9


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _per(seconds: float | None, count: int) -> float | None:
    """Microseconds per item (None stays None: a column not timed)."""
    return None if seconds is None else seconds / count * 1e6


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _plan_rows(records: Sequence[Record], prefix: str) -> list[list[str]]:
    rows = []
    for r in records:
        n = r["n_params"]
        rust, ref = r[f"{prefix}fsdp_rs_s"], r[f"{prefix}reference_s"]
        rows.append(
            [
                _fmt(n, "d"),
                _fmt(r["world_size"], "d"),
                _fmt(_ms(rust), ".3f"),
                _fmt(_per_param_ns(rust, n), ".1f"),
                _fmt(_ms(ref), ".1f"),
                _fmt(_per_param_ns(ref, n), ".0f"),
                _fmt(r[f"{prefix}speedup"], ".1f"),
                _fmt(r[f"{prefix}plan_bytes_per_param"], ".1f"),
                _fmt(r[f"{prefix}outputs_equal"], ""),
            ]
        )
    return rows


_PLAN_HEADERS = (
    "n_params",
    "W",
    "fsdp-rs ms",
    "ns/param",
    "reference ms",
    "ns/param",
    "speedup",
    "plan B/param",
    "equal",
)


def plan_tables(records: Sequence[Record]) -> str:
    """The FSDP2 ``plan_group`` table, then the FSDP1 ``plan_flat`` table."""
    parts = []
    for title, prefix in (
        ("plan_group (FSDP2 group plan)", ""),
        ("plan_flat (FSDP1 flat metadata)", "flat_"),
    ):
        parts.append(title)
        parts.append(format_table(_PLAN_HEADERS, _plan_rows(records, prefix)))
        parts.append("")
    return "\n".join(parts).rstrip("\n")


_COPY_HEADERS = (
    "case",
    "op",
    "n_params",
    "MB moved",
    "fsdp-rs ms",
    "GB/s",
    "frac of copy",
    "torch ms",
    "speedup",
    "host us",
    "torch host us",
    "host us via torch.ops",
)


def copy_table(records: Sequence[Record]) -> str:
    """One row per (case, op) of the ``copy`` benchmark."""
    rows = [
        [
            r["case"],
            r["op"],
            _fmt(r["n_params"], "d"),
            _fmt(r["bytes"] / 1e6, ".1f"),
            "alias" if r.get("aliases") else _fmt(_ms(r["fsdp_rs_s"]), ".3f"),
            _fmt(r["fsdp_rs_gbps"], ".1f"),
            _fmt(r["frac_of_copy"], ".2f"),
            _fmt(_ms(r["torch_s"]), ".3f"),
            _fmt(r["speedup"], ".2f"),
            _fmt(_us(r.get("fsdp_rs_host_s")), ".0f"),
            _fmt(_us(r.get("torch_host_s")), ".0f"),
            _fmt(_us(r.get("fsdp_rs_dispatch_host_s")), ".0f"),
        ]
        for r in records
    ]
    return format_table(_COPY_HEADERS, rows)


def init_table(records: Sequence[Record]) -> str:
    """``bench init``: fully_shard seconds per N, and per parameter; the
    floor's beside them ([Note: The floor])."""
    headers = ["n_params", "groups", "fsdp-rs s", "us/param", "torch s", "us/param", "speedup"]
    headers += ["floor s", "us/param"]
    rows = []
    for r in records:
        n, ours, theirs, floor = r["n_params"], r["fsdp_rs_s"], r["torch_s"], r.get("floor_s")
        rows.append(
            [
                str(n),
                str(r["groups"]),
                _fmt(ours, ".3f"),
                _fmt(_per(ours, n), ".1f"),
                _fmt(theirs, ".3f"),
                _fmt(_per(theirs, n), ".1f"),
                _fmt(r["speedup"], ".1f"),
                _fmt(floor, ".3f"),
                _fmt(_per(floor, n), ".1f"),
            ]
        )
    return format_table(headers, rows)


def step_table(records: Sequence[Record]) -> str:
    """``bench step``: step times, and the bookkeeping overhead per step, per
    parameter and per group: fsdp-rs and torch FSDP2 per block, fsdp-rs
    with ``auto_shard``'s groups (their count beside it), and the floor's
    overhead per block ([Note: The floor]; without the optimizer step only)."""
    headers = [
        "n_params",
        "groups",
        "unsharded ms",
        "fsdp-rs ms",
        "torch ms",
        "fsdp-rs overhead ms",
        "us/param",
        "us/group",
        "torch overhead ms",
        "us/param",
        "us/group",
        "speedup",
        "rounds: min-max",
        "auto ms",
        "auto groups",
        "floor overhead ms",
        "us/group",
    ]
    rows = []
    for r in records:
        n, g = r["n_params"], r["groups"]
        per_round = [x for x in r.get("round_speedups", ()) if x is not None]
        spread = f"{min(per_round):.1f}-{max(per_round):.1f}" if per_round else "-"
        torch_groups = r.get("torch_groups") or g
        rows.append(
            [
                str(n),
                str(g),
                _fmt(_ms(r["unsharded_step_s"]), ".1f"),
                _fmt(_ms(r["fsdp_rs_step_s"]), ".1f"),
                _fmt(_ms(r["torch_step_s"]), ".1f"),
                _fmt(_ms(r["fsdp_rs_s"]), ".1f"),
                _fmt(_per(r["fsdp_rs_s"], n), ".2f"),
                _fmt(_per(r["fsdp_rs_s"], g), ".1f"),
                _fmt(_ms(r["torch_s"]), ".1f"),
                _fmt(_per(r["torch_s"], n), ".2f"),
                _fmt(_per(r["torch_s"], torch_groups), ".1f"),
                _fmt(r["speedup"], ".1f"),
                spread,
                _fmt(_ms(r.get("fsdp_rs_auto_step_s")), ".1f"),
                str(r.get("auto_groups", "-")),
                _fmt(_ms(r.get("floor_s")), ".1f"),
                _fmt(_per(r.get("floor_s"), r.get("floor_groups") or g), ".1f"),
            ]
        )
    return format_table(headers, rows)


def modules_table(records: Sequence[Record]) -> str:
    """``bench modules``: one row per column (rank 0's loss and collectives)."""
    headers = [
        "column",
        "groups",
        "step ms",
        "x DDP",
        "all-gathers",
        "reduce-scatters",
        "all-reduces",
        "peak KiB (r0/r1)",
        "final loss",
        "loss equal",
    ]
    rows = []
    for r in records:
        peaks = r.get("peak_bytes") or []
        peak = "/".join("-" if b is None else f"{b / 1024:.0f}" for b in peaks) or "-"
        rows.append(
            [
                r["column"],
                _fmt(r["groups"], "d"),
                _fmt(_ms(r["step_s"]), ".2f"),
                _fmt(r["ratio_to_ddp"], ".2f"),
                _fmt(r["all_gathers"], "d"),
                _fmt(r["reduce_scatters"], "d"),
                _fmt(r["all_reduces"], "d"),
                peak,
                _fmt(r["final_loss"], ".9g"),
                _fmt(r["losses_equal"], ""),
            ]
        )
    return format_table(headers, rows)


def write_json(records: Sequence[Record], path: str | Path) -> None:
    """A JSON list of the records (strict JSON: no NaN or Infinity)."""
    text = json.dumps(list(records), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n")


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _agg_figure(figsize: tuple[float, float]) -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot, no global backend)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(MATPLOTLIB_HINT) from e
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_copy_speedups(records: Sequence[Record], path: str | Path) -> None:
    """Bars of the ``copy`` benchmark's speedup over torch, grouped by case, one bar per op."""
    fig = _agg_figure((8, 4.5))
    ax = fig.add_subplot()
    cases = list(dict.fromkeys(r["case"] for r in records))
    ops = list(dict.fromkeys(r["op"] for r in records))
    width = 0.8 / max(len(ops), 1)
    for j, op in enumerate(ops):
        points = [
            (cases.index(r["case"]) + (j - (len(ops) - 1) / 2) * width, r["speedup"])
            for r in records
            if r["op"] == op and r["speedup"] is not None
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.bar(xs, ys, width=width, label=op, color=f"C{j}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_yscale("log")
    ax.set_xlabel("case")
    ax.set_ylabel("speedup over torch (torch s / fsdp-rs s)")
    title = "fsdp-rs copy ops vs FSDP2's torch copies"
    if records:
        r = records[0]
        title += f" ({r['device']}, W={r['world_size']})"
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def plot_plan_times(records: Sequence[Record], path: str | Path) -> None:
    """Log-log seconds per plan against ``n_params``, fsdp-rs vs reference, per world size.

    Draws with matplotlib's Agg canvas directly (no pyplot, no global backend).
    """
    fig = _agg_figure((7, 4.5))
    ax = fig.add_subplot()
    series = (
        ("fsdp-rs plan_group", "fsdp_rs_s", "C0", "-"),
        ("reference plan_group", "reference_s", "C1", "-"),
        ("fsdp-rs plan_flat", "flat_fsdp_rs_s", "C0", "--"),
        ("reference plan_flat", "flat_reference_s", "C1", "--"),
    )
    world_sizes = sorted({r["world_size"] for r in records})
    markers = "os^vD<>"
    for i, w in enumerate(world_sizes):
        rows = sorted((r for r in records if r["world_size"] == w), key=lambda r: r["n_params"])
        for label, key, color, style in series:
            points = [(r["n_params"], r[key]) for r in rows if r[key] is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            suffix = f" (W={w})" if len(world_sizes) > 1 else ""
            ax.plot(
                xs,
                ys,
                linestyle=style,
                color=color,
                marker=markers[i % len(markers)],
                label=label + suffix,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters in the group (N)")
    ax.set_ylabel("seconds per plan (from Python)")
    title = "fsdp-rs planner vs pure-Python reference"
    if len(world_sizes) == 1:
        title += f", W={world_sizes[0]}"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
