"""``fully_shard``, ``FSDPModule`` and ``register_fsdp_forward_method``: the
same names, arguments and semantics as torch FSDP2."""

from __future__ import annotations

import dataclasses
import functools
import gc
import operator
from collections import deque
from collections.abc import Callable, Iterable
from itertools import compress, repeat
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_rs.runtime.api.comm_api import CommSettings
from fsdp_rs.runtime.api.composable import (
    check_composable,
    fsdp2_state,
    fsdp2_state_error,
    register_fully_shard,
)
from fsdp_rs.runtime.api.errors import (
    FSDPArgumentTypeError,
    FSDPUsageError,
    check_bool,
    check_real,
)
from fsdp_rs.runtime.api.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_policies,
)
from fsdp_rs.runtime.checks.optimizer_check import FQN_ATTR, OWNER_ATTR, register_optimizer_check
from fsdp_rs.runtime.comm.mesh import MeshInfo, from_torch_mesh_info, mesh_info
from fsdp_rs.runtime.group.grad_buffers import hold_grads, park_grads
from fsdp_rs.runtime.group.grad_dtypes import adopt_grad_dtypes, grad_dtype_keys, grad_policies
from fsdp_rs.runtime.group.param_group import FSDPParamGroup
from fsdp_rs.runtime.group.params import collect_params, state_of
from fsdp_rs.runtime.step import finalize
from fsdp_rs.runtime.step.finalize import GradientReductionHandle
from fsdp_rs.runtime.step.state import FSDPState
from fsdp_rs.runtime.variants.bundle import GroupBundle
from fsdp_rs.runtime.variants.extensions import (
    PRE_ALL_GATHER,
    ExtensionGather,
    has_extension,
    refuse_on_dtensor,
)
from fsdp_rs.runtime.variants.shard_dim import ShardDimGroup, check_shard_dim

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

