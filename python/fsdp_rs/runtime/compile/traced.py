"""Forward hooks that torch.compile traces: the whole sharded model in one graph
(``torch.compile(model, fullgraph=True)``), with the all-gathers and
reduce-scatters in it as functional collectives.

[Note: Traced hooks]
By default fsdp-rs's forward hooks run eager under torch.compile ([Note: Eager
hooks under torch.compile]): Dynamo breaks the graph at each. After
``model.set_fullgraph_compile()`` on the root, Dynamo traces them instead, and
this module is what it traces. It has no state of its own and touches none of
the eager state machine's, so eager calls of the same model (outside compile)
run the eager hooks as before, and the two paths give the same results bit for
bit.

- Before a group's forward: its all-gather input (the sharded buffer, cast to
  the parameter dtype where mixed precision asks), the functional all-gather
  and its wait, then ``fsdp_rs::unshard_copy_out`` into fresh unsharded
  parameters, written into the modules' ``_parameters``. The copy-out's
  autograd formula is the eager post-backward's reduction ([Note: Gradient
  division] included): reduce-scatter copy-in, reduce-scatter, post-reduce
  into a fresh sharded row whose views become the gradients of the sharded
  DTensor parameters (AOT autograd puts them in the backward graph; autograd
  accumulates them into ``.grad`` as it does for any leaf, post-accumulate-grad
  hooks included), and a parameter nothing used gets none ([Note: Unused
  parameters under trace]). A module called twice in one
  forward reuses its group's unsharded parameters, so its gradients are summed
  before the one reduction, as in eager.
- ``reshard_after_forward`` (True or an int): the gather runs inside
  ``torch.utils.checkpoint`` with a policy that recomputes all of it, so the
  forward graph keeps no unsharded parameter for backward and the backward
  gathers again (the min-cut partitioner of ``aot_eager`` and inductor does
  this; an int all-gathers over the whole shard group, as True), at the
  module's backward on every rank ([Note: Regathered on every rank]).
  ``False``: the unsharded parameters are saved, as eager keeps them.
- The root's own groups are gathered inside its forward, and at the end of
  that forward every group's sharded parameters are registered again ([Note:
  The root's groups in its forward]).

What SimpleFSDP (torchtitan) and the traceable-FSDP2 work taught: keep the
collectives functional and the copies functional custom ops with autograd
formulas, so that AOT autograd, selective checkpointing and the partitioner
can reason about them; FSDP2's traced hooks needed compiled autograd and
in-place ``set_`` tricks to free memory inside the graph, which recomputation
makes unnecessary.

Supported: FSDP and HSDP meshes (the replicas' all-reduce in the backward
graph too); floating-point groups sharded on any dim ([Note: Sharding on
another dim]: the copies take the group's chunk table); CPU offload (the shard
copied to the device before the all-gather, the reduced gradient back to the
host before the post-reduce, as in eager); frozen parameters beside trained
ones in a group (LoRA's shape: their unsharded parameters do not require grad,
so no gradient is computed for them, and the trained ones are reduced in the
group's gradient layout, as in eager); DTensor parameters of tensor or expert
parallelism (the unsharded local tensors wrapped by ``DTensor.from_local``
with the parameters' own specs, whose backward brings a gradient to those
placements as the eager post-backward does), ``dp_mesh_dims`` included
([Note: DP dims under trace]), and spmd_types parameters (computed with
plain, each gradient read in its backward types, [Note: spmd_types
parameters]), but not a TP partial gradient that eager sums in a wider dtype
([Note: Gradients under trace are in the parameter dtype]); several
modules in one ``fully_shard`` call (the first module's pre-forward gathers,
the others reuse what it registered: one reduction, as in eager), except at
the root; all-gather extensions that a tensor subclass defines ([Note:
Extensions under trace]); frozen groups of any dtype, gathered as raw bits.
``set_fullgraph_compile`` refuses the rest with the group named. Flags that
can change later and that this path does not follow (no gradient sync, the
replicas' all-reduce off, gradients held from backwards without either, which
the eager reduction sums in, all-reduce hooks, a custom reduce-scatter, a group
unsharded by hand, a ``requires_grad`` changed) make the hooks run eager under
compile: a graph break with the reason, or under ``fullgraph=True`` an error
that names it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp_rs.kernels._dtypes import FLOAT_DTYPES
from fsdp_rs.ops.traced import all_gather_rows, regathered, unshard_copy_out
from fsdp_rs.planning import shapes_to_arrays
from fsdp_rs.runtime.checks.agreement import first_difference
from fsdp_rs.runtime.checks.plan_check import enabled as plan_check_enabled
from fsdp_rs.runtime.checks.plan_check import (
    gather_objects,
    groups_of,
    mesh_dims,
    per_rank,
)
from fsdp_rs.runtime.comm.collectives import unreduced_post_divide
from fsdp_rs.runtime.compile.traced_dtensor import local_of, unsharded_as
from fsdp_rs.runtime.compile.traced_extension import extension_gather, untraceable
from fsdp_rs.runtime.group.unshard import ShardedState
from fsdp_rs.runtime.step.containers import cast_floats, to_device
from fsdp_rs.runtime.variants.extensions import ExtensionGather
from fsdp_rs.runtime.variants.shard_dim import ShardDimGroup

__all__ = ["TracedGroup", "disable", "enable"]


class TracedGroup:
    """What the traced hooks read of one group, as plain Python values made
    eagerly (Dynamo cannot read the planner's arrays), and the registration
    slots they write."""

    def __init__(self, group, modules: list) -> None:
        self.group = group
        self.layout = group.layout
        # its all-gather output in the forward being traced, where it is
        # gathered again in backward ([Note: Regathered on every rank])
        self.gathered: torch.Tensor | None = None
        info = group.info
        self.world = info.shard_size
        # CPU offload: the shard lives on the host and is copied to the compute
        # device before the all-gather, as the eager unshard copies it
        self.compute_device = group.device if group.shard_device != group.device else None
        self.group_name = info.shard_group.group_name if self.world > 1 else ""
        replicas = info.replicate_group
        self.replicate_name = "" if replicas is None else replicas.group_name
        shapes, _ = group.sharding.unsharded_shapes(group)  # contiguous: a plain group's are
        ranks, dims = shapes_to_arrays(shapes)  # the flat form the planner takes too
        self.dims, self.ranks = dims.tolist(), ranks.tolist()
        self.padded_numels = group.plan.padded_sharded_numel.tolist()
        self.local_numels = group.layout.sharded_numels()
        self.tables = group.tables.copy_out_args()
        # [Note: DTensor parameters] what the module computes with, per parameter
        nd = group.nd or [None] * len(shapes)
        self.unsharded_as = [unsharded_as(d, group.param_dtype) for d in nd]
        # sharded on another dim: the copies' chunk table (made here, eagerly);
        # None on dim 0
        self.chunk_numel = group.sharding.chunks(group, None)
        # [Note: Gradient layout] the trained parameters' reduction: read from
        # the sharded parameters now, as the eager unshard reads them
        self.trains = [p.requires_grad for p in group.sharded_params]
        self.trained = [i for i, t in enumerate(self.trains) if t]
        grad_layout = group.grad_layout_of(self.trained)
        self.grad_tables = list(grad_layout.tables.reduce_scatter_args())
        self.grad_row_numel = grad_layout.plan.row_numel
        self.grad_offsets = list(grad_layout.row_offsets)
        self.grad_numels = [self.local_numels[i] for i in self.trained]
        self.grad_chunk_numel = group.sharding.grad_chunks(group, grad_layout, self.trained)
        # (module, name, parameter index) of every registration slot, read and
        # written through the module while traced (the eager swap writes the
        # same slots: [Note: Swapping registered parameters])
        managed = group.managed
        self.slots = list(
            zip(
                managed.slot_modules(modules),
                managed.slot_names,
                managed.slot_index,
                strict=True,
            )
        )
        self.first_slots = managed.first_slots()
        # [Note: Extensions under trace] the unshard of an extension group
        self.extension_gather = (
            extension_gather(self) if isinstance(group.gather, ExtensionGather) else None
        )
        self.refresh()

    def refresh(self) -> None:
        """Read the group's reduction flags (at ``set_fullgraph_compile`` and
        whenever the API changes them): Dynamo cannot trace ``gradient_division``."""
        group = self.group
        self.factor = group.gradient_divide_factor
        self.force_sum = group.force_sum_reduction
        self.reduce_op, self.all_reduce_op, self.pre_divide, self.post_divide = _reduction(group)

    def registered(self) -> list[torch.Tensor]:
        """The object registered for each parameter (its first slot)."""
        return [self.slots[k][0]._parameters[self.slots[k][1]] for k in self.first_slots]

    def register(self, objects: list[torch.Tensor]) -> None:
        for module, name, i in self.slots:
            module._parameters[name] = objects[i]


def _static_reason(state, group) -> str | None:
    """Why ``group`` cannot take the traced hooks at all, or None."""
    from fsdp_rs.runtime.group.param_group import FSDPParamGroup

    if len(state.modules) > 1 and state.is_root:
        # its groups are gathered in the root's forward ([Note: The root's groups
        # in its forward]): one module's
        return (
            "it is the root and shards several modules in one fully_shard call (call "
            "fully_shard on the module that runs them too, before its first forward: that "
            "one becomes the root)"
        )
    if type(group) not in (FSDPParamGroup, ShardDimGroup):
        return f"its parameters are gathered by a {type(group).__name__}"
    if isinstance(group.gather, ExtensionGather):
        why = untraceable(group)  # [Note: Extensions under trace]
        if why is not None:
            return why
    if group.nd is not None and group.widens_grads:
        # [Note: Gradients under trace are in the parameter dtype]
        if any(nd is not None and nd.reduces_outside_dp for nd in group.nd):
            return (
                "a DTensor parameter's gradient is reduced over tensor parallelism in the "
                "wider reduce dtype, which the traced hooks cannot do"
            )
    if group.grad_policy is not None and any(p.requires_grad for p in group.sharded_params):
        return (
            "a parameter sets grad_dtype ([Note: Gradient dtype policy]), which the traced "
            "hooks do not follow"
        )
    if group.orig_dtype not in FLOAT_DTYPES or group.param_dtype not in FLOAT_DTYPES:
        # frozen: gathered as raw bits, as in eager ([Note: Raw copies]); the
        # reduction's arithmetic is the FLOAT_DTYPES'
        if any(p.requires_grad for p in group.sharded_params):
            return f"its dtype {group.orig_dtype} is not floating point and it trains"
    return None


_REASONS = {
    "root": "the root fully_shard module's hooks run eager (compile the root module, "
    "after model.set_fullgraph_compile(); a nested module compiled alone runs them eager)",
    "requires_grad": "a parameter's requires_grad changed since set_fullgraph_compile(): call it "
    "again",
    "no_sync": "gradient sync is off (set_requires_gradient_sync(False))",
    "unreduced": "a group holds gradients of backwards without sync or without the all-reduce "
    "across replicas, which its next reduction must include",
    "comm": "a group has an all-reduce hook, custom comms or a separate reduce-scatter group",
    "unsharded": "a group was unsharded by hand (module.unshard()) and not resharded",
    "replanned": "a group was re-planned (model.to(dtype)) since set_fullgraph_compile(): "
    "call it again",
    "division": "a gradient divide factor needs a pre-multiplied sum",
    "no_all_reduce": "the all-reduce across replicas is off (set_requires_all_reduce(False))",
    "flags": "a group's reduction flags changed other than through its FSDPModule setters",
    "manual": "backward finalization is manual (set_manual_backward_finalization(True))",
    "keep": "a group keeps its unsharded storage (set_keep_unsharded_storage(True))",
}


def _eager_pre(state, module, args, kwargs):
    return state._pre_forward_hook(module, args, kwargs)


def _eager_post(state, module, args, output):
    return state._post_forward_hook(module, args, output)


def _fallback(fn, key: str):
    reason = f"fsdp-rs runs its hooks eager under torch.compile here: {_REASONS[key]}"
    return torch.compiler.disable(fn, recursive=True, reason=reason)


# Immutable: one eager fallback per reason, so that Dynamo's message names it.
_FALLBACK_PRE = {key: _fallback(_eager_pre, key) for key in _REASONS}
_FALLBACK_POST = _fallback(_eager_post, "root")


def _reduction(group) -> tuple[str, str, float, float]:
    """(reduce-scatter op, all-reduce op across replicas, pre-divide,
    post-divide) of the eager post-backward (``_division``, [Note: Gradient
    division]); an op "" where it is a pre-multiplied sum, which the functional
    collectives cannot take."""
    import torch.distributed as dist

    def name(op) -> str:
        return "sum" if op == dist.ReduceOp.SUM else "avg" if op == dist.ReduceOp.AVG else ""

    division = group._division()
    all_reduce = name(division.all_reduce_op) if group.info.replicate_group is not None else "sum"
    if group.info.shard_size == 1:  # no reduce-scatter
        post = unreduced_post_divide(division, group.gradient_divide_factor)
        return "sum", all_reduce, division.pre, post
    return name(division.reduce_scatter_op), all_reduce, division.pre, division.post


def _why_not(context) -> str | None:
    """The first reason (a key of ``_REASONS``) why some group of ``context``
    cannot be traced now, or None."""
    if (
        context.iteration.manual_finalization
        or context.iteration.manual_active
        or context.iteration.pending_reduction is not None
    ):
        return "manual"  # [Note: Manual backward finalization]
    return _why_not_groups(state.traced_groups for state in context.states)


def _why_not_groups(per_state) -> str | None:
    for groups in per_state:
        for traced in groups:
            group = traced.group
            if traced.layout is not group.layout:
                return "replanned"
            if [p.requires_grad for p in group.sharded_params] != traced.trains:
                return "requires_grad"
            if not group.reduce_grads:
                return "no_sync"
            if group.info.replicate_group is not None and not group.all_reduce_grads:
                return "no_all_reduce"
            if group.holds_unreduced_grads():  # the eager reduction sums them in
                return "unreduced"
            if (
                group.all_reduce_hook is not None
                or group.all_gather_comm is not None
                or group.reduce_scatter_comm is not None
                or group.reduce_scatter_group is not None
            ):
                return "comm"
            if group.state != ShardedState.SHARDED or group.unshard_pending:
                return "unsharded"
            if group.keep_unsharded_storage:
                return "keep"
            if (
                group.gradient_divide_factor != traced.factor
                or group.force_sum_reduction != traced.force_sum
            ):
                return "flags"
            if not traced.reduce_op or not traced.all_reduce_op:
                return "division"
    return None


def _recompute_all():
    return create_selective_checkpoint_contexts(
        lambda ctx, func, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE
    )


def _gather(
    traced: TracedGroup, sharded: torch.Tensor, token: torch.Tensor, *local: torch.Tensor
) -> list:
    """The group's unsharded parameters, its token and its all-gather
    output: all-gather and copy-out, differentiable for ``local`` (the
    sharded parameters' local tensors) and ``token`` (the previous group's)."""
    group = traced.group
    source = sharded
    if traced.compute_device is not None:  # CPU offload
        source = source.to(traced.compute_device, non_blocking=True)
    if source.dtype != group.param_dtype:
        source = source.to(group.param_dtype)
    ag = all_gather_rows(source, traced.world, traced.group_name)
    unsharded = unshard_copy_out(
        ag,
        list(local),
        *traced.tables,
        traced.dims,
        traced.ranks,
        traced.padded_numels,
        traced.grad_offsets,
        traced.grad_numels,
        traced.group_name,
        traced.reduce_op,
        traced.pre_divide,
        traced.post_divide,
        group.reduce_dtype,
        traced.replicate_name,
        traced.all_reduce_op,
        traced.chunk_numel,
        traced.trained,
        traced.grad_tables,
        traced.grad_row_numel,
        traced.grad_chunk_numel,
        token,
    )
    return [*unsharded, ag]  # [Note: Regathered on every rank]


def _unshard_all(state, context) -> None:
    """The unshard of ``state``'s groups, each registering its unsharded
    parameters."""
    for traced in state.traced_groups:
        views, gathered = _unshard(traced, context)
        traced.register(views)
        if gathered is not None:  # kept for ``_regather``, to the forward's end
            traced.gathered = gathered


def _regather(state, context) -> None:
    """After ``state``'s module's forward: the current token passed through
    ``regathered`` of its groups' all-gather outputs ([Note: Regathered on
    every rank]). There, its backward runs before the module's: a module's
    groups gathered again in forward order before its backward, on every
    rank."""
    gathered = [t.gathered for t in state.traced_groups if t.gathered is not None]
    if len(gathered) > 0 and context.tracing.token is not None:
        context.tracing.token = regathered(context.tracing.token, gathered)


def _unshard(traced: TracedGroup, context) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The group's unsharded parameters, and its all-gather output where it
    trains and is gathered again in backward."""
    group = traced.group
    registered = traced.registered()
    if registered[0] is not group.sharded_params[0]:  # called again in this forward
        return registered, None
    # [Note: Every group's backward on every rank] a group that trains takes
    # the previous one's token and passes its own on
    # (len: torch 2.9's Dynamo cannot trace bool() of a list under dynamic shapes)
    trains = len(traced.trained) > 0
    chained = trains and context.tracing.token is not None
    token = context.tracing.token if chained else torch.empty(0, device=group.device)
    if traced.extension_gather is not None:
        local = [local_of(p) for p in group.sharded_params]
        flags = (traced.reduce_op, traced.all_reduce_op, traced.pre_divide, traced.post_divide)
        gather = traced.extension_gather
        out = _recomputed(group, gather, *flags, token, *traced.grad_tables, *local)
    else:
        local = [local_of(group.sharded_params[i]) for i in traced.trained]
        out = _recomputed(group, _gather, traced, group.sharded, token, *local)
    *views, token, gathered = out
    if trains:
        context.tracing.token = token
    # DTensor parameters (TP / EP / dp_mesh_dims / spmd_types): ``unsharded_as``
    views = [
        v if wrap is None else wrap(v) for v, wrap in zip(views, traced.unsharded_as, strict=True)
    ]
    return views, gathered if trains and recomputes(group) else None


