"""Which CI leg runs which test.

[Note: CI legs]
CI runs the suite on three torch versions, one after the other on two cores:
the pinned torch of ``requirements-dev.txt`` (``.ci/test``), then the oldest
and the newest supported (``.ci/torch-range``). Each sets ``FSDP_RS_LEG``
(pinned, oldest, newest); every test runs in at least one leg, and without
``FSDP_RS_LEG`` (a plain ``pytest``) everything runs. Where the three legs
would repeat the same work, it is spread instead:

- in-process tests (planner, kernels, ops, fake process groups, compile in one
  process) run in every leg: they take seconds, and they are where torch
  versions differ in what is checked;
- tests on spawned gloo ranks (test modules using ``spawned.py``'s helpers:
  most of a leg's time) run at W = 2 in the oldest and the newest leg, the two
  ends of the supported range, and at W = 4 in the newest; the fuzzers' seeds
  at W = 2 alternate between those two legs (``fuzz_seeds``), and so do the
  whole-model compile scenarios of ``test_fullgraph.py`` (``spawned_share``:
  each is a compile of its own, a fifth of a leg's spawned time together);
- the benchmark CLIs' tests and the wheel build (tools, not the runtime) run in
  the newest leg, the torch a fresh ``pip install`` gets.

``python tools/ci_legs.py`` prints what each leg collects and checks that the
legs' union is the whole suite."""

from __future__ import annotations

import os

import pytest

LEGS = ("pinned", "oldest", "newest")
SPAWNED_LEGS = ("oldest", "newest")  # tests on spawned ranks, at W = 2
NEWEST_ONLY_FILES = (
    "test_bench.py",
    "test_bench_modules.py",
    "test_bench_training.py",
    "test_wheel.py",
)


def ci_leg() -> str | None:
    """The CI leg running (``FSDP_RS_LEG``), or None: everything runs."""
    leg = os.environ.get("FSDP_RS_LEG") or None
    if leg is not None and leg not in LEGS:
        raise pytest.UsageError(f"FSDP_RS_LEG={leg!r}: expected one of {', '.join(LEGS)}")
    return leg


def _uses_spawned_ranks(module) -> bool:
    """Whether a test module runs scenarios on spawned ranks: it holds a
    helper of ``spawned.py``."""
    return any(getattr(v, "__module__", None) == "spawned" for v in vars(module).values())


def legs_of(item) -> tuple[str, ...]:
    """The CI legs that run the test ``item``."""
    if item.path.name in NEWEST_ONLY_FILES:
        return ("newest",)
    if "W4" in item.name or "w4" in item.name:  # 4 ranks on 2 cores
        return ("newest",)
    module = getattr(item, "module", None)
    if module is not None and _uses_spawned_ranks(module):
        return SPAWNED_LEGS
    return LEGS


def select(items: list) -> tuple[list, list]:
    """(kept, deselected) of ``items`` for the CI leg running; all kept outside CI."""
    leg = ci_leg()
    if leg is None:
        return items, []
    keep, drop = [], []
    for item in items:
        (keep if leg in legs_of(item) else drop).append(item)
    return keep, drop


def spawned_share(names: list[str]) -> list[str]:
    """The W = 2 scenarios of a spawned module that spreads its own (each a
    long compile: ``test_fullgraph.py``) for the CI leg running: alternate ones
    in the first and the second of ``SPAWNED_LEGS``; all of them outside CI."""
    leg = ci_leg()
    if leg not in SPAWNED_LEGS:
        return list(names)
    share = SPAWNED_LEGS.index(leg)
    return [n for i, n in enumerate(names) if i % len(SPAWNED_LEGS) == share]


def fuzz_seeds(seeds: dict[int, range]) -> dict[int, list[int]]:
    """A fuzzer's seeds per world size for the CI leg running: at W = 2, the
    even seeds in the first leg of ``SPAWNED_LEGS`` and the odd ones in the
    second (all of them outside CI); other world sizes run in one leg whole."""
    leg = ci_leg()
    out = {w: list(s) for w, s in seeds.items()}
    if leg in SPAWNED_LEGS and 2 in out:
        share = SPAWNED_LEGS.index(leg)
        out[2] = [s for s in out[2] if s % len(SPAWNED_LEGS) == share]
    return out
