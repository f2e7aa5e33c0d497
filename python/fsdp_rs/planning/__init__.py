"""The sharding planner: one Rust call per parameter group computes every table.

``plan_group`` / ``plan_flat`` / ``peak_memory`` are the Rust implementations
(``fsdp_rs._core``); ``fsdp_rs.planning.reference`` is the pure-Python
reference they are tested and benchmarked against. ``shapes_to_arrays`` turns
a list of shapes into the flat int64 arrays both take.
"""

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

from fsdp_rs._core import FlatPlan, GroupPlan, peak_memory, plan_flat, plan_group

__all__ = [
    "FlatPlan",
    "GroupPlan",
    "peak_memory",
    "plan_flat",
    "plan_group",
    "shapes_to_arrays",
]


def shapes_to_arrays(shapes: Iterable[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(ndims, dims)`` int64 arrays for a list of shapes (``torch.Size`` works)."""
    shapes = shapes if isinstance(shapes, list | tuple) else list(shapes)
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    dims = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=int(ndims.sum()))
    return ndims, dims
