"""How gradients are divided around the reduce-scatter.

[Note: Gradient division]
fsdp-rs divides exactly as FSDP2 does, so gradients match it bit for bit: for
fp32 and bf16 reduction the collective averages (``ReduceOp.AVG``), or, with a
custom divide factor, pre-multiplies (``PREMUL_SUM``) unless the factor equals
the world size; for fp16 the division is split into a pre-divide (fused into
the reduce-scatter copy-in) and a post-divide (fused into the post-reduce) of
about ``sqrt(factor)`` each, to stay clear of overflow and underflow. A
single-rank group only divides by a custom factor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

__all__ = [
    "Division",
    "all_gather",
    "gradient_division",
    "reduce_scatter",
    "unreduced_post_divide",
]

# torch >= 2.13 names the flat-tensor collectives *_single; older ones only
# have the *_into_tensor / *_tensor names (deprecated since).
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# [Note: Direct collectives]
# torch.distributed's Python entry points (``all_gather_single`` and
# ``reduce_scatter_single``, behind a logging decorator) cost about 7 us per call
# above the process group's own method: a torch-function check, argument checks,
# the default-group lookup, the coalescing-context lookup, the options object.
# The runtime issues two or three per group per step on plain, contiguous flat
# tensors of a group it holds, so it calls the process group's method itself,
# the one torch's entry point calls, on the group object as it does (a process
# group written in Python, torch's threaded one for ranks as threads, overrides
# it), with the same options. Anything else takes torch's entry point: a tensor
# subclass (torch-function modes and subclasses dispatch there), complex
# tensors (viewed as real there), no group (the default one) or an object that
# is not a ``ProcessGroup``, and a group inside a ``_coalescing_manager`` (which
# records instead of issuing; read from torch's world at each call, which
# torch's thread isolation makes per thread).
_PG = dist.ProcessGroup
_PG_ALL_GATHER = "all_gather_single" if hasattr(_PG, "all_gather_single") else "_allgather_base"
_PG_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(_PG, "reduce_scatter_single") else "_reduce_scatter_base"
)
_C10D = dist.distributed_c10d
_HAS_ASYNC_OPT = hasattr(AllgatherOptions(), "asyncOp")
_PLAIN = torch.Tensor


def _direct(group: dist.ProcessGroup | None, output: torch.Tensor, input: torch.Tensor) -> bool:
    if not (
        type(output) is _PLAIN
        and type(input) is _PLAIN
        and isinstance(group, _PG)
        and not input.is_complex()
    ):
        return False
    world = _C10D._world
    # torch's world holds the dict itself; the threaded one (per thread) a property
    coalescing = getattr(world, "_pg_coalesce_state", None)
    return group not in (world.pg_coalesce_state if coalescing is None else coalescing)


def _finish(work, async_op: bool):
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def all_gather(output_tensor, input_tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single(output_tensor, input_tensor, group, async_op)``;
    see [Note: Direct collectives]."""
    if not _direct(group, output_tensor, input_tensor):
        return _dist_all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
    opts = AllgatherOptions()
    if _HAS_ASYNC_OPT:
        opts.asyncOp = async_op
    work = getattr(group, _PG_ALL_GATHER)(output_tensor, input_tensor, opts)
    return _finish(work, async_op)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``dist.reduce_scatter_single(output, input, op, group, async_op)``; see
    [Note: Direct collectives]."""
    if not _direct(group, output, input):
        return _dist_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    opts = ReduceScatterOptions()
    opts.reduceOp = op
    if _HAS_ASYNC_OPT:
        opts.asyncOp = async_op
    return _finish(getattr(group, _PG_REDUCE_SCATTER)(output, input, opts), async_op)


@dataclass(frozen=True)
class Division:
    pre: float
    """Fused into the reduce-scatter copy-in (1.0: none)."""
    post: float
    """Fused into the post-reduce (1.0: none)."""
    reduce_scatter_op: object
    all_reduce_op: object


@functools.cache  # a pure function of hashable flags, called per group and step
def gradient_division(
    reduce_dtype: torch.dtype,
    shard_size: int,
    replicate_size: int,
    factor: float | None,
    force_sum: bool = False,
) -> Division:
    """See [Note: Gradient division]."""
    sum_op = dist.ReduceOp.SUM
    data_parallel = shard_size * replicate_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            op = sum_op if data_parallel == 1 else dist.ReduceOp.AVG
            return Division(1.0, 1.0, op, op)
        if factor == shard_size:
            return Division(1.0, 1.0, dist.ReduceOp.AVG, sum_op)
        return Division(1.0, 1.0, dist._make_nccl_premul_sum(1.0 / factor), sum_op)
    if factor is None:
        factor = float(data_parallel)
    if not overflow_risk:
        return Division(1.0, float(factor), sum_op, sum_op)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return Division(float(pre), float(factor / pre), sum_op, sum_op)


def unreduced_post_divide(division: Division, factor: float | None) -> float:
    """The post-divide of a single-rank group, which runs no collective: a
    custom divide factor is divided by alone, as FSDP2 does."""
    return factor if factor is not None and division.post == 1.0 else division.post