def recomputes(group) -> bool:
    """Whether ``group``'s gather is recomputed in backward
    (``reshard_after_forward``)."""
    return group.reshard_after_forward is not False and torch.is_grad_enabled()


def _recomputed(group, gather, *args) -> list[torch.Tensor]:
    """``gather(*args)``; with ``reshard_after_forward`` inside a checkpoint
    that recomputes all of it in backward."""
    if recomputes(group):
        return checkpoint(gather, *args, use_reentrant=False, context_fn=_recompute_all)
    return gather(*args)


def pre_forward(state, module, args: tuple, kwargs: dict) -> Any:
    context = state.context
    if state.is_root:
        why = _why_not(context)
        context.tracing.root_traced = why is None
        if why is not None:
            return _FALLBACK_PRE[why](state, module, args, kwargs)
        args, kwargs = to_device(args, kwargs, context.device)
    elif not context.tracing.active:
        return _FALLBACK_PRE["root"](state, module, args, kwargs)
    mp = state.mp_policy
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
    if not state.is_root:  # the root's groups: in its forward (``_root_forward``)
        _unshard_all(state, context)
    return args, kwargs


def post_forward(state, module, args: tuple, output: Any) -> Any:
    context = state.context
    if not (context.tracing.root_traced if state.is_root else context.tracing.active):
        return _FALLBACK_POST(state, module, args, output)
    if not state.is_root:  # the root's: in its forward (``_root_forward``)
        _regather(state, context)
    if state.mp_policy.output_dtype is not None:
        output = cast_floats(output, state.mp_policy.output_dtype)
    return output


