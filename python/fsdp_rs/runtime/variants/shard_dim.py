"""Parameters FSDP shards on a dim other than 0 (``shard_placement_fn``
returning ``Shard(d)``, e.g. stacked expert weights ``(E, d, h)`` on dim 1
when there are fewer experts than ranks).

[Note: Sharding on another dim]
FSDP2 chunks such a parameter on dim ``d`` (evenly: it refuses an uneven
``d > 0``, and so does fsdp-rs): rank ``r``'s local shard is the contiguous
``param.chunk(W, d)[r]``. Viewed as ``(pre, W, L)`` (``pre`` the product of the
dims before ``d``, ``L`` the chunk's size along ``d`` times the product of the
dims after it), the parameter's rank-``r`` slice ``[:, r, :]`` is exactly that
local shard, in its order. So the group is planned as if each parameter had
the shape ``(W, pre * L)`` sharded on dim 0: every rank's row holds its local
shard contiguously, and the sharded buffer, the all-gather, the reduce-scatter,
the gradient buffers and the flat optimizer are the plain group's. Only the
two copies between a row and the parameter's own layout differ: the copy-out
writes each parameter's all-gathered ``(W, pre, L)`` into its unsharded
``(pre, W, L)``, and the reduce-scatter copy-in reads its gradient the other
way round: the group's usual copy ops, given the table of each parameter's
``L`` ([Note: Chunked copies] in the copy-out kernel), one launch per group
that reads and writes each element once (FSDP2 all-gathers into a temporary
and chunk-concatenates it: one read and write more). The pre-placed gradient
buffer is not used for such a group: its layout would be the permuted one.
After forward, a group with ``reshard_after_forward=int`` reshards fully.

All of this is the group's sharding strategy, ``DimSharding`` (the
``Sharding`` interface of ``runtime/group/sharding.py``); ``ShardDimGroup`` is
an ``FSDPParamGroup`` built with one, and adds nothing else.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_rs.runtime.api.errors import FSDPUsageError
from fsdp_rs.runtime.group.param_group import FSDPParamGroup
from fsdp_rs.runtime.group.sharding import Sharding

__all__ = ["DimSharding", "ShardDimGroup", "check_shard_dim"]


def _contiguous(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def check_shard_dim(fqn: str, shape: torch.Size, dim: int, world: int) -> int:
    """The non-negative shard dim FSDP2 would use for ``Shard(dim)``, checked."""
    ndim = len(shape)
    if dim < 0:
        dim += ndim
    if not 0 <= dim < max(ndim, 1):
        raise FSDPUsageError(
            f"Shard dim {dim} is invalid for {ndim}D tensor: {tuple(shape)} (parameter {fqn}); "
            "shard_placement_fn must return Shard(d) with -ndim <= d < ndim"
        )
    if dim > 0 and shape[dim] % world != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {tuple(shape)} (world size: "
            f"{world}) (parameter {fqn}); return Shard(0) for it, or a dim divisible by "
            f"{world}"
        )
    return dim


class DimSharding(Sharding):
    """Parameters FSDP shards on ``dims[i] > 0``, planned as ``(W, numel / W)``
    rows; see [Note: Sharding on another dim]. One per group: it keeps the full
    and local shapes and its caches of specs and chunk tables."""

    preplaces_grads = False  # the gradient buffer's layout would be the permuted one

    def __init__(self, dims: list[int]) -> None:
        self.dims = dims
        self._specs: dict = {}  # (param, dtype) -> DTensorSpec
        self._chunk_tables: dict = {}  # params (None: all) -> chunk_numel table
        self.full_shapes: list[torch.Size] = []
        self.local_shapes: list[torch.Size] = []
        self._pre_len: list[tuple[int, int]] = []  # (pre, L) per parameter

    def planned_shapes(self, group, shapes: list[torch.Size]) -> list[torch.Size]:
        world = group.info.shard_size
        self.full_shapes = list(shapes)
        self.local_shapes = []
        self._pre_len = []
        for shape, d in zip(shapes, self.dims, strict=True):
            local = list(shape)
            local[d] //= world
            self.local_shapes.append(torch.Size(local))
            self._pre_len.append((math.prod(shape[:d]), local[d] * math.prod(shape[d + 1 :])))
        return [torch.Size((world, math.prod(s) // world)) for s in shapes]

    def unsharded_shapes(self, group) -> tuple[list, list]:
        return self.full_shapes, list(map(_contiguous, self.full_shapes))

    def local_shape(self, group, i: int) -> torch.Size:
        return self.local_shapes[i]

    def spec_of(self, group, i: int, dtype: torch.dtype) -> DTensorSpec:
        nd = group.nd[i] if group.nd is not None else None
        if nd is not None:
            return nd.sharded_spec(dtype)
        cache = self._specs
        spec = cache.get((i, dtype))
        if spec is None:
            shape = self.full_shapes[i]
            placement = Shard(self.dims[i])
            placements = (placement,) if group.info.replicate_group is None else (
                Replicate(), placement
            )  # fmt: skip
            meta = TensorMeta(shape, _contiguous(shape), dtype)
            spec = cache[(i, dtype)] = DTensorSpec(group.info.mesh, placements, tensor_meta=meta)
        return spec

    def sharded_specs(self, group, dtype: torch.dtype) -> list[DTensorSpec]:
        return [self.spec_of(group, i, dtype) for i in range(len(self.full_shapes))]

    def local_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        offsets = group.layout.row_offsets
        return [
            buffer.as_strided(s, _contiguous(s), off)
            for s, off in zip(self.local_shapes, offsets, strict=True)
        ]

    def grad_views(self, group, buffer: torch.Tensor) -> list[torch.Tensor]:
        offsets = group.grad_layout.row_offsets
        shapes = [self.local_shapes[i] for i in group._grad_index]
        pairs = zip(shapes, offsets, strict=True)
        return [buffer.as_strided(s, _contiguous(s), o) for s, o in pairs]

    def fill_sharded(self, group, full, views) -> None:
        world, rank = group.info.shard_size, group.info.shard_rank
        for f, v, d in zip(full, views, self.dims, strict=True):
            v.copy_(f.chunk(world, d)[rank])

    def chunks(self, group, index: list[int] | None) -> torch.Tensor:
        """Made once per distinct set of params, on the group's device."""
        key = None if index is None else tuple(index)
        table = self._chunk_tables.get(key)
        if table is None:
            runs = [length for _, length in self._pre_len]
            if index is not None:
                runs = [runs[k] for k in index]
            table = torch.tensor(runs, dtype=torch.int64).to(group.device)
            self._chunk_tables[key] = table
        return table

    def copy_out(self, group, ag: torch.Tensor) -> None:
        args = group.tables.copy_out_args()
        group.ops.all_gather_copy_out(ag, [group.unsharded], *args, self.chunks(group, None))

    def copy_in(self, group, grads: list, rs_in: torch.Tensor, divide: float) -> None:
        # each gradient viewed as its planned (W, numel / W)
        world = group.info.shard_size
        grads = [None if g is None else g.reshape(world, -1) for g in grads]
        grad_layout = group.grad_layout
        chunks = self.grad_chunks(group, grad_layout, group._grad_index)
        args = grad_layout.tables.reduce_scatter_args()
        group.ops.reduce_scatter_copy_in(grads, rs_in, *args, divide, chunks)


class ShardDimGroup(FSDPParamGroup):
    """An ``FSDPParamGroup`` whose sharding is a ``DimSharding`` of ``dims``;
    see [Note: Sharding on another dim]. It overrides nothing: the class names
    such groups (``isinstance``, the traced hooks' checks)."""

    def __init__(self, *args, dims: list[int], **kwargs) -> None:
        super().__init__(*args, sharding=DimSharding(dims), **kwargs)
