"""Who ends a backward iteration: the root's end-of-backward callback (the
default), or the caller, with ``finalize_backward`` (torch >= 2.15's API).

[Note: Manual backward finalization]
``root.set_manual_backward_finalization(True)`` hands the end of the backward
iteration to the caller, as FSDP2 (torch >= 2.15) does and as torch's pipeline
stages and torchtitan's gradient accumulation use it: a backward's
end-of-backward callback then leaves the groups whose reduction it would run
(a group whose forward inputs need no gradient, the root usually) unreduced and
unsharded, marked pending, and ends nothing; ``root.finalize_backward()``
reduces every pending group, reshards the others per
``reshard_after_backward`` and ends the iteration (waits for the reductions,
agrees on missing gradients, clears the forward order). A group that a backward
without gradient sync accumulated into is pending too, so that several
backwards without sync followed by ``set_requires_gradient_sync(True)`` and
one ``finalize_backward()`` reduce the sum once. What is pending is decided by
the settings and by which groups ran backward hooks, which every rank replays
in one order ([Note: Backward order]), never by a gradient one rank has: every
rank reduces the same groups.

Reductions that a group's own post-backward hook runs inside a backward (its
inputs need a gradient and sync is on) are not deferred, as in FSDP2, and their
missing-gradient agreement ([Note: Gradient agreement]) is settled at the end
of that backward, so two of them never wait on one agreement.

``finalize_backward(async_op=True)`` issues the reductions and returns a
``GradientReductionHandle``; its ``wait()`` ends the iteration. A forward (or
another finalization on a root sharing the communication context) before that
``wait()`` raises, as in FSDP2; ``reset_iter_state()`` invalidates the handle.
Under ``set_fullgraph_compile()`` the hooks run eager while manual
finalization is on: the traced reductions have no end of backward to defer.
"""

from __future__ import annotations

from fsdp_rs.runtime.api.errors import check_bool
from fsdp_rs.runtime.comm.streams import NO_STREAMS
from fsdp_rs.runtime.step.training_state import in_autograd_backward, in_backward

__all__ = [
    "GradientReductionHandle",
    "Iteration",
    "finalize_backward",
    "finish_pipelined_backward",
    "set_manual",
]


class Iteration:
    """How a root's backward iterations end, and what the next forward waits for:
    the root ``Context``'s ``iteration``. The settings are the API's, kept on the
    root's ``FSDPState`` until lazy init copies them here."""

    def __init__(self) -> None:
        # set_is_last_backward: False keeps the forward order and unused unshards
        self.is_last_backward = True
        # set_post_optim_event: the next root forward's all-gathers wait for it
        self.post_optim_event = None
        # [Note: Manual backward finalization] the setting; the mode the running
        # backward iteration took (None between iterations); an asynchronous
        # finalization not yet waited on.
        self.manual_finalization = False
        self.manual_active: bool | None = None
        self.pending_reduction = None


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: ``wait()``
    waits for the gradient reductions and ends the backward iteration."""

    def __init__(self, state=None) -> None:
        self._state = state  # the root's FSDPState; None: nothing to wait for

    def wait(self) -> None:
        state, self._state = self._state, None
        if state is None:
            return
        context = state.context
        if context.iteration.pending_reduction is not self:
            raise RuntimeError(
                "fsdp_rs: this gradient reduction handle was invalidated by "
                "reset_iter_state(); its gradients are discarded"
            )
        with context.untyped():
            end_iteration(context)


def set_manual(state, enabled: bool) -> None:
    """``FSDPModule.set_manual_backward_finalization`` on ``state``'s module."""
    check_bool("set_manual_backward_finalization", "enabled", enabled)
    context = state.context
    if context is None:  # before lazy init: the root's goes to its context
        state.manual_finalization = enabled
        return
    if not state.is_root:
        raise RuntimeError(
            "fsdp_rs: set_manual_backward_finalization must be called on the root "
            "fully_shard module (the one the first forward ran through)"
        )
    iteration = context.iteration
    if enabled != iteration.manual_finalization:
        if in_autograd_backward():
            raise RuntimeError(
                "fsdp_rs: set_manual_backward_finalization cannot change mode during backward"
            )
        if iteration.manual_active is not None and enabled != iteration.manual_active:
            raise RuntimeError(
                "fsdp_rs: set_manual_backward_finalization cannot change mode after a "
                "backward started until finalize_backward() or reset_iter_state()"
            )
    iteration.manual_finalization = enabled