def _root_forward(state, forward):
    """The root module's forward while traced hooks are on.

    [Note: The root's groups in its forward]
    ``torch.compile(model)`` runs the root module's own hooks as frames of their
    own and traces its forward as another; the unsharded parameters made in one
    frame and used in the next would be graph outputs (kept alive between the
    graphs, and refused by AOT autograd next to DTensor inputs). So the root's
    groups are gathered inside its forward, and every group's sharded
    parameters registered again at its end: everything the forward made stays
    in its graph. A nested module's unsharded parameters stay registered until
    then, so that a module called twice reuses them (one reduction of the
    summed gradients, as in eager)."""

    def traced_forward(*args: Any, **kwargs: Any) -> Any:
        context = state.context
        if not torch.compiler.is_compiling() or not context.tracing.root_traced:
            return forward(*args, **kwargs)
        context.tracing.active = True
        context.tracing.token = None
        _unshard_all(state, context)
        output = forward(*args, **kwargs)
        _regather(state, context)
        output = _anchor(output, context.tracing.token)
        _register_sharded(context)
        context.tracing.active = False
        return output

    return traced_forward


def _dispatch(state):
    """The hooks registered while traced hooks are on: traced under compile,
    the eager ones otherwise."""

    def pre(module, args, kwargs):
        if torch.compiler.is_compiling():
            return pre_forward(state, module, args, kwargs)
        if state.context is not None and state.context.tracing.active:
            _mixed(state.context)
        return state.pre_forward(module, args, kwargs)

    def post(module, args, output):
        if torch.compiler.is_compiling():
            return post_forward(state, module, args, output)
        return state.post_forward(module, args, output)

    return pre, post


