"""Per-parameter gradient dtypes (``param.grad_dtype``), as torch 2.15's FSDP2
keeps them.

[Note: Gradient dtype policy]
autograd (torch >= 2.10) lets a parameter name the dtype of its gradient:
``param.grad_dtype = torch.float32`` on a bf16 weight makes autograd accumulate
its gradient in fp32. torch 2.15's FSDP2 keeps that setting through sharding:

- the sharded ``.grad`` has the parameter's ``grad_dtype`` (the *sharded
  gradient dtype*; unset: the parameter's dtype; ``None``: any, so the reduce
  dtype), and the sharded parameter keeps the setting;
- the unsharded parameter accumulates in ``MixedPrecisionPolicy.reduce_dtype``
  when one is given, else in that ``grad_dtype`` (the *accumulation dtype*):
  autograd sums the contributions of a backward without sync there;
- without an explicit ``reduce_dtype`` a group whose gradients have several
  accumulation dtypes reduces in their promoted dtype (bf16 gradients of some
  weights next to fp32 ones: all reduced in fp32), then casts each shard to its
  sharded gradient dtype.

fsdp-rs holds one sharded gradient dtype per group, so a ``fully_shard`` call
whose parameters set ``grad_dtype`` is split by it as it is split by dtype
([Note: One group per dtype]); each group gets a ``GradPolicy``: its own
setting and the dtypes it must promote with, those of the other trainable
parameters of the call that FSDP2 would reduce with it (same dtype, same
mesh). The promotion is taken over the parameters that train, on every rank
alike; FSDP2 takes it over the gradients a rank happens to hold, which could
differ between ranks ([Note: Gradient agreement]); where every parameter gets a
gradient the two agree. For the same reason ``grad_dtype=None`` (the gradient
keeps whatever dtype its op computed) needs an explicit ``reduce_dtype``: the
reduce dtype would otherwise depend on each rank's gradients. torch's FSDP2
before 2.15 drops the setting, so there fsdp-rs refuses it rather than drop it.

FSDP2 reads the setting at lazy init, so it may also be made on the sharded
parameters after ``fully_shard``, before the first forward; fsdp-rs reads it
there too (``adopt_grad_dtypes``): a group whose parameters changed alike
takes the new dtypes (its shards move to a new buffer where the row alignment
changes), and every group of the call the new promotion. One whose parameters
changed differently would have to be split again: that raises, telling the
user to set ``grad_dtype`` before ``fully_shard``.
"""

from __future__ import annotations

import functools
import operator
from itertools import compress, repeat
from typing import NamedTuple

import torch

from fsdp_rs.runtime.api.policies import MixedPrecisionPolicy, fsdp2_has_grad_dtype_policy

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
__all__ = [
    "UNSET",
    "GradPolicy",
    "adopt_grad_dtypes",
    "grad_dtype_keys",
    "grad_policies",
    "grad_settings",
    "overrides_grad_dtype",
    "promoted",
]


class GradPolicy(NamedTuple):
    """A group's gradient dtypes ([Note: Gradient dtype policy]).

    ``override``: the sharded gradient dtype its parameters set (None: they set
    none, so their dtype); ``promote``: the accumulation dtypes of the call's
    trainable parameters FSDP2 would reduce with its own (empty where
    ``reduce_dtype`` is set: that is the reduce dtype)."""

    override: torch.dtype | None
    promote: frozenset[torch.dtype]


UNSET = object()  # a parameter that sets no grad_dtype


def overrides_grad_dtype(param: torch.Tensor) -> bool:
    """Whether ``param`` sets its own ``grad_dtype`` (torch >= 2.15 tells)."""
    return bool(getattr(param, "_has_grad_dtype_override", False))


_OVERRIDES = operator.attrgetter("_has_grad_dtype_override")


