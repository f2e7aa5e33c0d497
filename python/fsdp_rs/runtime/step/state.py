"""Module hooks: unshard before forward, reshard after, unshard again before
backward, reduce after; the root's lazy init and its end-of-backward callback.

[Note: Root and lazy init]
The first ``fully_shard`` module whose forward runs while no other one's forward
is running is the root. At that first forward it collects every fsdp-rs state
in its subtree into one ``Context``, decides ``reshard_after_forward=None``
(False for the root, which is about to be used by backward anyway, True for the
others), adopts parameters replaced since ``fully_shard`` (``to_empty``,
``load_state_dict(assign=True)``), and checks that every rank of its mesh
planned the same groups ([Note: Cross-rank plan check]).

[Note: Groups over several modules]
A group over several modules (``fully_shard([norm, lm_head])``) reduces once
per backward, as FSDP2 does: only the call that begins the group's forward
(the first of its modules to run) registers the post-backward on its inputs,
whose gradients are complete once every later module of the group ran
backward. Each module call still registers the pre-backward on its outputs.
A module of the group whose backward comes after that point (modules on
parallel branches, a module called again later) leaves its gradients on the
unsharded parameters and the end-of-backward callback reduces them. Reducing
per module call instead cost a reduce-scatter, a reshard and an all-gather
more per backward, and summed the group's gradients in another order than
FSDP2 (bf16 gradient accumulation then differed by a few ulps).

[Note: A backward that raised]
A backward that raises midway (a second ``backward()`` through a freed graph,
an exception from a user's hook or loss, caught by the caller) never reaches
the end-of-backward callback: groups stay unsharded with the registered
unsharded parameters, their ``.grad``s hold partial gradients, the root's
backward order stays set and the groups' training states are not IDLE. The
next step then ran on that state: its forward on stale unsharded parameters,
its backward without an end-of-backward callback (the root looked as if one
were queued), and gradients added to the leftovers (twice the last layer's,
say). FSDP2 leaves the same state and asks for ``reset_iter_state()`` on the
root. fsdp-rs needs none: a backward of the root runs from its first hook
until its callback runs ([Note: Training state]), so a root forward that finds
one running while no backward runs on this thread (a recomputation inside
backward is one that does) follows a backward that never finished, and runs
``reset_iter_state()`` first. That reset is local (it waits for the
collectives in flight and discards, it issues none), and the ranks that ran
the same backward raised at the same point, so each starts clean alike. What
the failed iteration left is dropped, as ``reset_iter_state()`` documents
(gradients accumulated without sync among them); the ``.grad``s already
assigned stay. The check costs one attribute read per root forward.

[Note: Backward hooks]
Before a module's backward, a multi-grad hook on its forward outputs unshards
its group (unless still unsharded) and prefetches the group that ran before it
in forward. After the module's backward, an autograd function applied to its
forward inputs reduces the gradients; with one input that needs a gradient, a
pre-hook on the node of a view of it does (that node runs once the view's
gradient is complete, when the function would; the hook costs a fraction of
the function's forward and backward). Groups whose inputs need no gradient (the
root, usually) are reduced by the root's end-of-backward callback, which also
reshards every group and resets the per-iteration state. Every rank visits
the groups' backward events in one order, replaying those whose hooks did not
fire on it ([Note: Backward order]).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fsdp_rs.runtime.checks.agreement import GradientAgreement
from fsdp_rs.runtime.checks.plan_check import check_plans, groups_of, param_fqn
from fsdp_rs.runtime.comm.streams import NO_STREAMS, CommStreams
from fsdp_rs.runtime.compile.eager import eager_hook
from fsdp_rs.runtime.group.grad_buffers import local_tensor
from fsdp_rs.runtime.group.grad_dtypes import adopt_grad_dtypes
from fsdp_rs.runtime.group.param_group import FSDPParamGroup, ShardedState
from fsdp_rs.runtime.group.params import state_of
from fsdp_rs.runtime.step import finalize
from fsdp_rs.runtime.step.backward_order import BackwardOrder
from fsdp_rs.runtime.step.containers import cast_floats, map_tensors, tensors_in, to_device
from fsdp_rs.runtime.step.observe import PROFILING, logs_enabled, phase, rare
from fsdp_rs.runtime.step.training_state import TrainingState, backward_unfinished
from fsdp_rs.runtime.variants.extensions import check_extensions
from fsdp_rs.runtime.variants.spmd_annotations import spmd_types_module, untyped

__all__ = ["Context", "FSDPState"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class Tracing:
    """The root's traced forward ([Note: Traced hooks]): the ``Context``'s
    ``tracing``, read and written by ``compile/traced.py`` only."""

    def __init__(self) -> None:
        self.active = False  # a traced forward of the root is in progress
        self.root_traced = False  # the root's pre-forward took the traced hooks
        # the last traced group's token ([Note: Every group's backward on every rank])
        self.token: torch.Tensor | None = None


class Context:
    """Per-root state shared by all fsdp-rs states under one root, by concern.
    The hooks read the fields at the top once or more per group and step, so
    they are not behind a second object; the rest are:

    - the states, their streams and the gradient agreement, and where forward
      inputs go;
    - the order of this step's module calls (forward and backward);
    - observation ([Note: Labels and logs]) and ``spmd_types`` (the hooks pause
      its checking with ``untyped``);
    - ``iteration`` (``finalize.Iteration``): how a backward iteration ends;
    - ``tracing`` (``Tracing``): the traced forward of ``set_fullgraph_compile``."""

    def __init__(self, states: list[FSDPState], streams: CommStreams) -> None:
        self.states = states
        self.streams = streams
        self.agreement = GradientAgreement(streams)
        # Where the root moves forward inputs (FSDP2 moves them to its mesh's device).
        self.device: torch.device | None = None
        self.forward_order: list[FSDPState] = []
        # [Note: Backward order] the module calls that registered a pre-backward
        # hook in forward, with whether they registered a post-backward one too;
        # and, while a backward of this root runs, where it is in them (None
        # between backwards: the root's phase, [Note: Training state]).
        self.backward_slots: list[tuple[FSDPState, bool]] = []
        self.backward_order: BackwardOrder | None = None
        # [Note: Labels and logs] the debug log is on (read per root forward); a
        # labelled hook is running
        self.logs = logs_enabled()
        self.labelling = False
        # [Note: spmd_types parameters] with annotated parameters: the package, and
        # what pauses its type checking around the hooks' own tensor work
        self.spmd = None
        self.untyped = _nothing
        self.iteration = finalize.Iteration()
        self.tracing = Tracing()


_NOTHING = contextlib.nullcontext()


def _nothing() -> contextlib.nullcontext:
    return _NOTHING


class _PostBackward(torch.autograd.Function):
    """The identity on a module call's inputs whose backward runs the group's
    post-backward. In the form torch.func transforms take (``setup_context``,
    a ``jvp`` passing tangents through, a generated vmap rule): under
    ``torch.func.jvp`` an input computed outside the transform is how its
    gradient path is hooked."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: FSDPState, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx, state_tangent: Any, *tangents: torch.Tensor):
        return tangents