class _Anchor(torch.autograd.Function):
    """The root's outputs passed through, with the last group's token as an
    input ([Note: Every group's backward on every rank])."""

    @staticmethod
    def forward(ctx, token, *outputs):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.token = (token.dtype, token.device)
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        dtype, device = ctx.token
        given = [g for g in grads if g is not None]
        if len(given) == 0:
            return (torch.zeros(0, dtype=dtype, device=device), *grads)
        # an empty view of an output's gradient: what the groups' backwards
        # follow is made from it, so AOT autograd's partitioner keeps them in
        # the backward graph
        first = getattr(given[0], "_local_tensor", given[0])  # a DTensor's
        first = first.reshape(1) if first.dim() == 0 else first
        return (first[:0].reshape(0).to(dtype=dtype, device=device), *grads)


def _anchor(output: Any, token: torch.Tensor | None) -> Any:
    """``output`` with its tensors that require grad passed through
    ``_Anchor``.

    [Note: Every group's backward on every rank]
    A traced group's reduction is its copy-out's backward, which autograd runs
    only where an unsharded parameter got a gradient. A module whose output
    reaches the loss on some ranks only (a branch taken by rank) would skip it
    there, and the ranks' collectives would differ: gloo aborts, NCCL hangs or
    pairs unrelated collectives of one size. So the groups that train are
    chained in forward order by tokens (empty tensors: each copy-out takes the
    previous group's and makes its own), and the root's outputs that require
    grad pass through ``_Anchor``, an identity whose backward gives the last
    token a gradient. Wherever the loss reaches the root's output, every
    group's backward then runs on every rank, in reverse forward order
    ([Note: Backward order]), each giving the previous token a gradient whether
    or not its own parameters got one; a group that got none on some ranks
    then reduces zeros there, and its used-mask check ([Note: Unused
    parameters under trace]) stops every rank with the same error.

    The anchor's backward makes the token's gradient an empty view of an
    output's gradient, and each group's check and (without any gradient) its
    reduce-scatter input are computed from it: AOT autograd's partitioner
    moves what depends on no gradient into the forward graph, so a group
    without gradients on one rank would otherwise reduce in that rank's
    forward, out of the other ranks' order (and the checks of every group ran
    in the forward graphs before this).

    Not covered: with ``reshard_after_forward`` the partitioner gathers a group
    again in backward only where its parameters' gradients are computed, so a
    rank that dropped the module's output issues one all-gather fewer. AOT
    autograd puts the anchor in the compiled graphs (its outputs are then views
    that graph regenerates, which may be modified in place); with the
    ``eager`` backend they stay views made by a custom autograd function, which
    autograd forbids modifying in place (clone them first)."""
    if token is None or not token.requires_grad:
        return output
    leaves, spec = torch.utils._pytree.tree_flatten(output)
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(at) == 0:
        return output
    passed = _Anchor.apply(token, *(leaves[i] for i in at))
    for i, t in zip(at, passed, strict=True):
        leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _register_sharded(context) -> None:
    """Every group's sharded parameters registered again."""
    context.tracing.token = None
    for state in context.states:
        for traced in state.traced_groups:
            traced.register(traced.group.sharded_params)
            traced.gathered = None


