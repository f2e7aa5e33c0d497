"""The unshard and reshard transitions of a parameter group, and the
``ShardedState`` they move between.

Unshard = copy-in (where a cast or a host-to-device copy is needed) and the
all-gather, started by ``unshard``; the copy-out into the unsharded buffer and
the registration of the unsharded parameters, by ``wait_for_unshard``. Reshard
frees the unsharded buffer with one storage resize and registers the sharded
parameters again; after forward with ``reshard_after_forward=int`` it keeps
this rank's rows for the smaller all-gather in backward. Which streams each
step runs on: [Note: Streams].

Memory is freed where FSDP2 frees it or earlier: the all-gather output right
after the copy-out, except in forward with ``reshard_after_forward=int``, where
the post-forward rows are cloned from it at the reshard (FSDP2 keeps its
forward all-gather outputs until the next group's copy-out); the post-forward
rows once the collective read them (on CPU without a work object; else at the
copy-out, as FSDP2).

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

from fsdp_rs.kernels._dtypes import FLOAT_DTYPES, bits
from fsdp_rs.runtime.comm.collectives import all_gather
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
    SHARDED_POST_FORWARD transitions over the group's buffers.

    Uses the group's plan, tables, ops, mesh info, dtypes, streams, managed
    parameters and the unsharded buffer and parameters it made."""

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
        if not self._unshard_needed():
            return
        if self.unsharded_params is None or self.trainable_set_changed():
            with torch.inference_mode(False):  # [Note: Made outside inference mode]
                self._make_unsharded_params()
        streams = self.streams
        # Rows kept at a post-forward reshard were written on the compute stream.
        streams.all_gather_streams_wait(self._post_forward_event)
        self._post_forward_event = None
        copy_in_stream, ag_stream = streams.all_gather_streams(side_streams and not async_op)
        info = self.info
        group = info.shard_group
        # No autograd context needed: none of these buffers requires grad.
        if self.state == ShardedState.SHARDED_POST_FORWARD:
            source, ag = self._post_forward_rows, None
            self._post_forward_rows = None
            group = self.post_forward_group
        else:
            source, ag = self.sharded, None
            with streams.on(copy_in_stream):
                if self.offload_to_cpu and source.dtype == self.param_dtype:
                    # [Note: Offloaded shards] the host shard goes straight into
                    # this rank's row of the all-gather output, the collective's
                    # input in place: no device copy of the shard is made. (As
                    # the all-gather input, such a copy lived until the copy-out,
                    # a shard above FSDP2 at the peak: FSDP2 frees its copy after
                    # its copy-in.) Chosen by the policy, not by device, so that
                    # CPU runs take it too.
                    ag = self._all_gather_output()
                    ag[info.shard_rank].copy_(source, non_blocking=True)
                    source = ag[info.shard_rank]
                elif source.device != self.device:  # CPU offload with a cast
                    source = source.to(self.device, non_blocking=True)
                if source.dtype != self.param_dtype and source.dtype not in FLOAT_DTYPES:
                    # float8 under a param_dtype: the copy kernels have no float8
                    # arithmetic; torch casts it (as FSDP2 does), then no cast is left
                    source = source.to(self.param_dtype)
                if source.dtype != self.param_dtype:  # one launch: the cast
                    ag = self._all_gather_output()
                    self.ops.all_gather_copy_in(source, ag, info.shard_rank)
                    source = ag[info.shard_rank]
                # else no cast to fuse: the sharded buffer (row layout) is the
                # all-gather input as it is
            if ag_stream is not None:
                ag_stream.wait_stream(copy_in_stream)
        comm = self.all_gather_comm  # [Note: Comm objects]
        with streams.on(ag_stream):
            work = None
            if comm is not None and info.shard_size > 1:  # one rank: none, as FSDP2
                ag = self._all_gather_output() if ag is None else ag
                work = comm(
                    output_tensor=ag.view(-1),
                    input_tensor=source.view(-1),
                    group=group,
                    async_op=async_op,
                )
            elif info.shard_size > 1:
                ag = self._all_gather_output() if ag is None else ag
                # bytes are bytes: a dtype the backend may not know (float8 or bool
                # on gloo) goes as its same-width integers ([Note: Raw copies])
                out, inp = bits(ag.view(-1)), bits(source.view(-1))
                work = all_gather(out, inp, group=group, async_op=async_op)
            elif ag is None:
                ag = source.view(1, -1)  # one rank: its row is the whole output
            event = streams.record(ag_stream)
        work = work if async_op else None
        if work is None and not streams.enabled:
            # The collective is done with its input: drop the post-forward rows
            # now, not at the copy-out (on streams they live until it, as in FSDP2).
            source = None
        self._pending_unshard = (work, ag, event, source)

    @outside_functorch
    def prefetch(self) -> None:
        """Start the unshard of a group about to run: on the side streams where
        there are streams (unless ``_set_unshard_async_op(True)``), else with an
        asynchronous collective."""
        self.unshard(async_op=self.unshard_async_op or not self.streams.enabled, side_streams=True)

    def _all_gather_output(self) -> torch.Tensor:
        rows, row = self.info.shard_size, self.plan.row_numel
        if self.all_gather_comm is None:
            return torch.empty(rows, row, dtype=self.param_dtype, device=self.device)
        flat = self.all_gather_comm.allocate(
            (rows * row,), dtype=self.param_dtype, device=self.device
        )
        return flat.view(rows, row)

    def _copy_out(self, ag: torch.Tensor) -> None:
        """The all-gather output's rows into the unsharded buffer."""
        self.ops.all_gather_copy_out(ag, [self.unsharded], *self.tables.copy_out_args())

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
        if self.state == ShardedState.UNSHARDED and self._pending_unshard is None:
            return
        work, ag, _, source = self._await_unshard(defer_release)
        streams = self.streams
        self._alloc_unsharded()
        self._copy_out(ag)
        # Rows for a post-forward reshard: only outside backward, which reshards to
        # SHARDED; in backward the all-gather output is freed now, as FSDP2 frees it.
        if self.post_forward_group is not None and not in_autograd_backward():
            size = self.info.shard_size // self.post_forward_size
            first = (self.info.shard_rank % self.post_forward_size) * size
            self._ag_rows = (ag, first, size)
        streams.release_after((ag, source), streams.record(), defer_release and work is None)
        self.state = ShardedState.UNSHARDED
        self.managed.swap(self.unsharded_params)

    # --------------------------------------------------------------- reshard

    def discard_unshard_state(self) -> None:
        """``reset_iter_state``: finish an unshard in flight (its collective was
        issued), then go back to SHARDED, dropping post-forward rows."""
        if self._pending_unshard is not None:
            self._await_unshard()
        self.reshard()

    @outside_functorch
    def reshard(self, after_forward: bool = False) -> None:
        if self._pending_unshard is not None:
            self.wait_for_unshard()
        if self.state == ShardedState.SHARDED_POST_FORWARD and not after_forward:
            self._post_forward_rows = None
            self._post_forward_event = None
            self.state = ShardedState.SHARDED
        if self.state != ShardedState.UNSHARDED:
            return
        keep_rows = after_forward and self._ag_rows is not None
        if keep_rows:
            ag, first, size = self._ag_rows
            self._post_forward_rows = ag[first : first + size].clone()
            # The clone read the all-gather output on the compute stream: release
            # it after that, and the next unshard reads the rows after it too.
            self._post_forward_event = self.streams.record()
            self.streams.release_after((ag,), self._post_forward_event, defer=True)
        self._ag_rows = None
        self._keep_user_flags(after_forward)
        self._free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD if keep_rows else ShardedState.SHARDED
        self.managed.swap(self.sharded_params)
