"""Where a step is: a group's ``TrainingState``, which the hooks keep, and the
phase questions the runtime asks, answered here and nowhere else.

[Note: Training state]
Each group has a ``TrainingState``, set by the module hooks and the root's
end-of-backward callback (``step/state.py``), never by the group itself (a
``GroupBundle`` sets it on each of its groups, which so share one):

- ``IDLE``: no autograd graph of this iteration holds the group's unsharded
  parameters (before the first forward, after the end of a backward, after
  ``reset_iter_state()``).
- ``FORWARD``: a forward with grad enabled began on them (the group's
  pre-forward, from ``IDLE``); their backward has not reached the group.
- ``PRE_BACKWARD``: the group's pre-backward ran (or was replayed, [Note:
  Backward order]): unsharded again, gradients prepared.
- ``POST_BACKWARD``: its post-backward hook ran (or was replayed) in this
  backward. Another visit of the group in the same backward (a module called
  twice) goes back to ``PRE_BACKWARD``.

The root's end-of-backward callback returns every group to ``IDLE`` before it
reduces those the backward left unreduced; ``finalize_backward()`` reduces
outside any backward and leaves the state as it is.

Unlike FSDP2's, ``FORWARD`` lasts until the end of the backward, not only from
pre- to post-forward: what the runtime asks of it is whether an autograd graph
may hold the unsharded parameters ([Note: Trainable set changes]), which is
``holds_graph``: every state but ``IDLE``. Which modules of a state over
several ran forward is the state's own bookkeeping (``FSDPState._modules_ran``,
[Note: Groups over several modules]).

The root's phase is its ``Context.backward_order``: set by the first pre-backward
hook of a backward (which queues the end-of-backward callback), None again once
that callback took it, so "a backward of this root is running" reads it (the
hooks read the attribute; ``in_backward`` and ``backward_unfinished`` add
autograd's answer). Where
only autograd knows (a forward recomputed by activation checkpointing inside
backward runs the forward hooks; the end-of-backward callback runs inside the
backward's graph task), ``backward_task`` asks it, here only.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "TrainingState",
    "backward_task",
    "backward_unfinished",
    "in_autograd_backward",
    "in_backward",
]

_graph_task_id = torch._C._current_graph_task_id


class TrainingState(enum.Enum):
    """A group's phase in the iteration; see [Note: Training state]. Each value:
    (whether an autograd graph may hold the unsharded parameters, a number)."""

    IDLE = (False, 0)
    FORWARD = (True, 1)
    PRE_BACKWARD = (True, 2)
    POST_BACKWARD = (True, 3)

    def __init__(self, holds_graph: bool, number: int) -> None:
        self.holds_graph = holds_graph  # one attribute read on the hot path


def backward_task() -> int:
    """The id of the autograd backward running on this thread, -1 outside one."""
    return _graph_task_id()


def in_autograd_backward() -> bool:
    """Whether autograd is running a backward on this thread (the hooks of a
    forward recomputed inside backward and the end-of-backward callback are)."""
    return _graph_task_id() != -1


def in_backward(context) -> bool:
    """Whether a backward of this root is running (or its end is still queued),
    or autograd runs one on this thread."""
    return context.backward_order is not None or _graph_task_id() != -1


def backward_unfinished(context) -> bool:
    """A backward of this root began and will not end: no backward runs on this
    thread to reach its callback ([Note: A backward that raised])."""
    return context.backward_order is not None and _graph_task_id() == -1
