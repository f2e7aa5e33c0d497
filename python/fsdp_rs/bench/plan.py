"""``plan`` benchmark: Rust planner vs the pure-Python reference, one record per ``N``.

Both planners get the same ``(ndims, dims)`` arrays and are timed end to end
from Python: the call plus reading every table attribute once (zero-copy for
the Rust plan). Outputs are checked with the reference's own comparison.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fsdp_rs import _core
from fsdp_rs.bench.shapes import make_shapes
from fsdp_rs.bench.timing import Timing, time_call

__all__ = [
    "FLAT_ALIGNED_NUMEL",
    "FLAT_TABLES",
    "GROUP_TABLES",
    "PlanRecord",
    "bench_plan",
    "environment",
]

ORIG_ELEM_SIZE = 4  # fp32 parameters
PARAM_ELEM_SIZE = 2  # bf16 all-gather
REDUCE_ELEM_SIZE = 4  # fp32 reduce-scatter
FLAT_ALIGNED_NUMEL = 16 // PARAM_ELEM_SIZE  # FSDP1 use_orig_params=True alignment

GROUP_TABLES = (
    "dim_offsets",
    "numel",
    "chunk_rows",
    "sharded_rows",
    "sharded_numel",
    "padded_sharded_numel",
    "sharded_sizes",
    "padded_sharded_sizes",
    "contiguous_strides",
    "post_forward_sizes",
    "row_offsets",
    "split_sizes",
    "unsharded_offsets",
    "tile_param",
    "tile_start",
    "tile_len",
)
FLAT_TABLES = (
    "flat_offsets",
    "numel",
    "in_shard",
    "offset_in_shard",
    "numel_in_shard",
    "intra_param_start",
    "intra_param_end",
)
MAX_REPORTED_DIFFERENCES = 10


@dataclass
class PlanRecord:
    """One benchmark row; times are seconds per plan (median of the repeats)."""

    n_params: int
    world_size: int
    rank: int
    shape_mix: str
    total_elements: int
    shape_gen_s: float
    repeat: int
    reference_repeat: int
    # FSDP2 group plan (plan_group)
    fsdp_rs_s: float
    fsdp_rs_best_s: float
    reference_s: float | None
    speedup: float | None
    plan_bytes: int
    plan_bytes_per_param: float
    outputs_equal: bool | None
    # FSDP1 flat metadata (plan_flat)
    flat_fsdp_rs_s: float
    flat_fsdp_rs_best_s: float
    flat_reference_s: float | None
    flat_speedup: float | None
    flat_plan_bytes_per_param: float
    flat_outputs_equal: bool | None
    differences: list[str]
    """First few mismatches reported by the reference comparison (empty when equal)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _touch(plan: Any, tables: tuple[str, ...]) -> Any:
    for name in tables:
        getattr(plan, name)
    return plan


def _group_call(planner: Any, ndims: np.ndarray, dims: np.ndarray, w: int, rank: int) -> Callable:
    def call() -> Any:
        plan = planner.plan_group(
            ndims,
            dims,
            w,
            rank,
            orig_elem_size=ORIG_ELEM_SIZE,
            param_elem_size=PARAM_ELEM_SIZE,
            reduce_elem_size=REDUCE_ELEM_SIZE,
        )
        return _touch(plan, GROUP_TABLES)

    return call


def _flat_call(planner: Any, ndims: np.ndarray, dims: np.ndarray, w: int, rank: int) -> Callable:
    def call() -> Any:
        plan = planner.plan_flat(ndims, dims, w, rank, aligned_numel=FLAT_ALIGNED_NUMEL)
        return _touch(plan, FLAT_TABLES)

    return call


def _reference() -> Any:
    from fsdp_rs.planning import reference

    return reference


def _differences(rust_plan: Any, ref_plan: Any) -> list[str]:
    """Mismatches between the plans, as reported by the reference's comparison helper."""
    return list(_reference().plan_differences(rust_plan, ref_plan))


def _speedup(reference: Timing | None, rust: Timing) -> float | None:
    if reference is None:
        return None
    return reference.median / rust.median if rust.median > 0 else float("inf")


def default_reference_repeat(n_params: int, repeat: int) -> int:
    """The reference takes seconds at ``N >= 1e5``: time it once there."""
    return repeat if n_params <= 10_000 else 1


def bench_plan(
    n_params: int,
    world_size: int,
    *,
    rank: int = 0,
    mix: str = "auto",
    seed: int = 0,
    repeat: int = 5,
    reference: bool = True,
    reference_repeat: int | None = None,
) -> PlanRecord:
    """Time ``plan_group`` and ``plan_flat`` on ``n_params`` shapes of ``mix``."""
    start = time.perf_counter()
    shapes = make_shapes(n_params, world_size, mix, seed)
    shape_gen_s = time.perf_counter() - start
    ndims, dims = shapes.ndims, shapes.dims
    if reference_repeat is None:
        reference_repeat = default_reference_repeat(n_params, repeat)

    rust_group_t, rust_group = time_call(
        _group_call(_core, ndims, dims, world_size, rank), repeat, warmup=1
    )
    rust_flat_t, rust_flat = time_call(
        _flat_call(_core, ndims, dims, world_size, rank), repeat, warmup=1
    )
    plan_bytes = int(rust_group.plan_bytes)
    flat_plan_bytes = int(rust_flat.plan_bytes)

    ref_group_t = ref_flat_t = None
    outputs_equal = flat_outputs_equal = None
    differences: list[str] = []
    if reference:
        ref = _reference()
        ref_group_t, ref_group = time_call(
            _group_call(ref, ndims, dims, world_size, rank), reference_repeat
        )
        group_diffs = _differences(rust_group, ref_group)
        del ref_group
        ref_flat_t, ref_flat = time_call(
            _flat_call(ref, ndims, dims, world_size, rank), reference_repeat
        )
        flat_diffs = _differences(rust_flat, ref_flat)
        del ref_flat
        outputs_equal, flat_outputs_equal = not group_diffs, not flat_diffs
        differences = [f"plan_group: {d}" for d in group_diffs] + [
            f"plan_flat: {d}" for d in flat_diffs
        ]
        differences = differences[:MAX_REPORTED_DIFFERENCES]

    per_param = max(n_params, 1)
    return PlanRecord(
        n_params=n_params,
        world_size=world_size,
        rank=rank,
        shape_mix=shapes.name,
        total_elements=shapes.total_elements,
        shape_gen_s=shape_gen_s,
        repeat=repeat,
        reference_repeat=reference_repeat if reference else 0,
        fsdp_rs_s=rust_group_t.median,
        fsdp_rs_best_s=rust_group_t.best,
        reference_s=ref_group_t.median if ref_group_t else None,
        speedup=_speedup(ref_group_t, rust_group_t),
        plan_bytes=plan_bytes,
        plan_bytes_per_param=plan_bytes / per_param,
        outputs_equal=outputs_equal,
        flat_fsdp_rs_s=rust_flat_t.median,
        flat_fsdp_rs_best_s=rust_flat_t.best,
        flat_reference_s=ref_flat_t.median if ref_flat_t else None,
        flat_speedup=_speedup(ref_flat_t, rust_flat_t),
        flat_plan_bytes_per_param=flat_plan_bytes / per_param,
        flat_outputs_equal=flat_outputs_equal,
        differences=differences,
    )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and machine, added to every JSON record."""
    return {
        "python_version": platform.python_version(),
        "numpy_version": np.__version__,
        "torch_version": _version("torch"),
        "fsdp_rs_version": getattr(_core, "__version__", None),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python_implementation": sys.implementation.name,
    }