class FSDPState:
    def __init__(
        self,
        modules: Sequence[nn.Module],
        group: FSDPParamGroup | None,
        reshard_after_forward: bool | int | None,
        mp_policy,
    ) -> None:
        self.modules = tuple(modules)
        self.group = group
        self.reshard_after_forward_arg = reshard_after_forward
        self.mp_policy = mp_policy
        self.context: Context | None = None
        self.is_root = False
        self.fqn = ""  # the modules' names under the root ([Note: Labels and logs])
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None
        # The modules of this state that ran forward since its group was unsharded.
        self._modules_ran: set[int] = set()
        self._forward_index = -1
        self._call_hooked = False  # this module call registered a post-backward hook
        # Set before lazy init: the root's go to the context.
        self.is_last_backward = True
        self.post_optim_event = None
        self.manual_finalization = False
        self.shared_streams: dict | None = None  # share_comm_ctx
        self.conflicts: list[str] = []  # parameters owned by another group
        self.mesh_info = None  # the mesh fully_shard was given (set by fully_shard)
        # [Note: Eager hooks under torch.compile]: pre_forward / post_forward below
        self.traced_groups: list = []  # [Note: Traced hooks]
        self._hook_ids: list[tuple[nn.Module, int, int]] = []
        for module in self.modules:
            pre = module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            post = module.register_forward_hook(self.post_forward, prepend=False)
            self._hook_ids.append((module, pre.id, post.id))
            # state_dict and load_state_dict see the sharded parameters; a load
            # that assigned new ones is adopted at once.
            module.register_state_dict_pre_hook(self._to_sharded)
            module._register_load_state_dict_pre_hook(self._to_sharded)
            module.register_load_state_dict_post_hook(self._adopt_loaded)

    def use_hooks(self, pre_forward, post_forward) -> None:
        """Register ``pre_forward`` / ``post_forward`` in the places of the forward
        hooks ``__init__`` registered (their order among other hooks kept)."""
        for module, pre_id, post_id in self._hook_ids:
            module._forward_pre_hooks[pre_id] = pre_forward
            module._forward_hooks[post_id] = post_forward

    def refresh_traced(self) -> None:
        """After a change of the group's reduction flags: what the traced hooks
        read of them ([Note: Traced hooks])."""
        for traced in self.traced_groups:
            traced.refresh()

    def default_reshard_after_forward(self, root: FSDPState) -> bool | int:
        """``reshard_after_forward`` as ``fully_shard`` was given it; when None
        (the default), True except for the root, whose backward all-gathers it
        at once ([Note: Root and lazy init])."""
        raf = self.reshard_after_forward_arg
        return (self is not root) if raf is None else raf

    def _to_sharded(self, *unused: Any) -> None:
        if self.group is not None and self.group.state != ShardedState.SHARDED:
            self.group.reshard()

    def _adopt_loaded(self, *unused: Any) -> None:
        if self.group is not None:
            self.group.adopt_registered()

    # ------------------------------------------------------------- lazy init

    def _lazy_init(self) -> None:
        """See [Note: Root and lazy init]."""
        if self.context is not None:
            return
        states: list[FSDPState] = []
        seen: set[int] = set()
        name_of: dict[int, str] = {}
        for root in self.modules:
            for name, module in root.named_modules():
                name_of.setdefault(id(module), name)
                state = state_of(module)
                if state is None or id(state) in seen:
                    continue
                if state.context is not None:
                    raise RuntimeError(
                        f"fsdp_rs: {name or type(module).__name__} ran forward before the "
                        f"fully_shard module {type(root).__name__} that contains it, so it "
                        "became a root of its own; run the first forward through the "
                        "outermost fully_shard module"
                    )
                seen.add(id(state))
                states.append(state)
        for state in states:
            if state.conflicts:
                raise ValueError(state.conflicts[0])
            if state.group is not None:
                check_extensions(state.group)  # [Note: All-gather extensions]
        for state in states:
            if state.group is not None:
                state.group.adopt_registered()
                if state.group.on_meta:
                    raise _still_on_meta(state, name_of)
                adopt_grad_dtypes(state.group)  # [Note: Gradient dtype policy]
        groups = [state.group for state in states if state.group is not None]
        streams = NO_STREAMS
        if groups:
            streams = CommStreams(groups[0].device)
            if self.shared_streams is not None:  # share_comm_ctx: the first root's
                streams = self.shared_streams.setdefault(groups[0].device, streams)
        context = Context(states, streams)
        for group in groups:
            group.streams = context.streams
            group.agreement = context.agreement
        context.agreement.register(
            [
                (group, [name_of.get(id(m), "") for m in state.modules])
                for state in states
                for group in groups_of(state)
            ]
        )
        if groups:
            context.device = (self.group or groups[0]).device
        if any(group.annotations is not None for group in groups):
            context.spmd = spmd_types_module()
            context.spmd.register_local_autograd_function(_PostBackward)
            context.untyped = untyped
        finalize.check_lazy_init(states, self)
        iteration = context.iteration
        iteration.is_last_backward = self.is_last_backward
        iteration.post_optim_event = self.post_optim_event
        iteration.manual_finalization = self.manual_finalization
        for state in states:
            state.context = context
            state.is_root = state is self
            # [Note: Labels and logs] the modules' names under the root, as FSDP2's
            state.fqn = ", ".join(name_of.get(id(m), "") for m in state.modules)
            if state.group is not None:
                state.group.fqn = state.fqn
                state.group.step_context = context
            if state.group is not None:
                state.group.reshard_after_forward = state.default_reshard_after_forward(self)
        with rare("fsdp_rs::plan_check"):
            check_plans(self, states)  # [Note: Cross-rank plan check]

    # --------------------------------------------------------------- forward

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.context is None:
            self._lazy_init()
        context = self.context
        if self.is_root:
            context.logs = logs_enabled()  # [Note: Labels and logs]
        if context.logs or PROFILING():
            with phase(context, "FSDP::pre_forward", self.fqn):
                return self._pre_forward(module, args, kwargs)
        return self._pre_forward(module, args, kwargs)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        context = self.context
        if self.is_root:
            with context.untyped():
                if context.labelling:
                    with phase(context, "FSDP::root_pre_forward"):
                        args, kwargs = self._root_pre_forward(args, kwargs)
                else:
                    args, kwargs = self._root_pre_forward(args, kwargs)
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        group = self.group
        starts = group is not None and not self._modules_ran  # the group's forward begins
        if starts:
            with context.untyped():
                self._unshard_for_forward()
            if context.spmd is not None:
                group.restore_types(context.spmd)
        self._call_hooked = False
        if starts and torch.is_grad_enabled():  # [Note: Groups over several modules]
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = self.context
        if backward_unfinished(context):
            self.reset_iter_state()  # [Note: A backward that raised]
        finalize.check_no_pending(context)
        if torch.is_grad_enabled():
            context.forward_order = []
            context.backward_slots = []
        # The all-gathers read the sharded buffers the optimizer wrote.
        iteration = context.iteration
        context.streams.all_gather_streams_wait_current(iteration.post_optim_event)
        iteration.post_optim_event = None
        return to_device(args, kwargs, context.device)

    def _unshard_for_forward(self) -> None:
        group = self.group
        grad = torch.is_grad_enabled()
        if grad:
            order = self.context.forward_order
            self._forward_index = len(order)
            order.append(self)
        if self.context.labelling:
            with phase(self.context, "FSDP::all_gather", self.fqn):
                group.unshard(async_op=group.unshard_async_op, side_streams=True)
            with phase(self.context, "FSDP::all_gather_copy_out", self.fqn):
                group.wait_for_unshard(defer_release=True)
        else:
            group.unshard(async_op=group.unshard_async_op, side_streams=True)
            group.wait_for_unshard(defer_release=True)
        if grad and group.training_state is TrainingState.IDLE:
            group.training_state = TrainingState.FORWARD  # [Note: Training state]
        for other in self.forward_prefetch:
            if other.group is not None:
                other._prefetch("forward")

    def _prefetch(self, kind: str) -> None:
        """Start this group's unshard ahead of its use (``kind``: forward or
        backward), labelled as FSDP2's where observed."""
        if self.context.labelling:
            with phase(self.context, f"FSDP::{kind}_prefetch for {self.fqn}"):
                self.group.prefetch()
        else:
            self.group.prefetch()

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        context = self.context
        with context.untyped():
            if context.logs or PROFILING():
                with phase(context, "FSDP::post_forward", self.fqn):
                    output = self._post_forward(module, output)
            else:
                output = self._post_forward(module, output)
        if self.mp_policy.output_dtype is not None:
            output = cast_floats(output, self.mp_policy.output_dtype)
        return output

    # [Note: Eager hooks under torch.compile] the hooks registered on the modules,
    # wrapped once for the class (a bound method of a disabled function is
    # skipped by Dynamo as the function is); wrapping per state cost ~60 us a call
    # of fully_shard. The traced hooks call the unwrapped ones.
    pre_forward = eager_hook(_pre_forward_hook)
    post_forward = eager_hook(_post_forward_hook)

    def _post_forward(self, module: nn.Module, output: Any) -> Any:
        group = self.group
        if group is not None:
            ran = self._modules_ran
            ran.add(id(module))
            if len(ran) == len(self.modules):
                ran.clear()
                self._reshard_after_forward()
            output = self._register_pre_backward(output)
        if self.is_root:
            self._complete_partial_forwards()
            self.context.streams.flush_all_gather()  # the last group's all-gather output
        return output

    def reset_iter_state(self) -> None:
        """See ``FSDPModule.reset_iter_state``."""
        context = self.context
        if context is None:
            return  # no forward ran yet: nothing to reset
        if not self.is_root:
            raise RuntimeError(
                "fsdp_rs: reset_iter_state must be called on the root fully_shard module "
                "(the one the first forward ran through), not on a module nested in it"
            )
        context.streams.end_of_backward()  # wait for the reductions in flight
        for state in context.states:
            state._modules_ran.clear()
            if state.group is not None:
                state.group.discard_unshard_state()
                state.group.discard_gradient_state()
                state.group.training_state = TrainingState.IDLE
        context.agreement.discard()
        finalize.discard(context)
        context.forward_order = []
        context.backward_slots = []
        context.backward_order = None

    def _reshard_after_forward(self) -> None:
        if self.group.reshard_after_forward is not False:
            self.group.reshard(after_forward=True)

    def _complete_partial_forwards(self) -> None:
        """[Note: Groups whose modules did not all run] At the root's post-forward,
        a group over several modules (``fully_shard([norm, output])``) of which
        some did not run (a chunked loss runs ``output`` after the model's
        forward) is done with this forward: resharded as after its last module,
        as FSDP2 does. A later call of its modules (or ``unshard()``) gathers it
        again; its backward hooks were registered by the modules that ran."""
        for state in reversed(self.context.states):
            if state is not self and state._modules_ran:
                state._modules_ran.clear()
                state._reshard_after_forward()

    # -------------------------------------------------------------- backward

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plain = not kwargs and all(map(_is_tensor, args))  # the common case: no walk
        if plain:
            tensors = [t for t in args if t.requires_grad]
        else:  # [Note: Containers]
            tensors = tensors_in((args, kwargs), _REQUIRES_GRAD)
        if not tensors:
            return args, kwargs
        self._call_hooked = True
        view = tensors[0].view_as(tensors[0]) if len(tensors) == 1 else None
        if view is not None and view.grad_fn is not None:
            # One input: the cheaper view pre-hook of [Note: Backward hooks].
            view.grad_fn.register_prehook(self._post_backward_hook)
            outs: tuple[torch.Tensor, ...] = (view,)
        else:  # several inputs, or one from outside a torch.func transform
            outs = _PostBackward.apply(self, *tensors)
        it = iter(outs)

        def replace(t: torch.Tensor) -> torch.Tensor:
            return next(it) if t.requires_grad else t

        if plain:
            return tuple(map(replace, args)), kwargs
        return map_tensors(replace, (args, kwargs))

    def _register_pre_backward(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):  # the common case: no walk
            tensors = [output] if output.requires_grad else []
        else:  # [Note: Containers]
            tensors = tensors_in(output, _REQUIRES_GRAD)
        if len(tensors) == 1:
            # One tensor's hook runs once per backward: what the multi-grad hook's
            # "any" mode adds (a lock and a per-backward flag) is not needed.
            tensors[0].register_hook(self._pre_backward)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        else:
            return output
        context = self.context
        # [Note: Training state] no backward of this root runs: not a recomputation
        if context.backward_order is None:
            context.backward_slots.append((self, self._call_hooked))
        return output

    def _pre_backward(self, *unused: Any) -> None:
        context = self.context
        with context.untyped():
            if context.logs or PROFILING():
                with phase(context, "FSDP::pre_backward", self.fqn):
                    self._begin_backward()
            else:
                self._begin_backward()

    def _begin_backward(self) -> None:
        context = self.context
        if context.backward_order is None:  # this root's backward begins ([Note: Training state])
            iteration = context.iteration
            if iteration.manual_active is None:  # the iteration's mode, set at its start
                iteration.manual_active = iteration.manual_finalization
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            context.backward_order = BackwardOrder(context.backward_slots)
        # [Note: Backward order] the slots before this one that did not fire here
        for state, hooked in context.backward_order.skipped_before(self):
            state._replay(hooked)
        self._run_pre_backward()

    def _replay(self, hooked: bool) -> None:
        """A slot whose hooks did not fire on this rank: what they would have done."""
        self._run_pre_backward()
        if hooked:
            self.post_backward()

    def _run_pre_backward(self) -> None:
        group = self.group
        if group is None:
            return
        group.training_state = TrainingState.PRE_BACKWARD
        if group.state != ShardedState.UNSHARDED and group.unshard_in_backward:
            group.unshard(async_op=group.unshard_async_op, side_streams=True)
            group.wait_for_unshard()
        group.prepare_gradients()
        for other in self._backward_prefetch_targets():
            if other.group is not None and other.group.unshard_in_backward:
                other._prefetch("backward")

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.context.forward_order
        i = self._forward_index  # where this state last ran forward (O(1), not order.index)
        if 0 <= i < len(order) and order[i] is self:
            return [order[i - 1]] if i > 0 else []
        return []

    def post_backward(self) -> None:
        group = self.group
        if group is not None and group.training_state is not TrainingState.POST_BACKWARD:
            order = self.context.backward_order
            # [Note: Partial gradients of a module called twice]
            group.visits_left = order is not None and order.pending(self)
            context = self.context
            try:
                with context.untyped():
                    if context.logs or PROFILING():
                        with phase(context, "FSDP::post_backward", self.fqn):
                            group.post_backward()
                    else:
                        group.post_backward()
            finally:
                group.visits_left = False
                group.training_state = TrainingState.POST_BACKWARD

    def _post_backward_hook(self, grads: tuple) -> None:
        self.post_backward()

    def _end_of_backward(self) -> None:
        """The root's callback once the whole backward ran; see [Note: Backward hooks]."""
        context = self.context
        with context.untyped():
            if context.logs or PROFILING():
                with phase(context, "FSDP::root_post_backward_callback"):
                    self._finish_backward()
            else:
                self._finish_backward()

    def _finish_backward(self) -> None:
        context = self.context
        order, context.backward_order = context.backward_order, None  # ends this backward
        for state, hooked in order.rest():
            state._replay(hooked)
        iteration = context.iteration
        manual = iteration.manual_active  # [Note: Manual backward finalization]
        last = iteration.is_last_backward and not manual
        for state in context.states:
            group = state.group
            if group is None:
                continue
            state._modules_ran.clear()
            done = group.training_state is TrainingState.POST_BACKWARD
            group.training_state = TrainingState.IDLE  # [Note: Training state]
            if not done:
                if manual and group.reduce_grads:
                    group.finalize_pending = True  # reduced by finalize_backward()
                    continue
                if context.labelling:  # [Note: Labels and logs]
                    with phase(context, "FSDP::post_backward", state.fqn):
                        group.post_backward()
                else:
                    group.post_backward()
            # Not the last backward (set_is_last_backward(False), as with pipeline
            # schedules): an unshard started but not used stays for the next one.
            keep = not last and group.unshard_pending
            post_forward = group.state == ShardedState.SHARDED_POST_FORWARD
            if (group.reshard_after_backward or post_forward) and not keep:
                group.reshard()
        if manual:  # this backward's own reductions agreed; the rest at finalize
            context.agreement.resolve()
            context.streams.flush_all_gather()  # what forward left, as at any backward end
        elif last:
            finalize.end_iteration(context)
        else:
            context.agreement.resolve()  # [Note: Gradient agreement]
            context.streams.end_of_backward()


def _still_on_meta(state: FSDPState, name_of: dict[int, str]) -> RuntimeError:
    """FSDP2's error for a group with parameters on the meta device at the first
    forward, naming them under the root, and how to materialize them."""
    names = [name_of.get(id(m), "") for m in state.modules]
    meta = [
        param_fqn(names, fqn)
        for group in groups_of(state)
        for fqn, p in zip(group.managed.fqns, group.managed.registered(), strict=True)
        if local_tensor(p).is_meta
    ]
    return RuntimeError(
        "FSDP parameters should be materialized from meta device before training, but the "
        f"following were still on meta device: {meta}. Materialize them before the first "
        "forward: model.to_empty(device=...) then reset_parameters() on each module (or "
        "init_weights()), or load a checkpoint"
    )


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
