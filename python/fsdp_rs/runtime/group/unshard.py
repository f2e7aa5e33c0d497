"""The unshard and reshard transitions of a parameter group, and the
``ShardedState`` they move between. What they do to the local shards is the
group's gather strategy (``runtime/group/gather.py``); ``Unsharding`` holds
what every strategy shares: the checks that skip a call with nothing to do,
the wait for an unshard in flight, prefetching.

[Note: Outside functorch]
Inside a torch.func transform (``jvp``, ``vmap``, ``grad``) tensors made by a
factory are wrapped for the transform, and a wrapper has no storage: the
unsharded buffer (whose storage the parameters alias) could not be made or
freed. The transitions run with functorch disabled, as FSDP2's do; the
parameters they register are ordinary tensors the transform then lifts.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.runtime.comm.mesh import MeshInfo, per_mesh
from fsdp_rs.runtime.step.training_state import in_autograd_backward

__all__ = ["ShardedState", "Unsharding", "post_forward_process_group"]


class ShardedState(enum.Enum):
    SHARDED = enum.auto()
    """Only the sharded buffer exists; the sharded DTensors are registered."""
    SHARDED_POST_FORWARD = enum.auto()
    """After forward with ``reshard_after_forward=int``: this rank also keeps its
    post-forward group's rows of the all-gather output, so the backward all-gather
    runs over the smaller post-forward group."""
    UNSHARDED = enum.auto()
    """The unsharded buffer is allocated and filled; the unsharded parameters
    (views into it) are registered."""


def post_forward_process_group(info: MeshInfo, size: int) -> dist.ProcessGroup:
    """The group of ``size`` consecutive shard ranks this rank belongs to
    ([Note: Post-forward groups]). Made once per mesh object and size: all
    groups sharded over one mesh share them."""
    kept = per_mesh(info.mesh)
    key = ("post_forward_group", size)
    if key not in kept:
        kept[key] = _new_post_forward_process_group(info, size)
    return kept[key]


# [Note: Post-forward groups]
# ``reshard_after_forward=k`` keeps each rank's k-rank slice of the all-gather
# output, so the backward all-gather runs over groups of k consecutive shard
# ranks. ``new_group`` in its default form must be called by every rank of the
# world with the same ranks in the same order: it names a group by a counter,
# and the group's rendezvous keys by that name. Where the mesh spans the world,
# every rank makes every group that way. Where the DP mesh is one slice of a
# larger mesh (TP columns, pipeline stages, an expert mesh), each slice would
# make its own groups under the same names, and their rendezvous would connect
# ranks of different slices (gloo then sums across them, silently wrong, or
# hangs; torch 2.13's FSDP2 hangs there). So on a slice only the members make
# each group (``use_local_synchronization``): torch names such a group from its
# ranks and the number of groups each member has made, which is the same on
# members of one shard group as long as they made the same groups before.


def _new_post_forward_process_group(info: MeshInfo, size: int) -> dist.ProcessGroup:
    rank = dist.get_rank()
    sliced = info.mesh.size() != dist.get_world_size()
    mine = None
    for row in info.mesh.mesh.reshape(-1, info.shard_size).tolist():
        for start in range(0, info.shard_size, size):
            ranks = row[start : start + size]
            if rank in ranks or not sliced:
                group = dist.new_group(ranks, use_local_synchronization=sliced)
                if rank in ranks:
                    mine = group
    if mine is None:
        raise RuntimeError(f"rank {rank} is not in its own mesh {info.mesh}")
    return mine


# [Note: Made outside inference mode]
# The unsharded buffer and parameters live as long as the group. Made under
# ``torch.inference_mode()`` (a first forward that evaluates, as a validation
# pass before training does), they would be inference tensors, which no later
# training forward may write (the copy-out) or save for backward; FSDP2 fails
# there. fsdp-rs makes them outside inference mode; writing normal tensors
# inside it is allowed, so an inference forward works before or after training.


def outside_functorch(method: Callable) -> Callable:
    """Run ``method`` with functorch disabled; see [Note: Outside functorch]."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return wrapper