def check_lazy_init(states, root) -> None:
    """At lazy init: only the root may have asked for manual finalization."""
    for state in states:
        if state is not root and state.manual_finalization:
            raise RuntimeError(
                "fsdp_rs: set_manual_backward_finalization must be called on the root "
                "fully_shard module, not on a module nested in it"
            )


def check_no_pending(context) -> None:
    """Before a forward: an asynchronous finalization must have been waited on."""
    pending = context.iteration.pending_reduction or context.streams.active_reduction
    if pending is not None:
        raise RuntimeError(
            "fsdp_rs: the previous gradient reduction must be waited on before forward: "
            "call wait() on the GradientReductionHandle that finalize_backward(async_op=True) "
            "returned"
        )


def finalize_backward(state, async_op: bool):
    """``FSDPModule.finalize_backward``: see [Note: Manual backward finalization]."""
    context = state.context
    if context is None:  # before the first forward: nothing to finalize
        return GradientReductionHandle() if async_op else None
    iteration = context.iteration
    if iteration.pending_reduction is not None:
        raise RuntimeError(
            "fsdp_rs: the previous gradient reduction must be waited on before finalizing "
            "backward again"
        )
    if context.streams.active_reduction is not None:
        raise RuntimeError(
            "fsdp_rs: another gradient reduction sharing this communication context "
            "(share_comm_ctx) must be waited on before finalizing backward"
        )
    if not state.is_root:
        raise RuntimeError(
            "fsdp_rs: finalize_backward must be called on the root fully_shard module"
        )
    manual = iteration.manual_active
    if not (iteration.manual_finalization if manual is None else manual):
        raise RuntimeError(
            "fsdp_rs: finalize_backward requires manual backward finalization: call "
            "set_manual_backward_finalization(True) on the root before forward"
        )
    if in_backward(context):
        raise RuntimeError(
            "fsdp_rs: finalize_backward must be called after backward completes, not inside it"
        )
    with context.untyped():  # the hooks' own tensor work ([Note: spmd_types parameters])
        _reduce_pending(context)
        if not async_op:
            end_iteration(context)
            return None
    handle = GradientReductionHandle(state)
    iteration.pending_reduction = handle
    if context.streams is not NO_STREAMS:  # shared by the roots of share_comm_ctx
        context.streams.active_reduction = handle
    return handle


def _reduce_pending(context) -> None:
    """Reduce every group a backward left pending; reshard the others."""
    for each in reversed(context.states):
        group = each.group
        if group is None:
            continue
        if group.finalize_pending:
            group.post_backward()
        elif group.reshard_after_backward:
            group.reshard()


def finish_pipelined_backward(state) -> None:
    """What torch < 2.15's pipeline stages run on a stage's root module after
    its last micro-batch's backward, once they set gradient sync, resharding
    and the last backward on: FSDP2's per-group post-backward, then its root's
    end-of-backward callback (``fully_shard.state(m)``'s, [Note: fsdp-rs in
    torch's composable registry]). fsdp-rs reduces what the backwards without
    sync left pending and ends the iteration, as ``finalize_backward`` does."""
    context = state.context
    if context is None:  # no forward ran: nothing to reduce
        return
    if not state.is_root:
        raise RuntimeError(
            "fsdp_rs: a pipeline stage's module must be the root fully_shard module of the stage"
        )
    if in_backward(context):
        raise RuntimeError("fsdp_rs: the stage's backward must complete before its reduction")
    with context.untyped():
        _reduce_pending(context)
        end_iteration(context)


def end_iteration(context) -> None:
    """The end of a backward iteration: agree on missing gradients ([Note:
    Gradient agreement]), wait for the reductions, forget the forward order."""
    context.agreement.resolve()
    context.streams.end_of_backward()
    context.forward_order = []
    discard(context)


def discard(context) -> None:
    """The iteration's manual mode and handle are done with (``reset_iter_state``:
    the handle in flight, if any, is invalidated)."""
    iteration = context.iteration
    iteration.manual_active = None
    handle, iteration.pending_reduction = iteration.pending_reduction, None
    if handle is not None and context.streams.active_reduction is handle:
        context.streams.active_reduction = None
