"""How a group's parameters map onto the rows of its layout: the ``Sharding``
interface a group holds (``group.sharding``), and ``Dim0Sharding``, FSDP2's
default ``Shard(0)``. The other one, ``Shard(d)`` for ``d > 0``, is
``variants.shard_dim.DimSharding`` ([Note: Sharding on another dim]).

A sharding decides the shapes the group is planned in, the shapes of the local
shards and of the unsharded parameters, the DTensor specs, the views of a
row-layout buffer, and the two copies between the rows and the parameters'
own layout (the copy-out after the all-gather, the reduce-scatter copy-in).
Everything else (the buffers, the collectives, the gradient side) is the
group's own. Its methods take the group as their first argument: a sharding
holds no reference to its group.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["DIM0", "Dim0Sharding", "Sharding"]


def _views(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    """This rank's shard of each of ``layout``'s params in a buffer of its rows."""
    return list(map(buffer.as_strided, layout.sharded_sizes, layout.strides, layout.row_offsets))


class Sharding(abc.ABC):
    """Where a group's parameters sit in its rows; see the module docstring.

    ``dims``: the dim FSDP shards each parameter on (None: all 0).
    ``preplaces_grads``: whether the pre-placed gradient buffer ([Note:
    Pre-placed gradients]) can be used: only where a gradient's layout is its
    rows' layout."""

    dims: list[int] | None = None
    preplaces_grads = True

    @abc.abstractmethod
    def planned_shapes(self, group, shapes: list[torch.Size]) -> list[torch.Size]:
        """The shapes the group is planned in, from the parameters' own (called
        once, in ``FSDPParamGroup.__init__``)."""

    @abc.abstractmethod
    def unsharded_shapes(self, group) -> tuple[list, list]:
        """(shapes, strides) of the unsharded parameters' local tensors."""

    @abc.abstractmethod
    def local_shape(self, group, i: int) -> torch.Size:
        """This rank's shard of parameter ``i``."""

    @abc.abstractmethod
    def spec_of(self, group, i: int, dtype: torch.dtype) -> DTensorSpec:
        """The spec of parameter ``i``'s sharded DTensor (or gradient) in ``dtype``."""

    @abc.abstractmethod
    def sharded_specs(self, group, dtype: torch.dtype) -> list[DTensorSpec]:
        """The spec of every sharded parameter in ``dtype``."""

    @abc.abstractmethod
    def local_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard of every param, viewed in a row-layout buffer."""

    @abc.abstractmethod
    def grad_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard of every trainable param, viewed in a buffer of the
        gradient layout ([Note: Gradient layout])."""

    @abc.abstractmethod
    def fill_sharded(self, group, full: Sequence[torch.Tensor], views: list) -> None:
        """Copy this rank's shard of every full parameter into ``views`` (its
        ``local_views`` of the sharded buffer)."""

    @abc.abstractmethod
    def copy_out(self, group, ag: torch.Tensor) -> None:
        """The all-gather output's rows into the group's unsharded buffer."""

    @abc.abstractmethod
    def copy_in(self, group, grads: list, rs_in: torch.Tensor, divide: float) -> None:
        """The gradients (None: zeros) into the reduce-scatter input's rows."""

    @abc.abstractmethod
    def chunks(self, group, index: list[int] | None) -> torch.Tensor | None:
        """The copies' ``chunk_numel`` table ([Note: Chunked copies] in the
        copy-out kernel) of the params at ``index`` (None: all), or None where
        the copies take none."""

    def grad_chunks(self, group, grad_layout, index: list[int]) -> torch.Tensor | None:
        """``chunks`` of ``grad_layout``, the gradient layout of the trainable
        params at ``index`` ([Note: Gradient layout]): the group's own table
        where it is the group's layout."""
        return self.chunks(group, None if grad_layout is group.layout else index)


class Dim0Sharding(Sharding):
    """FSDP2's default: every parameter sharded on dim 0, planned in its own
    shape ([Note: FSDP2 sharding rule]). Holds no state: one object, ``DIM0``,
    serves every such group."""

    def planned_shapes(self, group, shapes: list[torch.Size]) -> list[torch.Size]:
        return shapes

    def unsharded_shapes(self, group) -> tuple[list, list]:
        return group.shapes, group.strides

    def local_shape(self, group, i: int) -> torch.Size:
        return torch.Size(group.layout.sharded_sizes[i])

    def spec_of(self, group, i: int, dtype: torch.dtype) -> DTensorSpec:
        nd = group.nd[i] if group.nd is not None else None
        if nd is not None:
            return nd.sharded_spec(dtype)
        return group._specs(group.shapes[i], group.strides[i], dtype)

    def sharded_specs(self, group, dtype: torch.dtype) -> list[DTensorSpec]:
        """One spec per distinct shape where all are plain."""
        if group.nd is not None:
            return [self.spec_of(group, i, dtype) for i in range(len(group.shapes))]
        distinct = dict(zip(group.shapes, group.strides, strict=True))  # stride follows shape
        spec_of = {s: group._specs(s, st, dtype) for s, st in distinct.items()}
        return list(map(spec_of.__getitem__, group.shapes))

    def local_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        return _views(buffer, group.layout)

    def grad_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        return _views(buffer, group.grad_layout)

    def fill_sharded(self, group, full: Sequence[torch.Tensor], views: list) -> None:
        """``torch._chunk_cat`` (one C call, no per-param views) pads and chunks
        every param as FSDP2 shards them, giving all ranks' rows without the
        alignment gaps; this rank's row is then placed by one ``index_copy_``.
        It refuses empty tensors: a group with one takes the per-param path
        (C-level ``narrow`` then one ``_foreach_copy_``)."""
        plan, info = group.plan, group.info
        padded = plan.padded_sharded_numel
        if len(padded) and np.count_nonzero(padded) == len(padded):
            row = torch._chunk_cat(full, 0, info.shard_size)[info.shard_rank]
            row = row.to(group.sharded.device)
            if row.numel() == plan.row_numel:  # no gaps
                group.sharded.copy_(row)
            else:
                cols = group.layout.fill_columns().to(row.device)
                group.sharded.index_copy_(0, cols, row)
            return
        starts = np.minimum(plan.chunk_rows * info.shard_rank, group.layout.first_dims)
        sources = list(
            map(
                torch.Tensor.narrow,
                full,
                itertools.repeat(0),
                starts.tolist(),
                plan.sharded_rows.tolist(),
            )
        )
        torch._foreach_copy_(views, sources)

    def copy_out(self, group, ag: torch.Tensor) -> None:
        group.ops.all_gather_copy_out(ag, [group.unsharded], *group.tables.copy_out_args())

    def copy_in(self, group, grads: list, rs_in: torch.Tensor, divide: float) -> None:
        args = group.grad_layout.tables.reduce_scatter_args()
        group.ops.reduce_scatter_copy_in(grads, rs_in, *args, divide)

    def chunks(self, group, index: list[int] | None) -> None:
        return None


DIM0 = Dim0Sharding()
