"""Microbenchmarks users run: ``python -m fsdp_rs.bench <command>``.

``plan`` times the Rust planner (``fsdp_rs._core.plan_group`` / ``plan_flat``)
against the pure-Python reference on deterministic shape mixes (see
``fsdp_rs.bench.shapes``) and checks both give the same tables. ``copy`` times
the ``torch.ops.fsdp_rs`` group copies against the torch copies FSDP2 runs for
the same steps and a plain copy of the same bytes (``fsdp_rs.bench.copy``). Run
``python -m fsdp_rs.bench --help`` for the commands and their options.
"""

from fsdp_rs.bench.cli import main

__all__ = ["main"]
