"""Streams and events: which stream each part of an unshard and of a gradient
reduction runs on, what waits for what, and how long cross-stream tensors live.

[Note: Streams]
On an accelerator the groups of one root share four side streams, as in FSDP2:
copy-in, all-gather, reduce-scatter and all-reduce (the first three at high
priority, so their small kernels are not queued behind compute).

- Unshard from a hook (forward, pre-backward, prefetch): the copy-in runs on
  the copy-in stream and the collective on the all-gather stream, so the host
  issues the next group's all-gather while the compute stream still runs this
  one's layer. The copy-out runs on the compute stream after waiting for the
  all-gather's event. ``unshard`` called by the user with ``async_op=True``,
  and outside hooks, runs on the compute stream (the collective's work object
  orders it).
- The all-gather streams wait for the compute stream (or the
  ``set_post_optim_event`` event) at the root's pre-forward: the optimizer
  wrote the sharded buffers they read.
- Reduction: the reduce-scatter copy-in runs on the compute stream (it reads
  the gradients autograd left there); the reduce-scatter stream waits for it,
  then runs the collective and the post-reduce into the sharded gradient
  buffer. HSDP's all-reduce and a user all-reduce hook run on the all-reduce
  stream (or the hook's own). The end of backward makes the compute stream
  wait for the last post-reduce event of every stream used, so the optimizer
  reads finished gradients.

[Note: Cross-stream lifetimes]
The caching allocator hands a freed block to the next allocation on the stream
it was allocated on, without waiting for other streams that still use it. A
tensor made on one stream and used on another is therefore kept referenced
until the allocating stream is ordered after the last use:

- an all-gather output (allocated on a side stream, read by the copy-out on
  the compute stream): released after the all-gather streams wait for the
  copy-out's event. In forward the release is deferred to the next group's
  ``wait_for_unshard``, so that group's all-gather is already issued and
  overlaps this copy-out (the memory of one extra all-gather output). Rows
  kept for a post-forward reshard are cloned from it later, so it is released
  after the clone's event instead.
- a reduce-scatter input (compute stream, read by the reduce-scatter stream):
  released before the next group allocates its own, or at the end of backward,
  after the compute stream waits for its reduce-scatter's event; one stays in
  flight (as in FSDP2, which releases at the same point).
- a reduce-scatter output read on the all-reduce stream: released at the group's
  next reduction or the end of backward, after the compute stream waited for
  its event (every reduce-scatter starts by waiting for the compute stream).
  Where no cast is due it is the sharded gradient buffer itself, which the
  ``.grad``s keep anyway, as FSDP2's reduce output is its gradients; a second
  buffer kept per group would add a sharded model's gradients to the peak.

On CPU every op runs in order on the host: ``CommStreams.enabled`` is False
and none of this costs anything.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["CommStreams", "device_module"]


def device_module(device: torch.device) -> Any:
    """The torch device module (``torch.cuda``, ...) whose streams fsdp-rs uses
    on ``device``, or None where work runs in program order (CPU)."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device)


_NO_STREAM = contextlib.nullcontext()


