"""How a group holds and gathers its local shards: the ``GatherStrategy``
interface a group holds (``group.gather``), and ``RowGather``, the row-layout
one every group starts with. The other one, for parameters with all-gather
extensions, is ``variants.extensions.ExtensionGather`` ([Note: All-gather
extensions]); a group switches to it at lazy init where its shards gained
extensions after ``fully_shard``: the same group object, another strategy.

The row-layout unshard = copy-in (where a cast or a host-to-device copy is
needed) and the all-gather, started by ``unshard``; the copy-out into the
unsharded buffer and the registration of the unsharded parameters, by
``wait_for_unshard``. Reshard frees the unsharded buffer with one storage
resize and registers the sharded parameters again; after forward with
``reshard_after_forward=int`` it keeps this rank's rows for the smaller
all-gather in backward. Which streams each step runs on: [Note: Streams].

Memory is freed where FSDP2 frees it or earlier: the all-gather output right
after the copy-out, except in forward with ``reshard_after_forward=int``, where
the post-forward rows are cloned from it at the reshard (FSDP2 keeps its
forward all-gather outputs until the next group's copy-out); the post-forward
rows once the collective read them (on CPU without a work object; else at the
copy-out, as FSDP2).
"""

from __future__ import annotations

import abc
import operator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_rs.kernels._dtypes import FLOAT_DTYPES, bits
from fsdp_rs.runtime.comm.collectives import all_gather
from fsdp_rs.runtime.group.unshard import ShardedState
from fsdp_rs.runtime.step.training_state import in_autograd_backward

__all__ = ["ROW_GATHER", "GatherStrategy", "RowGather"]

_IS_META = operator.attrgetter("is_meta")


class GatherStrategy(abc.ABC):
    """Where a group's local shards live and how they become the unsharded
    parameters and back. The group's ``unshard``, ``wait_for_unshard``,
    ``reshard``, ``adopt_registered`` and ``on_meta`` call these, with the
    group as the first argument; the group's methods run them outside
    functorch ([Note: Outside functorch]) and skip the calls that have nothing
    to do.

    ``preplaces_grads``: whether the pre-placed gradient buffer ([Note:
    Pre-placed gradients]) may be used. ``adopts_grad_dtypes``: whether a
    ``grad_dtype`` set after ``fully_shard`` can be taken ([Note: Gradient
    dtype policy])."""

    preplaces_grads = True
    adopts_grad_dtypes = True
    reads_subclass_grads = False  # whether the group calls plain_grads

    @abc.abstractmethod
    def build_sharded(self, group, params: list[nn.Parameter]) -> None:
        """At ``fully_shard``: the local shards from the full ``params``, the
        sharded DTensor parameters over them, registered in the modules."""

    @abc.abstractmethod
    def adopt_registered(self, group) -> None:
        """Re-point the group at the registered parameters ([Note: Adopting
        registered parameters])."""

    @abc.abstractmethod
    def on_meta(self, group) -> bool:
        """Whether some parameter is still on the meta device."""

    @abc.abstractmethod
    def unshard(self, group, async_op: bool, side_streams: bool) -> None:
        """Start the all-gather, where the group found it has work (none in
        flight, not UNSHARDED); set ``group._pending_unshard`` to a tuple
        ``(work, output, event, ...)`` (``Unsharding._await_unshard`` reads the
        first three)."""

    @abc.abstractmethod
    def wait_for_unshard(self, group, defer_release: bool) -> None:
        """Finish the unshard (``group._await_unshard``), make or refill the
        unsharded parameters, register them: UNSHARDED. Called where an unshard
        is in flight or the group is not UNSHARDED."""

    @abc.abstractmethod
    def reshard(self, group, after_forward: bool) -> None:
        """Free what the unshard made, register the sharded parameters."""

    @abc.abstractmethod
    def plain_grads(self, group, grads: list) -> None:
        """Before a per-gradient reduction, where ``reads_subclass_grads``: make
        ``grads`` (and the group's accumulated ones) plain tensors the copy-in
        reads."""


