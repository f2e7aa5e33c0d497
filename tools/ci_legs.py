"""What each CI leg runs ([Note: CI legs] in ``tests/ci_legs.py``): collects the
suite without a leg and with each ``FSDP_RS_LEG``, prints the counts, and
exits 1 if a test collected without a leg is collected by no leg.

    python tools/ci_legs.py [pytest arguments, e.g. tests/test_fuzz.py]

Run it with the interpreter of a leg's virtualenv; the legs are collected on
that torch (a test a torch version skips at collection is counted as skipped
alike in every leg)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGS = ("pinned", "oldest", "newest")


def collect(leg: str | None, args: list[str]) -> set[str]:
    env = dict(os.environ)
    env.pop("FSDP_RS_LEG", None)
    if leg is not None:
        env["FSDP_RS_LEG"] = leg
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    ids = {line for line in out.stdout.splitlines() if "::" in line}
    if out.returncode not in (0, 5) or not ids:
        sys.exit(f"collection failed (leg {leg}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def main(args: list[str]) -> int:
    everything = collect(None, args)
    legs = {leg: collect(leg, args) for leg in LEGS}
    print(f"no leg (plain pytest): {len(everything)} tests")
    for leg, ids in legs.items():
        print(f"FSDP_RS_LEG={leg}: {len(ids)} tests")
    union = set().union(*legs.values())
    print(
        f"union of the legs: {len(union)} tests; run by 2 or more legs: "
        f"{sum(sum(i in ids for ids in legs.values()) > 1 for i in union)}"
    )
    missing = sorted(everything - union)
    extra = sorted(union - everything)
    for name in missing[:20]:
        print(f"  in no leg: {name}")
    for name in extra[:20]:
        print(f"  in a leg, not in the suite: {name}")
    return 1 if missing or extra else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
