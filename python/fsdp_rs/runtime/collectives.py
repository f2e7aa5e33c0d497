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

__all__ = [
    "Division",
    "all_gather",
    "gradient_division",
    "reduce_scatter",
    "unreduced_post_divide",
]

# torch >= 2.13 names the flat-tensor collectives *_single; older ones only
# have the *_into_tensor / *_tensor names (deprecated since).
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
