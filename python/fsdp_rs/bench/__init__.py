"""Microbenchmarks users run: ``python -m fsdp_rs.bench <command>``.

``plan`` times the Rust planner (``fsdp_rs._core.plan_group`` / ``plan_flat``)
against the pure-Python reference on deterministic shape mixes (see
``fsdp_rs.bench.shapes``) and checks both give the same tables. Run
``python -m fsdp_rs.bench --help`` for the commands and their options.
"""

from fsdp_rs.bench.cli import main

__all__ = ["main"]
