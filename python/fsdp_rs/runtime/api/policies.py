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
reduce dtype ([Note: Wider gradient accumulation] in ``runtime/group/gradients.py``).

[Note: Policy checks]
FSDP2 reads a policy's fields where it first uses them: a
``MixedPrecisionPolicy(param_dtype=torch.int64)`` fails at the first forward,
deep in a copy. ``fully_shard`` checks them at once (``check_policies``), each
error naming the field: the policies' types (``offload_policy=None`` is taken,
as FSDP2 takes it: no offload), their bool fields, and the dtypes. A parameter
and reduce dtype is one the copy kernels cast between (``FLOAT_DTYPES``:
float32, bfloat16, float16, float64); a reduce dtype may also be complex, the
dtype complex gradients reduce in, and the output dtype any floating-point or
complex dtype (it casts the forward's floating-point outputs, with torch's
``to``). Complex parameters are gathered in their own dtype whatever
``param_dtype`` says, as in FSDP2; their gradients reduce in a complex dtype
only, and real ones in a real one, which ``fully_shard`` checks against the
parameters that take gradients.
"""

from __future__ import annotations

import functools
import operator
from itertools import compress

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_rs.kernels._dtypes import FLOAT_DTYPES, FLOAT_NAMES
from fsdp_rs.runtime.api.errors import check_bool

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "accumulates_wider",
    "check_policies",
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


_COMPLEX_DTYPES = (torch.complex64, torch.complex128)
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def check_policies(
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    params: list[torch.Tensor],
    fqns: list[str],
) -> None:
    """``fully_shard``'s policies, before anything is sharded ([Note: Policy
    checks]); ``params`` (named ``fqns``) are the parameters it manages."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__} ({mp_policy!r})"
        )
    # None: no offload, as FSDP2 reads it (it tests for CPUOffloadPolicy only)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "fully_shard: offload_policy must be an OffloadPolicy (CPUOffloadPolicy() to "
            f"offload), got {type(offload_policy).__name__} ({offload_policy!r})"
        )
    check_bool("fully_shard", "mp_policy.cast_forward_inputs", mp_policy.cast_forward_inputs)
    if isinstance(offload_policy, CPUOffloadPolicy):
        check_bool("fully_shard", "offload_policy.pin_memory", offload_policy.pin_memory)
    cast = f"a floating-point dtype fsdp-rs casts to ({FLOAT_NAMES})"
    _check_dtype(mp_policy, "param_dtype", FLOAT_DTYPES, cast)
    _check_dtype(mp_policy, "reduce_dtype", FLOAT_DTYPES + _COMPLEX_DTYPES, f"{cast} or complex")
    output = mp_policy.output_dtype
    if output is not None and not (
        isinstance(output, torch.dtype) and (output.is_floating_point or output.is_complex)
    ):
        _refuse("output_dtype", output, "a floating-point or complex dtype")
    reduce_dtype = mp_policy.reduce_dtype
    if reduce_dtype is not None:
        trainable = list(compress(params, map(_REQUIRES_GRAD, params)))
        kinds = set(map(operator.attrgetter("is_complex"), set(map(_DTYPE, trainable))))
        if reduce_dtype.is_complex in kinds and len(kinds) == 1:
            return
        if kinds:  # a trainable parameter of the other kind: name the first one
            names = list(compress(fqns, map(_REQUIRES_GRAD, params)))
            for fqn, p in zip(names, trainable, strict=True):
                if p.dtype.is_complex != reduce_dtype.is_complex:
                    raise TypeError(
                        f"fully_shard: mp_policy.reduce_dtype is {reduce_dtype}, which cannot "
                        f"hold the gradient of parameter {fqn} ({p.dtype}): complex gradients "
                        "reduce in a complex dtype, real ones in a floating-point one; give "
                        "this call a reduce_dtype of that kind (or None: the parameters' "
                        "own), with complex and real parameters in fully_shard calls of "
                        "their own, or freeze the parameter (requires_grad=False)"
                    )


def _check_dtype(
    mp_policy: MixedPrecisionPolicy, field: str, allowed: tuple[torch.dtype, ...], what: str
) -> None:
    value = getattr(mp_policy, field)
    if value is not None and value not in allowed:
        _refuse(field, value, what)


def _refuse(field: str, value, what: str) -> None:
    given = str(value) if isinstance(value, torch.dtype) else f"{type(value).__name__} {value!r}"
    raise TypeError(
        f"fully_shard: mp_policy.{field} is {given}; it must be None or {what}: pass one "
        f"of those, e.g. MixedPrecisionPolicy({field}=torch.bfloat16)"
    )