def _mixed(context) -> None:
    context.tracing.active = False
    _register_sharded(context)
    raise RuntimeError(
        "fsdp_rs: a fully_shard module ran its forward eager inside a root forward "
        "that torch.compile traced (Dynamo ran part of the forward eager after a graph "
        "break); compile with fullgraph=True to find the break and remove it, or turn "
        "the traced hooks off with model.set_fullgraph_compile(False)"
    )


def _agree(root, problems: list[str], why_not: str | None, traced: list) -> None:
    """Every rank of the root's mesh takes the same path, or all raise.

    [Note: One decision for all ranks]
    Whether the traced hooks run is decided per rank, from what it reads: the
    groups' settings, their flags and ``requires_grad``. Ranks that decided
    differently would issue other collectives (the traced path's functional ones
    against the eager hooks' with their gradient agreement) and hang; ranks
    that train different parameters would reduce them in other layouts, one
    parameter's gradient summed into another's ([Note: One trainable set on
    every rank]). So ``set_fullgraph_compile`` compares the decisions and the
    trainable sets of all ranks (one ``all_gather_object`` over the mesh,
    once) and raises on every rank, with each rank's reason, where they
    differ. Later flag changes are the user's to
    make on every rank, as for the FSDPModule setters; Dynamo's guards on them
    recompile each rank on its own, where no collective can be added."""
    dims = mesh_dims(root.mesh_info) if plan_check_enabled() else []
    if not dims:
        return
    trains = tuple(tuple(t.trains) for groups in traced for t in groups)
    mine = (tuple(problems), why_not, trains)
    everyone = gather_objects(mine, dims)
    if len({decision for _, decision in everyone}) == 1:
        return
    if len({decision[:2] for _, decision in everyone}) == 1:  # the same path
        raise RuntimeError(
            "set_fullgraph_compile: the ranks train different parameters, so their "
            "gradients would be reduced in other layouts: "
            + _first_trains_difference(root, traced, everyone)
            + ". Set requires_grad the same way on every rank before calling it"
        )

    def text(decision) -> str:
        problems, why, _ = decision
        if problems:
            return "cannot trace: " + "; ".join(problems)
        return "traced hooks" if why is None else f"eager hooks: {_REASONS[why]}"

    raise RuntimeError(
        "set_fullgraph_compile: the ranks would not take the same path under torch.compile, "
        "so their collectives would not match:"
        + per_rank([(r, text(d)) for r, d in everyone])
        + "\nSet the same flags (set_requires_gradient_sync, hooks, requires_grad...) on "
        "every rank before calling it"
    )