class CommStreams:
    """The side streams and cross-group stream state of one root (FSDP2's
    ``FSDPCommContext``); see [Note: Streams]."""

    def __init__(self, device: torch.device) -> None:
        module = device_module(device)
        self.module = module
        self.enabled = module is not None
        # (tensors kept alive, event the all-gather streams wait for before release)
        self._all_gather_releases: list[tuple[tuple, Any]] = []
        # (reduce-scatter input, its reduce-scatter's event): one in flight, or the
        # group's reduce_scatter_max_input_buffers
        self._reduce_scatter_inputs: list[tuple[torch.Tensor, Any]] = []
        self._last_post_reduce: dict[Any, Any] = {}  # stream -> its last post-reduce event
        # group -> (its reduce-scatter output read off the reduce-scatter stream,
        # the event of that last use)
        self._reduce_outputs: dict[Any, tuple[torch.Tensor, Any]] = {}
        # Without streams: the bytes of this backward's last reduce-scatter input,
        # dropped after its collective where FSDP2 keeps it until the next
        # group's reduction ([Note: Reduction memory] in gradients.py).
        self.released_reduce_bytes = 0
        # The GradientReductionHandle not yet waited on of a root using these
        # streams ([Note: Manual backward finalization]); never set on NO_STREAMS.
        self.active_reduction = None
        if module is None:
            return
        self.copy_in = module.Stream(priority=-1)
        self.all_gather = module.Stream(priority=-1)
        self.reduce_scatter = module.Stream(priority=-1)
        self.all_reduce = module.Stream()

    # ------------------------------------------------------------ primitives

    def current(self) -> Any:
        return self.module.current_stream()

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """Run the block on ``stream`` (nothing to do without streams)."""
        return _NO_STREAM if stream is None else self.module.stream(stream)

    def record(self, stream: Any | None = None) -> Any:
        """An event recorded on ``stream`` (the current one by default); None
        without streams."""
        if not self.enabled:
            return None
        return (stream or self.current()).record_event()

    def wait_current(self, event: Any) -> None:
        """The compute (current) stream waits for ``event``."""
        if event is not None:
            self.current().wait_event(event)

    # ------------------------------------------------------------ all-gather

    def all_gather_streams(self, side: bool) -> tuple[Any, Any]:
        """(copy-in stream, all-gather stream): the side streams for an unshard
        from a hook, else None (the current stream)."""
        if self.enabled and side:
            return self.copy_in, self.all_gather
        return None, None

    def all_gather_streams_wait(self, event: Any) -> None:
        """Both all-gather streams wait for ``event``."""
        if event is not None:
            self.copy_in.wait_event(event)
            self.all_gather.wait_event(event)

    def all_gather_streams_wait_current(self, post_optim_event: Any = None) -> None:
        """At the root's pre-forward: the all-gather streams wait for the
        optimizer (its event if the user gave one, else the compute stream)."""
        if not self.enabled:
            return
        if post_optim_event is not None:
            self.all_gather_streams_wait(post_optim_event)
            return
        current = self.current()
        self.copy_in.wait_stream(current)
        self.all_gather.wait_stream(current)

    def release_after(self, tensors: tuple, event: Any, defer: bool) -> None:
        """Drop ``tensors`` (allocated on an all-gather stream) once the
        all-gather streams wait for ``event``: now, or (``defer``) at the next
        ``flush_all_gather``; see [Note: Cross-stream lifetimes]."""
        if not self.enabled:
            return
        if defer:
            self._all_gather_releases.append((tensors, event))
        else:
            self.all_gather_streams_wait(event)

    def flush_all_gather(self) -> None:
        """Release the deferred all-gather tensors."""
        releases, self._all_gather_releases = self._all_gather_releases, []
        for _, event in releases:
            self.all_gather_streams_wait(event)

    # ------------------------------------------------------------- reduction

    def release_reduce_scatter_inputs(self, group: Any) -> None:
        """Before ``group`` allocates its reduce-scatter input (where FSDP2 does):
        release the oldest kept inputs, after the compute stream waits for their
        reduce-scatters, so that with the new one at most
        ``set_reduce_scatter_max_input_buffers(n)`` are in flight."""
        if self.enabled:
            self._release_reduce_scatter_inputs(keep=group.reduce_scatter_max_input_buffers - 1)

    def begin_reduction(self, group: Any) -> None:
        """Before ``group``'s reduce-scatter: release its previous output read off
        the reduce-scatter stream, after the compute stream waits for its last
        use; then order the reduce-scatter stream after the compute stream's
        copy-in."""
        kept = self._reduce_outputs.pop(group, None)
        if kept is not None:
            self.wait_current(kept[1])
        self.reduce_scatter.wait_stream(self.current())

    def _release_reduce_scatter_inputs(self, keep: int = 0) -> None:
        """Release the oldest kept inputs until ``keep`` remain, once the compute
        stream (which reuses their memory) waited for their reduce-scatters."""
        inputs = self._reduce_scatter_inputs
        release = max(len(inputs) - keep, 0)
        self._reduce_scatter_inputs = inputs[release:]
        for _, event in inputs[:release]:
            self.wait_current(event)

    def keep_reduce_scatter_input(self, rs_input: torch.Tensor, event: Any) -> None:
        self._reduce_scatter_inputs.append((rs_input, event))

    def keep_reduce_output(self, group: Any, output: torch.Tensor, event: Any) -> None:
        """``group``'s reduce-scatter output, read on another stream until ``event``."""
        self._reduce_outputs[group] = (output, event)

    def note_post_reduce(self, stream: Any, event: Any) -> None:
        self._last_post_reduce[stream] = event

    def end_of_backward(self) -> None:
        """The compute stream waits for every stream's last post-reduce (which
        covers the kept reduce-scatter outputs) and the reduce-scatter inputs
        still kept; all are then released."""
        self.released_reduce_bytes = 0
        if not self.enabled:
            return
        for event in self._last_post_reduce.values():
            self.wait_current(event)
        self._last_post_reduce = {}
        self._reduce_outputs = {}
        self._release_reduce_scatter_inputs()
        self.flush_all_gather()


NO_STREAMS = CommStreams(torch.device("cpu"))
"""What a group uses before its root's lazy init, and on CPU."""
