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
way round, one strided copy per parameter that reads and writes each element
once (FSDP2 all-gathers into a temporary and chunk-concatenates it: one read
and write more). The pre-placed gradient buffer is not used for such a group:
its layout would be the permuted one. After forward, a group with
``reshard_after_forward=int`` reshards fully.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_rs.runtime.errors import FSDPUsageError
from fsdp_rs.runtime.param_group import FSDPParamGroup

__all__ = ["ShardDimGroup", "check_shard_dim", "copy_in_on_dims", "copy_out_on_dims"]


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


class ShardDimGroup(FSDPParamGroup):
    """A group whose parameters FSDP shards on ``dims[i] > 0``; see [Note:
    Sharding on another dim]."""

    def __init__(self, *args, dims: list[int], **kwargs) -> None:
        self.dims = dims
        self._dim_specs: dict = {}  # (param, dtype) -> DTensorSpec
        super().__init__(*args, **kwargs)

    def _sharded_specs(self, dtype: torch.dtype) -> list[DTensorSpec]:
        return [self._spec_of(i, dtype) for i in range(len(self.full_shapes))]

    def _planned_shapes(self, shapes: list[torch.Size]) -> list[torch.Size]:
        world = self.info.shard_size
        self.full_shapes = list(shapes)
        self.local_shapes = []
        self._pre_len = []  # (pre, L) per parameter
        for shape, d in zip(shapes, self.dims, strict=True):
            local = list(shape)
            local[d] //= world
            self.local_shapes.append(torch.Size(local))
            self._pre_len.append((math.prod(shape[:d]), local[d] * math.prod(shape[d + 1 :])))
        return [torch.Size((world, math.prod(s) // world)) for s in shapes]

    def _init_gradients(self) -> None:
        super()._init_gradients()
        self.preplace_grads = False

    def _spec_of(self, i: int, dtype: torch.dtype) -> DTensorSpec:
        nd = self.nd[i] if self.nd is not None else None
        if nd is not None:
            return nd.sharded_spec(dtype)
        cache = self._dim_specs
        spec = cache.get((i, dtype))
        if spec is None:
            shape = self.full_shapes[i]
            placement = Shard(self.dims[i])
            placements = (placement,) if self.info.replicate_group is None else (
                Replicate(), placement
            )  # fmt: skip
            meta = TensorMeta(shape, _contiguous(shape), dtype)
            spec = cache[(i, dtype)] = DTensorSpec(self.info.mesh, placements, tensor_meta=meta)
        return spec

    def _local_shape(self, i: int) -> torch.Size:
        return self.local_shapes[i]

    def _local_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        offsets = self.layout.row_offsets
        return [
            buffer.as_strided(s, _contiguous(s), off)
            for s, off in zip(self.local_shapes, offsets, strict=True)
        ]

    def _grad_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        offsets = self.grad_layout.row_offsets
        shapes = [self.local_shapes[i] for i in self._grad_index]
        pairs = zip(shapes, offsets, strict=True)
        return [buffer.as_strided(s, _contiguous(s), o) for s, o in pairs]

    def _fill_sharded(self, full, views) -> None:
        world, rank = self.info.shard_size, self.info.shard_rank
        for f, v, d in zip(full, views, self.dims, strict=True):
            v.copy_(f.chunk(world, d)[rank])

    def _unsharded_shapes(self) -> tuple[list, list]:
        return self.full_shapes, list(map(_contiguous, self.full_shapes))

    def _copy_out(self, ag: torch.Tensor) -> None:
        starts = self.plan.unsharded_offsets.tolist()
        copy_out_on_dims(ag, self.unsharded, self._pre_len, self.layout.row_offsets, starts)

    def _copy_in(self, grads: list, rs_in: torch.Tensor, divide: float) -> None:
        pre_len = [self._pre_len[k] for k in self._grad_index]
        copy_in_on_dims(grads, rs_in, pre_len, self.grad_layout.row_offsets, divide)


def copy_out_on_dims(
    ag: torch.Tensor,
    unsharded: torch.Tensor,
    pre_len: list[tuple[int, int]],
    rows: list[int],
    starts: list[int],
) -> None:
    """All-gather output ``ag`` (``[W, row]``) into the unsharded buffer: each
    parameter's ``(W, pre, L)`` block at ``rows[i]`` to its ``(pre, W, L)`` at
    ``starts[i]``, one strided copy each ([Note: Sharding on another dim])."""
    world = ag.size(0)
    for (pre, length), row, start in zip(pre_len, rows, starts, strict=True):
        strides = (world * length, length, 1)
        dst = unsharded.as_strided((pre, world, length), strides, start)
        dst.copy_(ag[:, row : row + pre * length].view(world, pre, length).transpose(0, 1))


def copy_in_on_dims(
    grads: list,
    rs_in: torch.Tensor,
    pre_len: list[tuple[int, int]],
    rows: list[int],
    divide: float,
) -> None:
    """Unsharded gradients (None: zeros) into the reduce-scatter input
    (``[W, row]``, the reduce dtype): each ``(pre, W, L)`` to ``(W, pre, L)`` at
    ``rows[k]``, cast on the way; then the pre-division, as FSDP2's ``div_``."""
    world = rs_in.size(0)
    rs_in.zero_()  # missing gradients and alignment gaps
    for g, (pre, length), row in zip(grads, pre_len, rows, strict=True):
        if g is None:
            continue
        dst = rs_in[:, row : row + pre * length].view(world, pre, length)
        dst.copy_(g.reshape(pre, world, length).transpose(0, 1))
    if divide != 1.0:
        rs_in.div_(divide)
