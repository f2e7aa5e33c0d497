"""What a parameter group derives from its parameters' shapes and dtypes and
its place in the mesh alone, made once and shared by every group that has the
same.

[Note: Shared group layouts]
Models with very many parameter tensors get them from many identical layers:
every block of a transformer has the same shapes in the same order. A group's
plan, its tables (the copy ops' arguments), the per-parameter strides and
sharded sizes, and the columns its shard fill scatters into depend on nothing
else, so the groups of identical blocks share one ``GroupLayout``: one planner
call, one set of table tensors (and so one cached CPU gather index, see
[Note: Cached CPU indices]), one set of lists. Everything in it is read-only.
Layouts are held by their groups and dropped with the last of them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import plan_group, shapes_to_arrays

__all__ = ["GroupLayout", "LayoutKey", "group_layout"]


class LayoutKey(NamedTuple):
    """All a group's layout depends on."""

    shapes: tuple[torch.Size, ...]
    orig_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    shard_size: int
    shard_rank: int
    post_forward_size: int | None
    device: torch.device


class GroupLayout:
    """The plan of a group and what follows from it; see [Note: Shared group
    layouts]. ``strides[i]`` and ``sharded_sizes[i]`` are parameter ``i``'s
    contiguous strides and this rank's shard size, as tuples."""

    __slots__ = (
        "__weakref__",
        "_fill_columns",
        "first_dims",
        "plan",
        "row_offsets",
        "sharded_sizes",
        "strides",
        "tables",
    )

    def __init__(self, key: LayoutKey) -> None:
        shapes = key.shapes
        ndims, dims = shapes_to_arrays(shapes)
        self.first_dims = dims[np.cumsum(ndims) - ndims]
        self.plan = plan_group(
            ndims,
            dims,
            key.shard_size,
            key.shard_rank,
            orig_elem_size=key.orig_dtype.itemsize,
            param_elem_size=key.param_dtype.itemsize,
            reduce_elem_size=key.reduce_dtype.itemsize,
            post_forward_world_size=key.post_forward_size,
        )
        self.tables = GroupTables.from_plan(self.plan, key.device)
        self.row_offsets: list[int] = self.plan.row_offsets.tolist()
        self.strides, self.sharded_sizes = self._per_param_layouts(shapes)
        self._fill_columns: torch.Tensor | None = None

    def _per_param_layouts(
        self, shapes: Sequence[torch.Size]
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Both are functions of the param's shape, so they are read from the
        plan once per distinct shape and looked up per param in C (``map`` over
        a dict)."""
        plan = self.plan
        # Distinct shapes -> index of their first param (later duplicates are
        # overwritten by earlier ones: the pairs are fed in reverse).
        first = dict(zip(reversed(shapes), range(len(shapes) - 1, -1, -1), strict=True))
        bounds = plan.dim_offsets.tolist()
        strides, sizes = plan.contiguous_strides.tolist(), plan.sharded_sizes.tolist()
        stride_of, size_of = {}, {}
        for shape, i in first.items():
            stride_of[shape] = tuple(strides[bounds[i] : bounds[i + 1]])
            size_of[shape] = tuple(sizes[bounds[i] : bounds[i + 1]])
        return list(map(stride_of.__getitem__, shapes)), list(map(size_of.__getitem__, shapes))

    def sharded_numels(self) -> list[int]:
        """This rank's shard of each parameter, in elements."""
        return [math.prod(size) for size in self.sharded_sizes]

    def fill_columns(self) -> torch.Tensor:
        """Column in the row of every element of this rank's padded chunks laid
        back to back (what ``torch._chunk_cat`` gives): param ``p``'s ``n``
        elements start at ``row_offsets[p]`` instead of at the running sum of
        the ``n``'s. A CPU int64 tensor, made at the first call."""
        if self._fill_columns is None:
            padded = self.plan.padded_sharded_numel
            shift = self.plan.row_offsets - (np.cumsum(padded) - padded)
            cols = np.arange(int(padded.sum())) + np.repeat(shift, padded)
            self._fill_columns = torch.from_numpy(cols)
        return self._fill_columns


_LAYOUTS: weakref.WeakValueDictionary[tuple, GroupLayout] = weakref.WeakValueDictionary()


def group_layout(key: LayoutKey) -> GroupLayout:
    """The layout for ``key``: the one a live group already uses, or a new one."""
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = GroupLayout(key)
        _LAYOUTS[key] = layout
    return layout