def _all_gather_output(group) -> torch.Tensor:
    """The all-gather output: one row per shard rank, in the param dtype."""
    rows, row = group.info.shard_size, group.plan.row_numel
    if group.all_gather_comm is None:
        return torch.empty(rows, row, dtype=group.param_dtype, device=group.device)
    flat = group.all_gather_comm.allocate(
        (rows * row,), dtype=group.param_dtype, device=group.device
    )
    return flat.view(rows, row)


class RowGather(GatherStrategy):
    """The local shards are views of one sharded buffer in the row layout
    ([Note: Row layout]), which is the all-gather's input. Holds no state: one
    object, ``ROW_GATHER``, serves every such group."""

    def build_sharded(self, group, params: list[nn.Parameter]) -> None:
        """Sharded buffer filled from the full parameters (one reduce-scatter
        copy-in of them gives every rank's row; this rank keeps its own), and
        the sharded DTensor parameters as views into it."""
        meta = any(map(_IS_META, params))
        device = torch.device("meta") if meta else group.shard_device
        group.sharded = group._alloc_sharded(device)
        views = group.sharding.local_views(group, group.sharded)
        if not meta:
            with torch.no_grad():
                group.sharding.fill_sharded(group, params, views)
        group._make_sharded_params(group.requires_grad, views)
        group.managed.swap(group.sharded_params)

    def adopt_registered(self, group) -> None:
        """Re-point the group at the registered parameters when something replaced
        them or their data; see [Note: Adopting registered parameters]."""
        if group.state == ShardedState.UNSHARDED:
            return  # the unsharded parameters are registered: nothing to adopt
        current = group.managed.registered()
        # Device and address: an empty shard (dim 0 below the world size) has
        # address 0 on every device, as a meta buffer has.
        buffer = group.sharded
        buffer_ptr = buffer.untyped_storage().data_ptr()
        if all(map(operator.is_, current, group.sharded_params)) and all(
            p._local_tensor.device == buffer.device
            and p._local_tensor.untyped_storage().data_ptr() == buffer_ptr
            for p in current
        ):
            return
        group._check_registered_dtensors(current)
        locals_ = [p._local_tensor for p in current]
        if any(t.is_meta for t in locals_):
            return  # not all materialized yet (one module of a group): lazy init checks
        group._check_adopted(current, locals_)
        dtype = locals_[0].dtype
        if dtype != group.orig_dtype:
            group._set_dtypes(dtype)
        group._relayout(current, locals_)
        group.managed.swap(group.sharded_params)

    def on_meta(self, group) -> bool:
        """Some parameter is still on the meta device."""
        return group.sharded.is_meta or any(
            p._local_tensor.is_meta for p in group.managed.registered() if isinstance(p, DTensor)
        )

    def unshard(self, group, async_op: bool, side_streams: bool) -> None:
        if group.unsharded_params is None or group.trainable_set_changed():
            with torch.inference_mode(False):  # [Note: Made outside inference mode]
                group._make_unsharded_params()
        streams = group.streams
        # Rows kept at a post-forward reshard were written on the compute stream.
        streams.all_gather_streams_wait(group._post_forward_event)
        group._post_forward_event = None
        copy_in_stream, ag_stream = streams.all_gather_streams(side_streams and not async_op)
        info = group.info
        pg = info.shard_group
        # No autograd context needed: none of these buffers requires grad.
        if group.state == ShardedState.SHARDED_POST_FORWARD:
            source, ag = group._post_forward_rows, None
            group._post_forward_rows = None
            pg = group.post_forward_group
        else:
            source, ag = group.sharded, None
            with streams.on(copy_in_stream):
                if group.offload_to_cpu and source.dtype == group.param_dtype:
                    # [Note: Offloaded shards] the host shard goes straight into
                    # this rank's row of the all-gather output, the collective's
                    # input in place: no device copy of the shard is made. (As
                    # the all-gather input, such a copy lived until the copy-out,
                    # a shard above FSDP2 at the peak: FSDP2 frees its copy after
                    # its copy-in.) Chosen by the policy, not by device, so that
                    # CPU runs take it too.
                    ag = _all_gather_output(group)
                    ag[info.shard_rank].copy_(source, non_blocking=True)
                    source = ag[info.shard_rank]
                elif source.device != group.device:  # CPU offload with a cast
                    source = source.to(group.device, non_blocking=True)
                if source.dtype != group.param_dtype and source.dtype not in FLOAT_DTYPES:
                    # float8 under a param_dtype: the copy kernels have no float8
                    # arithmetic; torch casts it (as FSDP2 does), then no cast is left
                    source = source.to(group.param_dtype)
                if source.dtype != group.param_dtype:  # one launch: the cast
                    ag = _all_gather_output(group)
                    group.ops.all_gather_copy_in(source, ag, info.shard_rank)
                    source = ag[info.shard_rank]
                # else no cast to fuse: the sharded buffer (row layout) is the
                # all-gather input as it is
            if ag_stream is not None:
                ag_stream.wait_stream(copy_in_stream)
        comm = group.all_gather_comm  # [Note: Comm objects]
        with streams.on(ag_stream):
            work = None
            if comm is not None and info.shard_size > 1:  # one rank: none, as FSDP2
                ag = _all_gather_output(group) if ag is None else ag
                work = comm(
                    output_tensor=ag.view(-1),
                    input_tensor=source.view(-1),
                    group=pg,
                    async_op=async_op,
                )
            elif info.shard_size > 1:
                ag = _all_gather_output(group) if ag is None else ag
                # bytes are bytes: a dtype the backend may not know (float8 or bool
                # on gloo) goes as its same-width integers ([Note: Raw copies])
                out, inp = bits(ag.view(-1)), bits(source.view(-1))
                work = all_gather(out, inp, group=pg, async_op=async_op)
            elif ag is None:
                ag = source.view(1, -1)  # one rank: its row is the whole output
            event = streams.record(ag_stream)
        work = work if async_op else None
        if work is None and not streams.enabled:
            # The collective is done with its input: drop the post-forward rows
            # now, not at the copy-out (on streams they live until it, as in FSDP2).
            source = None
        group._pending_unshard = (work, ag, event, source)

    def wait_for_unshard(self, group, defer_release: bool) -> None:
        work, ag, _, source = group._await_unshard(defer_release)
        streams = group.streams
        group._alloc_unsharded()
        group.sharding.copy_out(group, ag)
        # Rows for a post-forward reshard: only outside backward, which reshards to
        # SHARDED; in backward the all-gather output is freed now, as FSDP2 frees it.
        if group.post_forward_group is not None and not in_autograd_backward():
            size = group.info.shard_size // group.post_forward_size
            first = (group.info.shard_rank % group.post_forward_size) * size
            group._ag_rows = (ag, first, size)
        streams.release_after((ag, source), streams.record(), defer_release and work is None)
        group.state = ShardedState.UNSHARDED
        group.managed.swap(group.unsharded_params)

    def reshard(self, group, after_forward: bool) -> None:
        if group._pending_unshard is not None:
            group.wait_for_unshard()
        if group.state == ShardedState.SHARDED_POST_FORWARD and not after_forward:
            group._post_forward_rows = None
            group._post_forward_event = None
            group.state = ShardedState.SHARDED
        if group.state != ShardedState.UNSHARDED:
            return
        keep_rows = after_forward and group._ag_rows is not None
        if keep_rows:
            ag, first, size = group._ag_rows
            group._post_forward_rows = ag[first : first + size].clone()
            # The clone read the all-gather output on the compute stream: release
            # it after that, and the next unshard reads the rows after it too.
            group._post_forward_event = group.streams.record()
            group.streams.release_after((ag,), group._post_forward_event, defer=True)
        group._ag_rows = None
        group._keep_user_flags(after_forward)
        group._free_unsharded()
        group.state = ShardedState.SHARDED_POST_FORWARD if keep_rows else ShardedState.SHARDED
        group.managed.swap(group.sharded_params)

    def plain_grads(self, group, grads: list) -> None:
        """Never called: autograd's gradients of row-layout views are plain."""


ROW_GATHER = RowGather()