_CLASS_CACHE: dict[type, type] = {}
# The group that owns a parameter, as an attribute of the parameter: a weakref
# registry would stop nn.Module._apply from swapping the (DTensor) parameters.
# Also how an optimizer built before fully_shard is caught ([Note: Optimizers
# built before fully_shard]).
_OWNER_ATTR = OWNER_ATTR
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _gc_paused(fn: Callable) -> Callable:
    """Run ``fn`` with CPython's cyclic GC paused (restored after, also on error).

    [Note: GC during fully_shard]
    ``fully_shard`` creates about three long-lived objects per parameter (the
    sharded DTensor, its ``__dict__``, its local view). Each time the objects
    surviving collections grow by a quarter, CPython runs a full collection that
    traverses every object in the process, the model's included: at 1e6
    parameters that was 6 full passes, 7 s of 21 s. With the GC paused, the
    objects are traversed once, at the next collection after sharding.

    [Note: fully_shard's cost per parameter]
    A Python-level call per parameter (a function, a generator step, a builtin
    called from a loop) costs 0.1-0.5 us; at 1e6 parameters each one is
    another 0.1-0.5 s of ``fully_shard``. So its work per parameter is done in
    C-level passes: ``map`` over builtins, ``operator.attrgetter``s and
    ``functools.partial``s of C constructors (``DTensor.__new__``),
    ``itertools.compress``, ``dict.fromkeys``; a Python function runs once per
    distinct value (a dtype, a mesh, a group key), and a loop over the
    parameters only to name the offender once a C-level pass found one.
    ``tests/test_step_host_cost.py`` counts the calls."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return wrapper


def is_managed(param: nn.Parameter) -> bool:
    """Whether a ``fully_shard`` call of fsdp-rs took ``param`` into a group."""
    return hasattr(param, _OWNER_ATTR)


@_gc_paused
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> nn.Module | list[nn.Module]:
    """Shard the parameters of ``module`` (or of a list of modules, as one group)
    over ``mesh`` and return it with its class swapped to ``FSDP<Cls>``.

    Parameters that are DTensors (tensor or expert parallelism) are sharded over
    the data-parallel mesh on top of their own placements; with ``dp_mesh_dims``
    (``torch.distributed.fsdp.DataParallelMeshDims``) ``mesh`` is the full mesh
    the parameters live on and those of its dims are data parallel ([Note:
    DTensor parameters]).

    Apply it bottom-up (blocks first, then the root): each call manages the
    parameters not already managed by an inner call."""
    modules = list(module) if isinstance(module, list | tuple) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            "fully_shard: expected an nn.Module or a non-empty list of nn.Modules, got "
            f"{type(module).__name__}"
        )
    for m in modules:
        if isinstance(m, FSDPModule) or state_of(m) is not None:
            raise FSDPUsageError(
                f"fully_shard: {type(m).__name__} was already passed to fully_shard; apply it "
                "once per module (bottom-up: submodules first, then their parent). Each "
                "distinct composable distributed API can only be applied to a module once."
            )
        check_composable(m, type(m).__name__)  # [Note: fsdp-rs in torch's composable registry]
        # a container subclass with a forward of its own is a module like any other
        if isinstance(m, nn.ModuleList | nn.ModuleDict) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__} has none; shard its elements, or the module that "
                "calls them"
            )
    info = mesh_info(mesh, dp_mesh_dims)
    reshard_after_forward = _spmd_reshard(reshard_after_forward, info)
    post_forward = _post_forward_size(reshard_after_forward, info.shard_size)
    managed = collect_params(modules, ignored_params or (), _OWNER_ATTR)
    check_policies(mp_policy, offload_policy, managed.params, managed.fqns)
    _check_not_sharded(modules, managed)
    _check_complex(managed)
    grad_keys = grad_dtype_keys(managed, mp_policy)  # [Note: Gradient dtype policy]
    dims, infos = _shard_dims(managed, shard_placement_fn, info)
    group = None
    if managed.params:
        offload = isinstance(offload_policy, CPUOffloadPolicy)
        # One group per dtype ([Note: One group per dtype]), apart from the
        # parameters with all-gather extensions ([Note: All-gather extensions]) and
        # those sharded on another dim ([Note: Sharding on another dim])
        # C-level passes over the parameters ([Note: fully_shard's cost per parameter])
        params = managed.params
        extension = list(map(hasattr, params, repeat(PRE_ALL_GATHER)))
        dtensors = list(map(isinstance, params, repeat(DTensor)))
        for fqn, p in compress(zip(managed.fqns, params, strict=True), dtensors):
            if has_extension(p._local_tensor):
                refuse_on_dtensor(fqn)
        other_dim = list(map(bool, dims))  # a shard dim other than 0
        meshes = _mesh_keys(infos)  # [Note: Per-parameter meshes]
        dtype_keys = _group_keys(managed, mp_policy)
        keys = list(zip(dtype_keys, extension, other_dim, grad_keys, meshes, strict=True))
        parts = managed.split(keys) if len(set(keys)) > 1 else [managed]
        grad = grad_policies(managed, keys, mp_policy)
        pin = offload and offload_policy.pin_memory
        groups = []
        for part, key in zip(parts, dict.fromkeys(keys), strict=True):
            part_info = infos[keys.index(key)]
            size = post_forward
            if part_info is not info:
                size = _post_forward_size(reshard_after_forward, part_info.shard_size)
            args = (part, modules, part_info, _policy_for(mp_policy, key[0]), offload, pin)
            if key[1]:
                gather = ExtensionGather()  # [Note: All-gather extensions]
                groups.append(FSDPParamGroup(*args, size, grad_policy=grad[key], gather=gather))
            elif key[2]:
                part_dims = [d for d, k in zip(dims, keys, strict=True) if k == key]
                groups.append(ShardDimGroup(*args, None, dims=part_dims, grad_policy=grad[key]))
            else:
                groups.append(FSDPParamGroup(*args, size, grad_policy=grad[key]))
        group = groups[0] if len(groups) == 1 else GroupBundle(groups)
        desc = f"the fully_shard group of {type(modules[0]).__name__}"
        # The originals, which other modules may still register (a shared
        # parameter); a sharded one met elsewhere is refused as a DTensor.
        deque(map(setattr, managed.params, repeat(_OWNER_ATTR), repeat(desc)), maxlen=0)
        deque(map(setattr, managed.params, repeat(FQN_ATTR), managed.fqns), maxlen=0)
        register_optimizer_check()  # [Note: Optimizers built before fully_shard]
        managed.forget_originals()
        for part in parts:
            part.forget_originals()
    state = FSDPState(modules, group, reshard_after_forward, mp_policy)
    state.mesh_info = info  # the root's plan check runs on it ([Note: Cross-rank plan check])
    state.conflicts = managed.conflicts  # raised at lazy init, as FSDP2
    for m in modules:
        m._fsdp_rs_state = state
        cls = m.__class__
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        m.__class__ = new_cls
    register_fully_shard(modules, _class_name(modules[0]))
    return module


fully_shard.state = fsdp2_state  # [Note: fsdp-rs in torch's composable registry]


def _check_not_sharded(modules: list[nn.Module], managed) -> None:
    """A parameter that is already a sharded parameter of an fsdp-rs group (its
    local shard views a group's sharded buffer): the module's parent was
    sharded before it. Told apart from a tensor-parallel DTensor parameter,
    which fully_shard shards further ([Note: DTensor parameters])."""
    params = managed.params
    for fqn, p in compress(
        zip(managed.fqns, params, strict=True), map(isinstance, params, repeat(DTensor))
    ):
        base = getattr(p._local_tensor, "_base", None)
        ref = getattr(base, "_fsdp_rs_group", None)
        group = ref() if ref is not None else None
        if group is None:
            continue
        owner = getattr(group, "modules", None)
        owner = _class_name(owner[0]) if owner else "a module containing it"
        name = _class_name(modules[0])
        raise FSDPUsageError(
            f"fully_shard: parameter {fqn} of {name} already belongs to the fully_shard group "
            f"of {owner}, a module containing {name} that was passed to fully_shard first. "
            "fully_shard goes bottom-up: call it on the children first, then on the root "
            "(fully_shard(model[0]), fully_shard(model[1]), ..., then fully_shard(model)); "
            "the root's call takes the parameters no child took"
        )


def _class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class, ``Linear`` rather than ``FSDPLinear``."""
    cls = type(module)
    return next(
        c for c in cls.__mro__ if c not in _OWN_CLASSES and not issubclass(c, FSDPModule)
    ).__name__


def _check_complex(managed) -> None:
    """Complex parameters that take gradients share their ``fully_shard`` call
    with trainable parameters of their own dtype only.

    [Note: Complex parameters]
    fsdp-rs shards a call's parameters as one group per dtype ([Note: One group
    per dtype]) and so trains several real dtypes in one call (a bf16 model
    with fp32 norms), where FSDP2 requires the trainable parameters of a call
    to share one dtype. Complex ones are kept to FSDP2's rule: a complex and a
    real gradient share no reduce dtype (``MixedPrecisionPolicy.reduce_dtype``
    names one per call), so a call mixing them has no FSDP2 semantics to
    match, and FSDP2 raises there at the first forward. fsdp-rs raises at
    ``fully_shard``, naming a parameter of each dtype; frozen parameters of any
    dtype may sit beside them, as in FSDP2. Complex parameters alone train as
    FSDP2 trains them ([Note: Complex gradients] in ``kernels/_dtypes.py``)."""
    params = managed.params
    grad_flags = list(map(_REQUIRES_GRAD, params))
    dtypes = set(map(_DTYPE, compress(params, grad_flags)))
    if len(dtypes) < 2 or not any(d.is_complex for d in dtypes):
        return
    trainable = list(compress(zip(managed.fqns, params, strict=True), grad_flags))
    first = next((fqn, p.dtype) for fqn, p in trainable if p.dtype.is_complex)
    other = next((fqn, p.dtype) for fqn, p in trainable if p.dtype != first[1])
    raise FSDPUsageError(
        f"fully_shard: parameters {first[0]} ({first[1]}) and {other[0]} ({other[1]}) both "
        "take gradients in one fully_shard call, which a complex parameter shares with "
        "trainable parameters of its own dtype only (FSDP2 requires one dtype of them all "
        "and raises at the first forward); pass the complex parameters' modules to a "
        "fully_shard call of their own first, or freeze one kind (requires_grad=False)"
    )


def _shard_dims(managed, shard_placement_fn, info: MeshInfo) -> tuple[list[int], list[MeshInfo]]:
    """Per parameter the dim FSDP shards (``shard_placement_fn``: None or
    ``Shard(d)``, negative ``d`` counted from the end) and the mesh it shards
    over (``info``, or a ``ShardPlacementResult``'s: [Note: Per-parameter
    meshes]), checked as FSDP2 checks them."""
    count = len(managed.params)
    if shard_placement_fn is None:
        return [0] * count, [info] * count
    dims, infos = [], []
    converted: dict[int, MeshInfo] = {}  # FSDP2 mesh info object -> fsdp-rs's
    by_groups: dict[tuple, Any] = {}  # process groups -> the FSDP2 object that named them
    for fqn, p in zip(managed.fqns, managed.params, strict=True):
        placement = shard_placement_fn(p)
        own = getattr(placement, "mesh_info", None)  # torch >= 2.13's ShardPlacementResult
        param_info = info
        if own is not None:
            param_info = converted.get(id(own))
            if param_info is None:
                param_info = converted[id(own)] = from_torch_mesh_info(own)
            first = by_groups.setdefault(_mesh_key(param_info), own)
            if first is not own:
                raise ValueError(
                    "Params sharing the same process group must use the same FSDPMeshInfo "
                    f"object, but got different objects: {first} vs {own} (parameter {fqn})"
                )
        infos.append(param_info)
        placement = getattr(placement, "placement", placement)
        if placement is None:
            dims.append(0)
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"Invalid shard_placement_fn result: {placement} (parameter {fqn})")
        local = p._local_tensor if isinstance(p, DTensor) else p
        dims.append(check_shard_dim(fqn, local.shape, placement.dim, param_info.shard_size))
    return dims, infos


