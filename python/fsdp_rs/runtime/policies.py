"""Mixed precision and offload policies.

fsdp-rs accepts torch's own policy classes, so code written for FSDP2 passes the
same objects; they are re-exported here and from ``fsdp_rs``.

[Note: Default reduce dtype]
With ``MixedPrecisionPolicy(reduce_dtype=None)`` FSDP2 up to torch 2.14 reduces
(and accumulates without sync) in ``param_dtype`` when one is set; from torch
2.15 it reduces in the parameters' original dtype (fp32 for fp32 parameters
computed in bf16). fsdp-rs follows the FSDP2 of the installed torch, so a model
trains the same bits under either on any supported torch. Which one applies is
probed from torch's FSDP2 itself (its parameters carry an
``unsharded_grad_dtype`` from 2.15), not read off the version number. An
explicit ``reduce_dtype`` is used as given on every version.

The same FSDP2 also accumulates wider: where the reduce dtype is wider than the
compute dtype (bf16 compute, fp32 reduce, whether ``reduce_dtype`` is explicit
or not), a backward without gradient sync sets autograd's ``grad_dtype`` on the
unsharded parameters, so autograd sums each gradient's contributions in the
reduce dtype ([Note: Wider gradient accumulation] in ``runtime/gradients.py``).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "accumulates_wider",
    "fsdp2_has_grad_dtype_policy",
    "reduce_dtype_for",
]


@functools.cache  # the installed torch does not change while a process runs
def fsdp2_has_grad_dtype_policy() -> bool:
    """Whether the installed torch's FSDP2 reduces in the original dtype by
    default and accumulates in the reduce dtype ([Note: Default reduce dtype])."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # FSDP2 moved: assume the newest semantics
        return True
    return hasattr(FSDPParam, "unsharded_grad_dtype")


def fsdp2_reduces_partial_first() -> bool:
    """Whether the installed torch's FSDP2 reduces a group that holds partial
    replica gradients at every visit of its backward, adding them at the first
    (torch >= 2.15), rather than at the first visit with a gradient ([Note:
    Partial gradients of a module called twice])."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # FSDP2 moved: assume the newest semantics
        return True
    return hasattr(FSDPParamGroup, "_get_partial_reduce_grad")


def accumulates_wider(reduce_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether backwards without sync accumulate in ``reduce_dtype`` rather than
    the compute dtype ([Note: Wider gradient accumulation] in ``gradients.py``)."""
    return (
        reduce_dtype.is_floating_point
        and compute_dtype.is_floating_point
        and reduce_dtype.itemsize > compute_dtype.itemsize
        and fsdp2_has_grad_dtype_policy()
    )


def reduce_dtype_for(
    mp_policy: MixedPrecisionPolicy, orig_dtype: torch.dtype, param_dtype: torch.dtype
) -> torch.dtype:
    """The dtype a group reduces its gradients in ([Note: Default reduce dtype])."""
    if mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype
    return orig_dtype if fsdp2_has_grad_dtype_policy() else param_dtype