def _first_trains_difference(root, traced: list, everyone: list) -> str:
    """The first parameter whose ``requires_grad`` differs between the ranks'
    trainable sets in ``everyone`` (``_agree``'s gathered decisions), with
    each rank's value."""
    name_of = {id(m): n for module in root.modules for n, m in module.named_modules()}
    groups, names = [], {}
    for state, per_state in zip(root.context.states, traced, strict=True):
        for t in per_state:
            groups.append(t.group)
            names[id(t.group)] = [name_of.get(id(m), "") for m in state.modules]
    sets = [decision[2] for _, decision in everyone]
    found = first_difference(groups, sets, [rank for rank, _ in everyone], names)
    return "(not found)" if found is None else found


def enable(root) -> None:
    """Traced hooks for every fully_shard module under ``root`` (an
    ``FSDPState``); see [Note: Traced hooks]."""
    if root.context is None:
        root._lazy_init()
    if not root.is_root:
        raise ValueError(
            "set_fullgraph_compile must be called on the root fully_shard module (the "
            "outermost one, which the forward runs through), not on a module nested in it"
        )
    context = root.context
    problems = []
    for state in context.states:
        for group in groups_of(state):
            why = _static_reason(state, group)
            if why is not None:
                names = ", ".join(type(m).__name__ for m in state.modules)
                problems.append(f"{names}: {why}")
    traced = (
        []
        if problems
        else [[TracedGroup(g, s.modules) for g in groups_of(s)] for s in context.states]
    )
    why_not = _why_not_groups(traced)
    _agree(root, problems, why_not, traced)
    if problems:
        raise ValueError(
            "set_fullgraph_compile: these fully_shard groups cannot be traced: "
            + "; ".join(problems)
            + ". Compile without it (the hooks then run eager, with a graph break at each)"
        )
    for state, groups in zip(context.states, traced, strict=True):
        state.traced_groups = groups
        state.use_hooks(*_dispatch(state))
    module = root.modules[0]
    own = vars(module)
    if own.get("forward") is not own.get("_fsdp_rs_traced_forward", False):
        # [Note: The root's groups in its forward] (over a forward set on the instance too)
        module._fsdp_rs_own_forward = own.get("forward")
        module.forward = _root_forward(root, module.forward)
        module._fsdp_rs_traced_forward = module.forward


def disable(root) -> None:
    """The eager hooks again everywhere under ``root``."""
    context = root.context
    if context is None:
        return
    for state in context.states:
        state.traced_groups = []
        state.use_hooks(state.pre_forward, state.post_forward)
    module = root.modules[0]
    own = vars(module)
    if "_fsdp_rs_traced_forward" in own:
        if own.get("forward") is own["_fsdp_rs_traced_forward"]:
            previous = own.pop("_fsdp_rs_own_forward")
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        own.pop("_fsdp_rs_own_forward", None)
        del module._fsdp_rs_traced_forward