def _mesh_key(info: MeshInfo) -> tuple[int, int]:
    """[Note: Per-parameter meshes] parameters over the same process groups
    share a group."""
    return id(info.shard_group), id(info.replicate_group)


def _mesh_keys(infos: list[MeshInfo]) -> list[tuple[int, int]]:
    """``_mesh_key`` of each of ``infos``, computed once per distinct object."""
    ids = list(map(id, infos))
    keys = {k: _mesh_key(info) for k, info in dict(zip(ids, infos, strict=True)).items()}
    return list(map(keys.__getitem__, ids))


def _group_keys(managed, mp_policy: MixedPrecisionPolicy) -> list:
    """Per parameter, what its group is made of: its dtype and, where the policy
    has a ``param_dtype_override_fn`` (torch >= 2.15), the unsharded dtype it
    resolves to ([Note: One group per dtype])."""
    dtypes = list(map(_DTYPE, managed.params))
    override = getattr(mp_policy, "param_dtype_override_fn", None)
    if override is None:
        return dtypes
    keys = []
    for fqn, p, dtype in zip(managed.fqns, managed.params, dtypes, strict=True):
        chosen = override(p)
        if chosen is not None and not isinstance(chosen, torch.dtype):
            raise ValueError(
                f"fully_shard: param_dtype_override_fn returned {chosen!r} for {fqn}; it "
                "must return a torch.dtype or None"
            )
        if chosen is not None and chosen not in (mp_policy.param_dtype, dtype):
            raise ValueError(
                f"fully_shard: param_dtype_override_fn returned {chosen} for {fqn} (dtype "
                f"{dtype}); it may return None, param_dtype ({mp_policy.param_dtype}) or the "
                "parameter's own dtype"
            )
        keys.append((dtype, chosen or mp_policy.param_dtype))
    return keys