def grad_settings(params) -> list:
    """Each parameter's own ``grad_dtype`` (``UNSET``: none), read now: one
    C-level pass where none sets one (16 ms per 1e5 DTensors; 8 without their
    ``__torch_function__``), as at every lazy init of a model that sets none."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            flags = list(map(_OVERRIDES, params))
        except AttributeError:  # torch < 2.15: no per-parameter policy to read
            return [UNSET] * len(params)
        if not any(flags):
            return [UNSET] * len(params)
        return [p.grad_dtype if f else UNSET for p, f in zip(params, flags, strict=True)]


def _key_of(fqn: str, param: torch.Tensor, setting, mp_policy) -> torch.dtype | None:
    """The sharded gradient dtype a parameter's ``setting`` asks for (None:
    none set); refuses ``grad_dtype=None`` on a trainable parameter without
    ``reduce_dtype``."""
    if setting is UNSET:
        return None
    if setting is not None:
        return setting
    if mp_policy.reduce_dtype is None and param.requires_grad:
        raise ValueError(
            f"fully_shard: parameter {fqn} has grad_dtype None (its gradient keeps the dtype "
            "its op computes), and the mp_policy has no reduce_dtype: the dtype the group "
            "reduces in would then depend on the gradients each rank holds. Pass "
            "MixedPrecisionPolicy(reduce_dtype=...) with the dtype its gradients have, or set "
            "param.grad_dtype to that dtype"
        )
    return mp_policy.reduce_dtype  # FSDP2 leaves such a shard in the reduce dtype


def grad_dtype_keys(managed, mp_policy: MixedPrecisionPolicy) -> list[torch.dtype | None]:
    """Per parameter, the sharded gradient dtype it sets (None: none set).

    Refuses what fsdp-rs cannot keep: any setting on a torch whose FSDP2 drops
    it, ``grad_dtype=None`` on a trainable parameter without ``reduce_dtype``."""
    params = managed.params
    if not params or not hasattr(params[0], "grad_dtype"):
        return [None] * len(params)
    if not fsdp2_has_grad_dtype_policy():
        for fqn, p in zip(managed.fqns, params, strict=True):
            if p.grad_dtype != p.dtype:
                raise ValueError(
                    f"fully_shard: parameter {fqn} has grad_dtype {p.grad_dtype} but dtype "
                    f"{p.dtype}; this torch's FSDP2 ({torch.__version__}) does not keep a "
                    "per-parameter grad_dtype (2.15's does), so fsdp-rs refuses rather than "
                    "drop it. Unset it (param.grad_dtype = param.dtype), or pass "
                    "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) for gradients "
                    "reduced in a wider dtype"
                )
        return [None] * len(params)
    settings = grad_settings(params)
    if settings.count(UNSET) == len(settings):  # C-level
        return [None] * len(params)
    return list(map(_key_of, managed.fqns, params, settings, repeat(mp_policy)))


def grad_policies(managed, keys: list[tuple], mp_policy) -> dict[tuple, GradPolicy | None]:
    """Per group key (``(dtype key, extension, other dim, grad_dtype_keys' item,
    mesh)``), its ``GradPolicy``; None for a group whose parameters set no
    ``grad_dtype`` in a call where no trainable parameter sets one."""
    # per key, whether a parameter of it trains (C-level passes: the keys in
    # order, then those of the trainable parameters)
    trains: dict[tuple, bool] = dict.fromkeys(keys, False)
    trains.update(dict.fromkeys(compress(keys, map(_REQUIRES_GRAD, managed.params)), True))
    groups = [(key[3], _dtype_of(key), key[-1], t) for key, t in trains.items()]
    return dict(zip(trains, _policies(groups, mp_policy), strict=True))


def _policies(groups: list[tuple], mp_policy) -> list[GradPolicy | None]:
    """The ``GradPolicy`` of each of a call's groups, given as ``(the gradient
    dtype its parameters set or None, its dtype, its mesh, whether it trains)``:
    the promotion over the accumulation dtypes of the trainable groups of the
    same dtype and mesh (FSDP2 reduces those as one group), unless the policy
    has a ``reduce_dtype``."""
    accumulate: dict[tuple, set[torch.dtype]] = {}
    for override, dtype, mesh, trains in groups:
        if trains:
            accumulate.setdefault((dtype, mesh), set()).add(override or dtype)
    any_trains = any(override is not None for override, _, _, trains in groups if trains)
    explicit = mp_policy.reduce_dtype is not None
    policies: list[GradPolicy | None] = []
    for override, dtype, mesh, _ in groups:
        if override is None and not any_trains:
            policies.append(None)
            continue
        promote = () if explicit else accumulate.get((dtype, mesh), ())
        policies.append(GradPolicy(override, frozenset(promote)))
    return policies


def adopt_grad_dtypes(group) -> None:
    """``grad_dtype`` set on the sharded parameters after ``fully_shard``, read
    at lazy init as FSDP2 reads it there: each group whose parameters' settings
    changed takes the new gradient dtypes, and every group of the call the new
    promotion. A group is not split again: its parameters must change alike
    (else set them before ``fully_shard``)."""
    if not fsdp2_has_grad_dtype_policy():
        return  # this torch's FSDP2 drops the setting; fully_shard refused it
    members = getattr(group, "groups", (group,))
    now = [grad_settings(m.sharded_params) for m in members]
    before = [m._grad_settings for m in members]
    if now == before:
        return
    mp_policy = members[0].mp_policy
    keys = []
    for m, settings, old in zip(members, now, before, strict=True):
        fqns = m.managed.fqns
        found = set(map(_key_of, fqns, m.sharded_params, settings, repeat(mp_policy)))
        where = f"parameters {', '.join(fqns[:3])}{', ...' if len(fqns) > 3 else ''}"
        if len(found) > 1:
            raise ValueError(
                f"fsdp_rs: grad_dtype was set after fully_shard on some of the {where} of one "
                f"group and not alike on the others (now {sorted(map(str, found))}); fsdp-rs "
                "groups parameters by gradient dtype at fully_shard: set grad_dtype before "
                "calling fully_shard"
            )
        if settings != old and not m.gather.adopts_grad_dtypes:
            raise ValueError(
                f"fsdp_rs: grad_dtype was set after fully_shard on the {where}, which use "
                "all-gather extensions; set it before calling fully_shard"
            )
        if settings != old and m.unsharded_params is not None:
            raise ValueError(
                f"fsdp_rs: grad_dtype was set on the {where} after they were unsharded; set it "
                "before fully_shard, or before the first forward or unshard()"
            )
        keys.append(found.pop())
    trains = [any(p.requires_grad for p in m.sharded_params) for m in members]
    groups = [
        (k, m.orig_dtype, id(m.info), t) for m, k, t in zip(members, keys, trains, strict=True)
    ]
    for m, policy in zip(members, _policies(groups, mp_policy), strict=True):
        m.set_grad_policy(policy)


def _dtype_of(key: tuple) -> torch.dtype:
    first = key[0]
    return first[0] if isinstance(first, tuple) else first


def promoted(dtypes) -> torch.dtype:
    """The promoted dtype of ``dtypes`` (non-empty)."""
    return functools.reduce(torch.promote_types, dtypes)
