"""One parameter group: one planner call, the group buffers and the sharded
and unsharded parameters over them. The transitions between them are in
``unshard`` (``Unsharding``), the gradient side in ``gradients``
(``GradientReduction``, the post-backward) and ``grad_assign``
(``GradAssignment``, the sharded ``.grad`` views; an object the group holds);
what varies between groups is in the strategies the group holds, ``gather``
(``GatherStrategy``) and ``sharding`` (``Sharding``).

Per step a group makes O(1) op and collective calls; the only per-parameter
work is reading the gradients autograd hands over and the C-level swaps of
[Note: Swapping registered parameters].

[Note: Adopting registered parameters]
The sharded DTensor parameters are the objects users hold (optimizers, hooks
from ``register_post_accumulate_grad_hook``, attributes), so their identity is
never changed. ``module.to`` / ``to_empty`` / ``cuda`` swap new data into the
same objects (``nn.Module._apply`` uses ``swap_tensors`` for DTensors), and
``load_state_dict(assign=True)`` registers other objects (Hugging Face
accelerate's RAM-efficient loading then hands those to the optimizer). Either
way the group adopts what is registered: it copies their local shards into a
fresh sharded buffer and points each object's local tensor at its view there,
as FSDP2 re-points its parameters at its padded storage. A new dtype for all
(``model.to(torch.float64)``) re-plans the group in it; new shapes, shards of
another mesh or mixed dtypes are refused with the parameter named. While some
of them are still on the meta device (``to_empty`` of one module of a group
over several) it waits; lazy init adopts before the first forward.

[Note: Trainable set changes]
Which parameters train decides the gradient layout ([Note: Gradient layout]),
the unsharded parameters' ``requires_grad`` and the pre-placed gradient
buffer, all made with the unsharded parameters. A user may freeze or unfreeze
sharded parameters between steps (a backbone frozen for the first steps, LoRA
stages), and FSDP2 follows at every unshard. So each unshard outside backward,
from SHARDED, compares the sharded parameters' ``requires_grad`` with the set
it planned (one C-level pass) and, where it changed, makes the unsharded
parameters again, as at the first unshard, over the same unsharded storage
(``set_keep_unsharded_storage`` keeps its data pointers). In backward the
forward's set stays: autograd recorded the forward on those parameters.

A group can also meet the change still unsharded (or holding post-forward
rows): the root keeps its parameters after forward, so an evaluation forward
under ``torch.no_grad()`` between steps leaves it UNSHARDED, and the next
training forward's unshard has nothing to do. Followed only from SHARDED, a
parameter unfrozen there never trained (and FSDP2, which sets
``requires_grad`` only when it moves to UNSHARDED, trains it one step late
and a frozen one one step more). Whether an autograd graph may hold the
unsharded parameters is the group's training state ([Note: Training state]):
from a forward with grad enabled to the end of its backward. Without one, the unshard reshards and
unshards again from the shards (one all-gather, only when the set changed);
with one (a second forward before the backward, or a forward with grad
enabled whose backward never ran), making the parameters again would leave
that graph's gradients on the old ones, so it raises, naming the parameter and
the fix. Gradients of the old set that no reduction has taken
(backwards without sync) would lose their layout: that raises, naming the
parameter. Sharded ``.grad``s kept from before (``zero_grad(set_to_none=False)``)
are views of the old gradient buffer, which the next reduction treats as any
gradient the user set: it adds to them per parameter.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)
from fsdp_rs.kernels._dtypes import is_copyable
from fsdp_rs.ops import EagerOps
from fsdp_rs.runtime.api.policies import accumulates_wider, reduce_dtype_for
from fsdp_rs.runtime.checks.agreement import trained_digest
from fsdp_rs.runtime.comm.mesh import MeshInfo
from fsdp_rs.runtime.comm.streams import NO_STREAMS
from fsdp_rs.runtime.group.gather import ROW_GATHER, GatherStrategy
from fsdp_rs.runtime.group.grad_dtypes import (
    UNSET,
    GradPolicy,
    grad_settings,
    overrides_grad_dtype,
    promoted,
)
from fsdp_rs.runtime.group.gradients import GradientReduction
from fsdp_rs.runtime.group.layout import LayoutKey, group_layout
from fsdp_rs.runtime.group.params import ManagedParams, alias_storage, own_requires_grad
from fsdp_rs.runtime.group.sharding import DIM0, Sharding
from fsdp_rs.runtime.group.unshard import ShardedState, Unsharding, post_forward_process_group
from fsdp_rs.runtime.step.training_state import TrainingState, in_autograd_backward
from fsdp_rs.runtime.variants.nd import dtensor_params
from fsdp_rs.runtime.variants.spmd_annotations import annotated_params

__all__ = ["FSDPParamGroup", "ShardedState"]


class _Specs:
    """DTensor specs of one mesh, made once per distinct (shape, stride, dtype).

    [Note: Cheap sharded parameters]
    ``nn.Parameter(DTensor.from_local(...))``, what FSDP2 builds per parameter,
    goes through autograd, ``DTensor.__init__`` (wrapped to disable dynamo:
    about 80 us) and ``detach`` (a DTensor dispatch), and builds a fresh spec
    (about 15 us). fsdp-rs calls ``DTensor.__new__`` (the C constructor; the
    ``__init__`` it skips does nothing) over its view of the buffer, marks the
    result a parameter the way ``nn.Parameter.__new__`` marks tensor subclasses
    (``_is_param``), and shares one spec between all parameters of a mesh with
    the same shape and dtype (specs are never mutated once made)."""

    _by_mesh: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, info: MeshInfo) -> None:
        self.info = info
        self._cache = self._by_mesh.setdefault(info.mesh, {})

    def __call__(self, shape: torch.Size, stride: tuple[int, ...], dtype) -> DTensorSpec:
        key = (self.info.placements, shape, stride, dtype)
        spec = self._cache.get(key)
        if spec is None:
            meta = TensorMeta(torch.Size(shape), stride, dtype)
            spec = DTensorSpec(self.info.mesh, key[0], tensor_meta=meta)
            self._cache[key] = spec
        return spec


_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_new_dtensor = DTensor.__new__


def _dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    """A DTensor over ``local`` (no copy); see [Note: Cheap sharded parameters]."""
    return _new_dtensor(DTensor, local, spec, requires_grad=requires_grad)


def _parameter(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    param = _dtensor(local, spec, requires_grad)
    param._is_param = True  # isinstance(param, nn.Parameter), as nn.Parameter marks subclasses
    return param


_NEW_PARAM = {
    flag: functools.partial(_new_dtensor, DTensor, requires_grad=flag) for flag in (False, True)
}


def _parameters(
    locals_: list[torch.Tensor], specs: list[DTensorSpec], requires_grad: list[bool]
) -> list[DTensor]:
    """``_parameter`` of each, in C-level passes where all parameters share one
    ``requires_grad`` (the usual case: [Note: fully_shard's cost per parameter])."""
    if len(set(requires_grad)) > 1:
        return list(map(_parameter, locals_, specs, requires_grad))
    make = _NEW_PARAM[bool(requires_grad and requires_grad[0])]
    params = list(map(make, locals_, specs))
    deque(map(setattr, params, itertools.repeat("_is_param"), itertools.repeat(True)), maxlen=0)
    return params


_EXTENSION = "fsdp_pre_all_gather"  # [Note: All-gather extensions]


class FSDPParamGroup(Unsharding, GradientReduction):
    """One ``fully_shard`` group of parameters of one dtype and mesh. What
    varies between groups is held, not subclassed: ``gather`` (a
    ``GatherStrategy``: the row-layout buffer, or all-gather extensions) and
    ``sharding`` (a ``Sharding``: dim 0, or other dims)."""

    # [Note: Parked gradient buffers] (``grad_buffers``): the buffer and views kept
    # across ``FlatOptimizer.zero_grad``, while it runs and until the next reduction
    _holding: tuple | None = None
    _parked: tuple | None = None
    annotations: list | None = None  # [Note: spmd_types parameters]

    def __init__(
        self,
        managed: ManagedParams,
        modules: Sequence[nn.Module],
        info: MeshInfo,
        mp_policy,
        offload_to_cpu: bool,
        pin_memory: bool,
        post_forward_size: int | None,
        *,
        grad_policy: GradPolicy | None = None,
        gather: GatherStrategy = ROW_GATHER,
        sharding: Sharding = DIM0,
    ) -> None:
        self.gather = gather
        self.sharding = sharding
        self.dims = sharding.dims  # the dim FSDP shards per parameter; None: all 0
        self.managed = managed
        self.grad_policy = grad_policy  # [Note: Gradient dtype policy]
        # each parameter's own setting, which its sharded parameter keeps
        self._grad_settings = grad_settings(managed.params)
        self.modules = tuple(modules)
        self.info = info
        self.device = info.device
        params = managed.params
        # [Note: spmd_types parameters] annotated ones become DTensors first
        annotated = annotated_params(managed.fqns, params, info)
        if annotated is not None:
            params, self.annotations = annotated
        # [Note: DTensor parameters] their local tensors are what is sharded
        self.nd = dtensor_params(managed.fqns, params, info, self.dims)
        if annotated is not None:
            for nd, annotation in zip(self.nd, self.annotations, strict=True):
                nd.annotation = annotation
        self.requires_grad = list(map(_REQUIRES_GRAD, params))
        if self.nd is not None:
            params = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
        self._check_params(params)
        self.mp_policy = mp_policy
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory and offload_to_cpu and torch.cuda.is_available()
        # of what is sharded (local shapes), as planned
        self.shapes = sharding.planned_shapes(self, list(map(_SHAPE, params)))
        self.post_forward_size = post_forward_size
        self._set_dtypes(params[0].dtype)
        self.ops = EagerOps(self.device)  # [Note: Eager op calls]
        self.shard_ops = EagerOps(self.shard_device)
        self._specs = _Specs(info)
        self.post_forward_group = (
            post_forward_process_group(info, post_forward_size)
            if post_forward_size not in (None, 1, info.shard_size)
            else None
        )
        # flags the state, the API and the hooks set
        self.state = ShardedState.SHARDED
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        # the forward's and backward's unshards as asynchronous collectives on the
        # current stream instead of the all-gather streams (_set_unshard_async_op)
        self.unshard_async_op = False
        # [Note: Labels and logs] the modules' names, and the root's Context, from lazy init
        self.fqn = ""
        self.step_context = None
        self.keep_unsharded_storage = False  # set_keep_unsharded_storage
        self.all_gather_comm = None  # [Note: Comm objects]
        self.reduce_scatter_comm = None
        self.reduce_scatter_group = None  # set_separate_reduce_scatter_group
        self.reduce_scatter_unused_params = False
        self.reduce_scatter_max_input_buffers = 1
        self.gradient_divide_factor: float | None = None
        self.all_reduce_hook = None
        self.force_sum_reduction = False
        self.reshard_after_forward: bool | int = True
        # set by the hooks: [Note: Training state]
        self.training_state = TrainingState.IDLE
        # (work of an async collective, all-gather output, its event, all-gather input)
        self._pending_unshard: tuple | None = None
        self.streams = NO_STREAMS  # the root's, from lazy init
        self._post_forward_event = None  # recorded after the post-forward rows' clone
        self._post_forward_rows: torch.Tensor | None = None
        # (all-gather output, first row, rows) this rank keeps at a post-forward reshard
        self._ag_rows: tuple[torch.Tensor, int, int] | None = None
        self._init_gradients()
        if self.nd is not None:
            self.preplace_grads = False  # autograd hands over DTensors
        if not (gather.preplaces_grads and sharding.preplaces_grads):
            self.preplace_grads = False
        gather.build_sharded(self, params)

    # ------------------------------------------------------------------ init

    def _set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """The group's dtypes (original, unsharded, reduce) and the layout that
        follows from them: at ``fully_shard``, and again when the registered
        parameters come back in another dtype (``model.to(torch.float64)``)."""
        mp_policy = self.mp_policy
        self.orig_dtype = orig_dtype
        # As FSDP2: mixed precision casts floating-point parameters only (float8
        # included); integer, bool and complex ones are gathered as they are.
        cast = mp_policy.param_dtype if orig_dtype.is_floating_point else None
        self.param_dtype = cast or orig_dtype
        self.reduce_dtype = reduce_dtype_for(mp_policy, orig_dtype, self.param_dtype)
        # The sharded gradients' dtype and the one autograd accumulates in: the
        # original and the reduce dtype, unless the parameters set a grad_dtype
        # ([Note: Gradient dtype policy]).
        self.grad_dtype = orig_dtype
        self.accumulate_dtype = self.reduce_dtype
        policy = self.grad_policy
        if policy is not None:
            if policy.override is not None:
                self.grad_dtype = policy.override
                self.accumulate_dtype = mp_policy.reduce_dtype or policy.override
            if mp_policy.reduce_dtype is None:
                self.reduce_dtype = promoted({self.accumulate_dtype, *policy.promote})
        self.widens_grads = accumulates_wider(self.accumulate_dtype, self.param_dtype)
        # An accumulation dtype neither the compute dtype nor a wider one: autograd
        # casts every gradient to it (FSDP2 sets it on its unsharded parameters).
        fixed = policy is not None and not self.widens_grads
        self.fixed_grad_dtype = (
            self.accumulate_dtype if fixed and self.accumulate_dtype != self.param_dtype else None
        )
        self.layout = self._layout_of(tuple(self.shapes))  # [Note: Shared group layouts]
        self.plan = self.layout.plan
        self.tables = self.layout.tables
        # Contiguous strides are those of the full, padded and sharded shapes alike.
        self.strides = self.layout.strides

    def _layout_of(self, shapes: tuple[torch.Size, ...]):
        """The shared layout of parameters of ``shapes`` in this group's dtypes and
        place in the mesh."""
        return group_layout(
            LayoutKey(
                shapes,
                self.orig_dtype,
                self.param_dtype,
                self.reduce_dtype,
                self.info.shard_size,
                self.info.shard_rank,
                self.post_forward_size,
                self.device,
            )
        )

    def _check_params(self, params: list[nn.Parameter]) -> None:
        devices = set(map(_DEVICE, params))
        if len(devices) > 1:
            listing = ", ".join(
                f"{fqn}: {p.device}" for fqn, p in zip(self.managed.fqns, params, strict=True)
            )
            raise ValueError(
                f"fully_shard: the parameters are on different devices ({listing}); move the "
                "module to one device first (module.to(device)), or create all on the meta device"
            )
        if devices and (device := devices.pop()).type != self.device.type:
            if device.type not in ("cpu", "meta"):
                raise ValueError(
                    f"fully_shard: parameters are on {device} but the mesh is on "
                    f"{self.device}; move the module to {self.device} or build the mesh "
                    f"for {device.type}"
                )
        # C-level passes first; the loop below names the first offender.
        if (
            all(map(torch.Tensor.dim, params))
            and all(map(is_copyable, set(map(_DTYPE, params))))
            and all(map(torch.Tensor.is_contiguous, params))
        ):
            return
        for fqn, p in zip(self.managed.fqns, params, strict=True):
            if p.dim() == 0:
                raise ValueError(
                    f"fully_shard doesn't support scalar parameters (FSDP shards dim 0). "
                    f"Change {fqn.rpartition('.')[2]} to a 1D tensor with numel equal to 1. "
                    f"(parameter {fqn}), or pass it in ignored_params"
                )
            if not is_copyable(p.dtype):
                raise TypeError(
                    f"fully_shard: parameter {fqn} has the quantized dtype {p.dtype}, which "
                    "is not plain memory and cannot be sharded: pass it in ignored_params"
                )
            if not p.is_contiguous():
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: parameter {fqn} "
                    f"(shape {tuple(p.shape)}, stride {p.stride()}) is not contiguous; make it "
                    "contiguous before sharding, e.g. param.data = param.data.contiguous()"
                )

    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.offload_to_cpu else self.device

    def _alloc_sharded(self, device: torch.device) -> torch.Tensor:
        buf = torch.zeros(self.plan.row_numel, dtype=self.orig_dtype, device=device)
        if self.pin_memory and device.type == "cpu":
            buf = buf.pin_memory()
        buf._fsdp_rs_group = weakref.ref(self)  # [Note: Whole gradient buffers]
        return buf

    def _reduce_list(self, grads: list[torch.Tensor | None]) -> None:
        """``GradientReduction._reduce_list``, after the gather strategy made
        subclass gradients plain where it has to."""
        gather = self.gather
        if gather.reads_subclass_grads:  # [Note: All-gather extensions]
            gather.plain_grads(self, grads)
        GradientReduction._reduce_list(self, grads)

    def _make_sharded_params(self, requires_grad: list[bool], views: list[torch.Tensor]) -> None:
        specs = self.sharding.sharded_specs(self, self.sharded.dtype)
        self.sharded_params: list[DTensor] = _parameters(views, specs, requires_grad)
        self._keep_grad_dtype()
        self._read_requires_grad()
        self.unsharded_params: list[nn.Parameter] | None = None

    def _keep_grad_dtype(self) -> None:
        """The sharded parameters keep the ``grad_dtype`` the originals set, as
        FSDP2's do ([Note: Gradient dtype policy]); a replacement (``model.to()``)
        that sets none gets it again."""
        settings = self._grad_settings
        if settings.count(UNSET) == len(settings):  # none set: one C-level pass
            return
        for p, setting in zip(self.sharded_params, settings, strict=True):
            if setting is not UNSET and not overrides_grad_dtype(p):
                p.grad_dtype = setting

    def _read_requires_grad(self) -> None:
        """Which parameters take gradients, from the sharded ones: read again when
        the unsharded parameters are made (the first unshard, and after
        [Note: Trainable set changes]), so that freezing sharded parameters
        before a forward takes effect."""
        self.requires_grad = own_requires_grad(self.sharded_params)
        # compared across ranks before reducing: [Note: One trainable set on every rank]
        self.trained_digest = trained_digest(self.requires_grad)
        self._grad_params = list(itertools.compress(self.sharded_params, self.requires_grad))
        self._grad_index = list(itertools.compress(itertools.count(), self.requires_grad))
        self.grad_assign.forget_views()  # views of the old parameters
        self._grad_nd = None if self.nd is None else [self.nd[i] for i in self._grad_index]
        self.grad_layout = self.grad_layout_of(self._grad_index)

    def requires_grad_now(self) -> list[bool]:
        """The sharded parameters' ``requires_grad``, after taking what the user
        set on the registered parameters while they were the unsharded ones
        (``model.parameters()`` between an evaluation forward and the next
        step): such a change is copied to the sharded parameter, which outlives
        the unsharded one ([Note: Trainable set changes])."""
        now = own_requires_grad(self.sharded_params)
        if self.state is not ShardedState.UNSHARDED or self.unsharded_params is None:
            return now
        registered = list(map(_REQUIRES_GRAD, self.unsharded_params))
        if registered == self.requires_grad:
            return now
        for i, (flag, planned) in enumerate(zip(registered, self.requires_grad, strict=True)):
            if flag != planned and now[i] != flag:
                self.sharded_params[i].requires_grad_(flag)
                now[i] = flag
        return now

    def trainable_set_changed(self) -> bool:
        """Whether an unshard must make the unsharded parameters again because a
        sharded parameter's ``requires_grad`` changed ([Note: Trainable set
        changes]); raises where gradients of the old set wait for a reduction."""
        if self.unsharded_params is None or in_autograd_backward():  # backward: the forward's set
            return False
        now = self.requires_grad_now()
        if now == self.requires_grad:
            return False
        if self.state is not ShardedState.SHARDED and self.training_state.holds_graph:
            raise self._change_refused(
                now,
                "while its unsharded parameters are held by the autograd graph of a "
                "forward whose backward has not run; change requires_grad after that "
                "backward, run forwards you do not backward under torch.no_grad(), or "
                "call reshard() on the module first",
            )
        if self.holds_unreduced_grads():
            raise self._change_refused(
                now,
                "while this group holds gradients of backwards without sync (or not yet "
                "reduced); change requires_grad after the synced backward (or call "
                "reset_iter_state() to drop those gradients)",
            )
        return True

    def _change_refused(self, now: list[bool], why: str) -> RuntimeError:
        """The error for a trainable-set change that cannot be followed: names the
        first parameter changed, then ``why`` and the fix."""
        i = list(map(operator.ne, now, self.requires_grad)).index(True)
        return RuntimeError(
            f"fsdp_rs: requires_grad of {self.managed.fqns[i]} changed to {now[i]} {why}"
        )

    def grad_layout_of(self, index: list[int]):
        """The layout the gradients of the parameters at ``index`` (the
        trainable ones) are reduced in ([Note: Gradient layout]): the group's
        own where every parameter trains or none does."""
        if not index or len(index) == len(self.shapes):
            return self.layout
        return self._layout_of(tuple(self.shapes[i] for i in index))

    def adopt_registered(self) -> None:
        """Re-point the group at the registered parameters when something replaced
        them or their data; see [Note: Adopting registered parameters]."""
        self.gather.adopt_registered(self)

    def _relayout(self, params: list[DTensor], locals_: list[torch.Tensor]) -> None:
        """``params`` (with local shards ``locals_``) become the group's sharded
        parameters, their shards copied into a new buffer of the current layout."""
        self.sharded = self._alloc_sharded(self.shard_device)
        views = self.sharding.local_views(self, self.sharded)
        with torch.no_grad():
            torch._foreach_copy_(views, locals_)
        spec_of = self.sharding.spec_of
        for i, (p, view) in enumerate(zip(params, views, strict=True)):
            p._local_tensor = view
            p._spec = spec_of(self, i, view.dtype)
        self.sharded_params = params
        self._keep_grad_dtype()
        self._read_requires_grad()
        self.unsharded_params = None

    def set_grad_policy(self, policy: GradPolicy | None) -> None:
        """Take ``grad_dtype`` settings made on the sharded parameters after
        ``fully_shard`` (FSDP2 reads them at lazy init): the group's gradient
        dtypes, and its layout where they change it ([Note: Gradient dtype
        policy]). Before the first unshard only."""
        self.grad_policy = policy
        self._grad_settings = grad_settings(self.sharded_params)
        layout = self.layout
        self._set_dtypes(self.orig_dtype)
        if (
            self.layout.row_offsets != layout.row_offsets
            or self.plan.row_numel != layout.plan.row_numel
        ):
            self._relayout(self.sharded_params, [p._local_tensor for p in self.sharded_params])
        else:
            self._read_requires_grad()

    def _check_registered_dtensors(self, current: list[torch.Tensor]) -> None:
        for fqn, p in zip(self.managed.fqns, current, strict=True):
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"fsdp_rs: parameter {fqn} was replaced by a {type(p).__name__}; after "
                    "fully_shard, load sharded state (DTensors, e.g. from model.state_dict() or "
                    "torch.distributed.checkpoint) or use load_state_dict without assign=True"
                )

    def gained_extension(self) -> bool:
        """Whether a local shard was given an all-gather extension since
        ``fully_shard`` (``variants.extensions.check_extensions`` acts on it)."""
        registered = self.managed.registered()
        return any(
            isinstance(p, DTensor) and hasattr(p._local_tensor, _EXTENSION) for p in registered
        )

    @property
    def on_meta(self) -> bool:
        """Some parameter is still on the meta device."""
        return self.gather.on_meta(self)

    def _check_adopted(self, params: list[DTensor], locals_: list[torch.Tensor]) -> None:
        """What ``adopt_registered`` can take: the shapes the group was planned
        for, this rank's shard of each, one dtype."""
        for i, (fqn, p, t) in enumerate(zip(self.managed.fqns, params, locals_, strict=True)):
            spec = self.sharding.spec_of(self, i, p.dtype)
            shape, stride = spec.tensor_meta.shape, spec.tensor_meta.stride
            if p.shape != shape or tuple(p.stride()) != tuple(stride):
                raise ValueError(
                    f"fsdp_rs: parameter {fqn} was replaced by a DTensor of shape "
                    f"{tuple(p.shape)} (stride {p.stride()}); it was sharded with shape "
                    f"{tuple(shape)}, stride {tuple(stride)}: load state of the same model"
                )
            local_shape = self.sharding.local_shape(self, i)
            if tuple(t.shape) != tuple(local_shape):
                raise ValueError(
                    f"fsdp_rs: parameter {fqn} was replaced by a DTensor whose local shard "
                    f"has shape {tuple(t.shape)}; this rank's shard has shape "
                    f"{tuple(local_shape)}: load state sharded over the same mesh and dims"
                )
        dtypes = {t.dtype for t in locals_}
        if len(dtypes) > 1:
            listing = ", ".join(
                f"{fqn}: {t.dtype}" for fqn, t in zip(self.managed.fqns, locals_, strict=True)
            )
            raise ValueError(
                "fsdp_rs: the parameters of one fully_shard group now have several dtypes "
                f"({listing}); convert the whole module (module.to(dtype)) or none of it"
            )

    def restore_types(self, spmd) -> None:
        """Give the unsharded parameters their ``spmd_types`` annotations back for
        the forward ([Note: spmd_types parameters])."""
        if self.annotations is None:
            return
        for param, annotation in zip(self.unsharded_params, self.annotations, strict=True):
            if annotation is not None:
                annotation.restore(spmd, param)

    def _make_unsharded_params(self) -> None:
        self._read_requires_grad()
        plan = self.plan
        old = getattr(self, "unsharded", None)
        if (  # [Note: Trainable set changes] the same storage, kept or not
            old is None
            or old.numel() != plan.unsharded_numel
            or old.dtype != self.param_dtype
            or old.device != self.device
        ):
            self.unsharded = torch.empty(
                plan.unsharded_numel, dtype=self.param_dtype, device=self.device
            )
        offsets = plan.unsharded_offsets.tolist()
        storage = self.unsharded.untyped_storage()
        shapes, strides = self.sharding.unsharded_shapes(self)
        self.unsharded_params = [
            nn.Parameter(alias_storage(storage, self.unsharded, off, s, st), requires_grad=rg)
            for off, s, st, rg in zip(offsets, shapes, strides, self.requires_grad, strict=True)
        ]
        if self.nd is not None:  # [Note: DTensor parameters]
            # an annotated parameter stays plain: [Note: spmd_types parameters]
            self.unsharded_params = [
                p
                if nd is None or nd.annotation is not None
                else _parameter(p.detach(), nd.unsharded_spec(p.dtype), rg)
                for p, nd, rg in zip(
                    self.unsharded_params, self.nd, self.requires_grad, strict=True
                )
            ]
        self._unsharded_with_grad = [self.unsharded_params[i] for i in self._grad_index]
        self._fix_grad_dtypes()
        self._widened = self._unsharded_with_grad  # [Note: Wider gradient accumulation]
        if self.nd is not None and self.widens_grads:
            outside = [nd is not None and nd.reduces_outside_dp for nd in self.nd]
            for p, out in zip(self.unsharded_params, outside, strict=True):
                if out:
                    p.grad_dtype = self.accumulate_dtype
            self._widened = [self.unsharded_params[i] for i in self._grad_index if not outside[i]]
        if self.preplace_grads:
            self._make_grad_aliases()
        self._free_unsharded()