class Unsharding:
    """Mixed into ``FSDPParamGroup``: the SHARDED / UNSHARDED /
    SHARDED_POST_FORWARD transitions, which run the group's gather strategy
    (``group.gather``, a ``GatherStrategy``).

    Uses the group's state, streams, flags and the unsharded buffer it made."""

    def _free_unsharded(self) -> None:
        if not self.keep_unsharded_storage:  # set_keep_unsharded_storage(True): kept
            self.unsharded.untyped_storage().resize_(0)

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        nbytes = self.unsharded.numel() * self.unsharded.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    # --------------------------------------------------------------- unshard

    @property
    def unshard_pending(self) -> bool:
        """An unshard was started and its copy-out not yet run."""
        return self._pending_unshard is not None

    def _unshard_needed(self) -> bool:
        """Whether an unshard has work: none in flight and not UNSHARDED, after a
        group whose trainable set changed while it was not SHARDED went back to
        SHARDED, to be made again from the shards ([Note: Trainable set changes])."""
        if self._pending_unshard is not None:
            return False
        if self.state is not ShardedState.SHARDED and self.trainable_set_changed():
            self.reshard()
        return self.state != ShardedState.UNSHARDED

    def _keep_user_flags(self, after_forward: bool) -> None:
        """At a reshard from UNSHARDED: a ``requires_grad`` the user set on the
        registered (unsharded) parameters goes to the sharded ones before the swap,
        where no forward's graph holds them ([Note: Trainable set changes])."""
        if not (after_forward or self.training_state.holds_graph or in_autograd_backward()):
            self.requires_grad_now()

    @outside_functorch
    def unshard(self, async_op: bool = False, side_streams: bool = False) -> None:
        """Start the all-gather (copy-in where a cast is needed, then the
        collective); ``wait_for_unshard`` finishes it (copy-out). A no-op when
        unsharded or already started. ``side_streams``: called by a hook, run on
        the all-gather streams (see [Note: Streams])."""
        if self._unshard_needed():
            self.gather.unshard(self, async_op, side_streams)

    @outside_functorch
    def prefetch(self) -> None:
        """Start the unshard of a group about to run: on the side streams where
        there are streams (unless ``_set_unshard_async_op(True)``), else with an
        asynchronous collective."""
        self.unshard(async_op=self.unshard_async_op or not self.streams.enabled, side_streams=True)

    def _await_unshard(self, defer_release: bool = False) -> tuple:
        """Take the unshard in flight (starting one if none is) and wait for its
        collective: its pending tuple ``(work, output, event, ...)``.
        ``defer_release``: see ``wait_for_unshard``."""
        if self._pending_unshard is None:
            self.unshard()
        pending, self._pending_unshard = self._pending_unshard, None
        work, event = pending[0], pending[2]
        if defer_release:
            self.streams.flush_all_gather()
        self.streams.wait_current(event)
        if work is not None:
            work.wait()
        return pending

    @outside_functorch
    def wait_for_unshard(self, defer_release: bool = False) -> None:
        """Finish the unshard (start it first if needed): wait for the all-gather,
        copy out, register the unsharded parameters. ``defer_release``: in
        forward, keep the all-gather output until the next group's wait (see
        [Note: Cross-stream lifetimes])."""
        if self.state != ShardedState.UNSHARDED or self._pending_unshard is not None:
            self.gather.wait_for_unshard(self, defer_release)

    # --------------------------------------------------------------- reshard

    def discard_unshard_state(self) -> None:
        """``reset_iter_state``: finish an unshard in flight (its collective was
        issued), then go back to SHARDED, dropping post-forward rows."""
        if self._pending_unshard is not None:
            self._await_unshard()
        self.reshard()

    @outside_functorch
    def reshard(self, after_forward: bool = False) -> None:
        """Back to SHARDED (finishing an unshard in flight first); after forward
        with ``reshard_after_forward=int``, to SHARDED_POST_FORWARD."""
        self.gather.reshard(self, after_forward)