def _policy_for(mp_policy: MixedPrecisionPolicy, key) -> MixedPrecisionPolicy:
    """The policy of the group made of ``key``: the resolved unsharded dtype."""
    if not isinstance(key, tuple) or key[1] == mp_policy.param_dtype:
        return mp_policy
    return dataclasses.replace(mp_policy, param_dtype=key[1])


def _spmd_reshard(reshard_after_forward: bool | int | None, info: MeshInfo) -> bool | int | None:
    """``reshard_after_forward`` as an int (a post-forward group size) under
    ``dp_mesh_dims``, as FSDP2 takes it: refused where a dim is sharded; with
    replicate dims only ([Note: Replicate dims only]) there are no shards to
    keep a group of, so resharding after forward is freeing, as with True."""
    if info.spmd_mesh is None or reshard_after_forward is None:
        return reshard_after_forward
    if isinstance(reshard_after_forward, bool) or not isinstance(reshard_after_forward, int):
        return reshard_after_forward
    if info.shard_group is None:
        return True
    raise NotImplementedError(
        f"fully_shard: reshard_after_forward as int ({reshard_after_forward}) is not yet "
        "supported with SPMD mesh (dp_mesh_dims), as in FSDP2: pass True or False"
    )


def _post_forward_size(reshard_after_forward: bool | int | None, shard_size: int) -> int | None:
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return None
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            "fully_shard: reshard_after_forward must be None, a bool or an int, got "
            f"{type(reshard_after_forward).__name__}"
        )
    if reshard_after_forward < 1 or shard_size % reshard_after_forward:
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard_after_forward} must divide the shard "
            f"world size {shard_size} (an intra-node size, e.g. 8)"
        )
    return reshard_after_forward


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes it."""

    def __init__(self, group) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(CommSettings, TorchFSDPModule):
    """Mixin of every module passed to ``fully_shard`` (its class becomes
    ``FSDP<Cls>``).

    [Note: An FSDPModule to torch]
    Libraries and torch itself find FSDP2 modules with ``isinstance(m,
    torch.distributed.fsdp.FSDPModule)`` and then call its methods
    (Lightning's ``no_backward_sync`` calls ``set_requires_gradient_sync``,
    pipelining ``set_is_last_backward`` / ``unshard`` / ``reshard``); a module
    that fails the test is skipped silently. So this class derives from
    torch's, and defines every method torch's defines (a test compares the
    two classes on every torch version CI runs): none of torch's runs on an
    fsdp-rs module. What reads FSDP2's private state (``_get_fsdp_state()``,
    ``fully_shard.state(m)``, ``FSDPMemTracker``) finds none and raises,
    naming the module, instead of reading another library's objects; torch's
    composable ``replicate`` sees the module as fully sharded ([Note: fsdp-rs
    in torch's composable registry]).
    ``isinstance(m, fsdp_rs.FSDPModule)`` tells the two libraries' modules
    apart.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # Direct construction (nn.Sequential slicing, say) builds the original
        # class, as FSDP2 does: the first class of the MRO that is not ours.
        orig = next(
            c for c in cls.__mro__ if c not in _OWN_CLASSES and not issubclass(c, FSDPModule)
        )
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        raise FSDPUsageError(
            f"FSDP does not support deepcopy: {type(self).__name__} holds sharded parameters "
            "and communication state; deep-copy the model before fully_shard, or build a "
            "second one"
        )

    @property
    def _state(self) -> FSDPState:
        return self._fsdp_rs_state

    def _states(self, recurse: bool) -> Iterable[FSDPState]:
        if not recurse:
            return [self._state]
        seen, out = set(), []
        for m in self.modules():
            s = state_of(m)
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out

    def _groups(self, recurse: bool) -> list:
        return [s.group for s in self._states(recurse) if s.group is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; with ``set_to_none`` (the default), each group's
        gradient buffer is parked for the next backward where nothing else holds
        it ([Note: Parked gradient buffers] in ``runtime/group/grad_buffers.py``)."""
        if not set_to_none:
            return super().zero_grad(set_to_none=False)
        state = self._state
        if state.is_root and state.context is not None:
            # Parking is only a saving: the groups the root's lazy init found (a
            # group outside them, or one no longer under it, is not parked; one
            # whose .grads were not cleared never is), not a walk of every module.
            groups = [s.group for s in state.context.states if s.group is not None]
        else:
            groups = self._groups(recurse=True)
        flat = [g for b in groups for g in (b.groups if isinstance(b, GroupBundle) else (b,))]
        held = hold_grads(flat)
        try:
            super().zero_grad(set_to_none=True)
        finally:
            park_grads(held)
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the sharded ones are registered again."""
        if self._state.group is not None:
            self._state.group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters; with ``async_op`` return a handle to wait on."""
        group = self._state.group
        if group is None:
            return UnshardHandle(None) if async_op else None
        group.adopt_registered()
        if self._state.context is None:  # before lazy init, as FSDP2 reads it there
            adopt_grad_dtypes(group)  # [Note: Gradient dtype policy]
        group.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(group)
        group.wait_for_unshard()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step; while
        False, the end of backward keeps the forward order (for implicit backward
        prefetching) and unshards started but not used, for the next backward."""
        check_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        self._state.is_last_backward = is_last_backward  # read at lazy init
        if self._state.context is not None:
            self._state.context.iteration.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: whether the caller ends each backward iteration with
        ``finalize_backward()`` instead of the end of backward (superseding
        ``set_is_last_backward``); set it before backward ([Note: Manual backward
        finalization])."""
        finalize.set_manual(self._state, enabled)

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """On the root, after every backward of the iteration (with manual
        finalization on): reduce the gradients still pending, reshard, and end
        the iteration; with ``async_op`` return a handle whose ``wait()`` ends
        it (wait before using the gradients or the next forward)."""
        return finalize.finalize_backward(self._state, async_op)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' memory at reshard (their data pointers
        stay the same across reshard and unshard, as CUDA graphs need), at the
        cost of that memory; by default reshard frees it."""
        check_bool("set_keep_unsharded_storage", "keep", keep)
        check_bool("set_keep_unsharded_storage", "recurse", recurse)
        for group in self._groups(recurse):
            group.keep_unsharded_storage = keep

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """Skip the reduce-scatter (and all-reduce) while False: gradients
        accumulate unsharded, as for gradient accumulation without communication."""
        check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        check_bool("set_requires_gradient_sync", "recurse", recurse)
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync
            group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        check_bool("set_requires_all_reduce", "recurse", recurse)
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        # FSDP2 raises ValueError here: [Note: Argument types]
        method, error = "set_reshard_after_forward", FSDPArgumentTypeError
        check_bool(method, "reshard_after_forward", reshard_after_forward, error)
        check_bool(method, "recurse", recurse, error)
        for state in self._states(recurse):
            state.reshard_after_forward_arg = reshard_after_forward
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        check_bool("set_reshard_after_backward", "recurse", recurse)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._state.forward_prefetch = [m._state for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._state.backward_prefetch = [m._state for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        self._state.post_optim_event = event  # read at lazy init
        if self._state.context is not None:
            self._state.context.iteration.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's gradients by ``factor`` instead of the data-parallel
        size (this module's group only, as FSDP2: call it per module)."""
        check_real("set_gradient_divide_factor", "factor", factor)
        for group in self._groups(False):
            group.gradient_divide_factor = float(factor)
        self._state.refresh_traced()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sums only (dividing before and after), for this module's
        group, as FSDP2: needed where the backend has no average (gloo)."""
        check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for group in self._groups(False):
            group.force_sum_reduction = enable
        self._state.refresh_traced()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: on the root, wait for
        the collectives in flight, reshard every group and clear the iteration's
        bookkeeping, so the next iteration runs normally. The failed iteration's
        gradients in flight (and those accumulated without sync) are dropped.
        After a backward that raised, the next forward does this itself ([Note:
        A backward that raised]); after a forward that raised, call it."""
        self._state.reset_iter_state()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call ``hook(gradients)`` on each reduce-scatter output (after HSDP's
        all-reduce); without HSDP it runs on ``stream`` if given."""
        groups = self._groups(False)
        if stream is not None and any(g.info.replicate_group is not None for g in groups):
            # FSDP2's message, word for word: tests match it.
            raise ValueError("stream cannot be set when using native HSDP")
        for group in groups:
            group.all_reduce_hook = hook
            group.all_reduce_hook_stream = stream

    def set_fullgraph_compile(self, enabled: bool = True) -> None:
        """Let ``torch.compile`` trace the fsdp-rs forward hooks of this root module
        and every fully_shard module under it, so that ``torch.compile(model,
        fullgraph=True)`` captures the whole model with its all-gathers and
        reduce-scatters ([Note: Traced hooks]); ``False``: the hooks run eager under
        compile again (the default). Call it on the root module, before compiling;
        it raises ValueError naming the groups the traced hooks cannot handle."""
        from fsdp_rs.runtime.compile import traced

        check_bool("set_fullgraph_compile", "enabled", enabled)
        if enabled:
            traced.enable(self._state)
        else:
            traced.disable(self._state)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        for group in self._groups(False):
            group.unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Unshard in forward and backward (and prefetch) with asynchronous
        collectives on the current stream instead of the all-gather streams, for
        this module and every fully_shard module under it, as FSDP2's private
        method of that name (values are the same either way)."""
        check_bool("_set_unshard_async_op", "async_op", async_op)
        for group in self._groups(True):
            group.unshard_async_op = async_op

    def _get_fsdp_state(self) -> Any:
        """FSDP2's private state of this module: fsdp-rs has none ([Note: An
        FSDPModule to torch]); raises, as FSDP2 raises for a module without it."""
        raise fsdp2_state_error(_class_name(self))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # module.to / to_empty / cuda replace the registered sharded parameters'
        # data ([Note: Adopting registered parameters]): the sharded ones must be
        # registered, and the groups then re-point their buffers at the new data.
        self.reshard()
        # the module's own _apply: past torch's FSDPModule, whose would read FSDP2 state
        result = super(TorchFSDPModule, self)._apply(*args, **kwargs)
        for group in self._groups(True):
            group.adopt_registered()
        return result


_OWN_CLASSES = frozenset(FSDPModule.__mro__)


def _check_fsdp_modules(modules: list, method: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method}: {type(m).__name__} is not a fully_shard module; pass modules that "
                "fully_shard returned"
            )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the same unshard/reshard hooks as forward."""
    if not isinstance(module, FSDPModule):
        return
    state = module._state
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = orig(*args, **kwargs)
        return state.post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: Iterable[Any]) -> None:
    """Let several roots (pipeline stages' model chunks) use one set of
    communication streams, as FSDP2's ``share_comm_ctx``; call it before their
    first forward."""
    modules = list(modules)
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"share_comm_ctx: expects modules fully_shard returned, got {type(module).__name__}"
            )
    if len(modules) < 2:
        return
    shared: dict = {}  # device -> the streams of the first root initialized
    for module in modules:
        state = module._state
        if state.context is not None:
            raise RuntimeError(
                "share_comm_ctx: call it before the modules' first forward (their "
                f"{type(module).__name__} already ran one and holds its streams)"
            )
        state.shared_streams = shared
