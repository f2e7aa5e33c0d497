"""A simulated accelerator to test fsdp-rs's stream protocol on CPU.

``SimDevice`` stands in for ``torch.cuda``'s stream API (``Stream``, ``Event``,
``current_stream``, ``stream``). The ops still run on the host, in program
order, so results are those of CPU; what is simulated is what a GPU would be
free to reorder. ``RaceChecker`` (a ``TorchDispatchMode``) sees every op with
the stream it was issued on, tracks with vector clocks which work is ordered
before which (program order within a stream, ``record_event`` /
``wait_event`` / ``wait_stream`` across them) and reports:

- a read of memory whose last write on another stream is not ordered before it;
- a write not ordered after the last write and the reads since, on other streams;
- a freed block whose next allocation on the stream that allocated it is not
  ordered after the other streams' uses of it (the caching allocator's rule:
  without ``record_stream``, a block goes back to its stream's pool at once).

Memory is tracked per storage allocation (a storage resized to a new block
counts as a new one). Collectives are c10d ops: gloo (or the fake process
group) runs them at once on the host; the checker treats them as work on the
stream they were issued on.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RaceChecker", "SimDevice", "simulated_streams"]


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class SimEvent:
    def __init__(self, device: SimDevice, **unused: Any) -> None:
        self._device = device
        self.clock: dict[int, int] | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self.clock = dict((stream or self._device.current_stream()).clock)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or self._device.current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SimStream:
    def __init__(self, device: SimDevice, priority: int = 0, name: str = "") -> None:
        self.id = len(device.streams)
        device.streams.append(self)
        self.name = name or f"stream{self.id}"
        self.priority = priority
        self._device = device
        self.clock = {self.id: 0}

    def wait_stream(self, other: SimStream) -> None:
        _merge(self.clock, other.clock)

    def wait_event(self, event: SimEvent) -> None:
        if event.clock is not None:
            _merge(self.clock, event.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent(self._device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class SimDevice:
    """What fsdp-rs uses of ``torch.cuda``, over simulated streams."""

    def __init__(self) -> None:
        self.streams: list[SimStream] = []
        self.default = SimStream(self, name="compute")

        self._current = self.default

    def Stream(self, priority: int = 0, **unused: Any) -> SimStream:
        return SimStream(self, priority)

    def Event(self, **kwargs: Any) -> SimEvent:
        return SimEvent(self, **kwargs)

    def current_stream(self, device: Any = None) -> SimStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: SimStream | None):
        previous = self._current
        self._current = stream or previous
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        pass


@dataclass
class _Block:
    """One storage allocation and the accesses to it."""

    weak: StorageWeakRef
    ptr: int
    alloc: SimStream
    write: tuple[int, int, str] | None  # (stream id, clock, op)
    reads: dict[int, tuple[int, str]] = field(default_factory=dict)  # stream id -> (clock, op)
    shared: bool = False  # accessed from a stream other than ``alloc``


_METADATA_ONLY = {
    torch.ops.aten.empty_like,
    torch.ops.aten.zeros_like,
    torch.ops.aten.ones_like,
    torch.ops.aten.full_like,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_zeros,
    torch.ops.aten.set_,  # re-points a tensor at a storage; the data is untouched
}

# c10d ops: which arguments they write and read (their schemas carry no alias info).
_C10D = {
    "_allgather_base_": ((0,), (1,)),
    "_reduce_scatter_base_": ((0,), (1,)),
    "allreduce_": ((0,), (0,)),
}


class RaceChecker(TorchDispatchMode):
    def __init__(self, device: SimDevice) -> None:
        super().__init__()
        self.device = device
        self.blocks: dict[int, _Block] = {}  # by StorageImpl address
        self.shared: dict[int, _Block] = {}  # the blocks whose frees need a check
        self.pending_frees: dict[int, list[_Block]] = {}  # allocating stream id -> blocks
        self.violations: list[str] = []
        self.ops_per_stream: collections.Counter[SimStream] = collections.Counter()

    # --------------------------------------------------------------- report

    def _report(self, kind: str, stream: SimStream, op: str, other: tuple, block: _Block) -> None:
        other_stream = self.device.streams[other[0]]
        message = (
            f"{kind}: {op} on {stream} is not ordered after {other[-1]} on {other_stream} "
            f"(block allocated on {block.alloc})"
        )
        if message not in self.violations:
            self.violations.append(message)

    # ------------------------------------------------------------- blocks

    def _block(self, storage: torch.UntypedStorage, stream: SimStream) -> _Block | None:
        ptr = storage.data_ptr()
        if ptr == 0 or storage.nbytes() == 0:
            return None
        key = storage._cdata
        block = self.blocks.get(key)
        if block is not None and not block.weak.expired() and block.ptr == ptr:
            return block
        if block is not None and block.shared and not block.weak.expired():
            self._freed(block)  # resized to a new block
            self.shared.pop(id(block), None)
        # First seen: made before the checker started, or by a storage resize.
        return self._new_block(storage, stream)

    def _new_block(self, storage: torch.UntypedStorage, stream: SimStream) -> _Block:
        """A block allocated on ``stream`` now."""
        block = _Block(StorageWeakRef(storage), storage.data_ptr(), stream, None)
        self.blocks[storage._cdata] = block
        self._allocated(stream, block)
        return block

    def _freed(self, block: _Block) -> None:
        if block.shared:  # only other streams' uses need ordering before a reuse
            self.pending_frees.setdefault(block.alloc.id, []).append(block)

    def _allocated(self, stream: SimStream, block: _Block) -> None:
        """An allocation on ``stream`` may reuse any block freed to its pool:
        each must be ordered after the other streams' uses of it."""
        for old in self.pending_frees.pop(stream.id, ()):
            accesses = [(s, t, op) for s, (t, op) in old.reads.items()]
            if old.write is not None:
                accesses.append(old.write)
            for access in accesses:
                if access[0] != stream.id and stream.clock.get(access[0], 0) < access[1]:
                    self._report("reuse of a freed block", stream, "allocation", access, old)

    def _poll_frees(self) -> None:
        for key, block in list(self.shared.items()):
            if block.weak.expired():
                del self.shared[key]
                self._freed(block)

    def _share(self, block: _Block, stream: SimStream) -> None:
        if stream is not block.alloc and not block.shared:
            block.shared = True
            self.shared[id(block)] = block

    # ------------------------------------------------------------- accesses

    def _ordered(self, stream: SimStream, access: tuple) -> bool:
        return stream.clock.get(access[0], 0) >= access[1]

    def _read(self, block: _Block, stream: SimStream, t: int, op: str) -> None:
        if block.write is not None and not self._ordered(stream, block.write):
            self._report("read after write", stream, op, block.write, block)
        block.reads[stream.id] = (t, op)
        self._share(block, stream)

    def _write(self, block: _Block, stream: SimStream, t: int, op: str) -> None:
        if block.write is not None and not self._ordered(stream, block.write):
            self._report("write after write", stream, op, block.write, block)
        for s, (rt, rop) in block.reads.items():
            if s != stream.id and not self._ordered(stream, (s, rt)):
                self._report("write after read", stream, op, (s, rt, rop), block)
        block.write = (stream.id, t, op)
        block.reads = {}
        self._share(block, stream)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stream = self.device.current_stream()
        self.ops_per_stream[stream] += 1
        self._poll_frees()
        stream.clock[stream.id] += 1
        t, op = stream.clock[stream.id], str(func)
        reads, writes = _accesses(func, args, kwargs)
        for tensor in reads:
            if (block := self._block(tensor.untyped_storage(), stream)) is not None:
                self._read(block, stream, t, op)
        for tensor in writes:
            if (block := self._block(tensor.untyped_storage(), stream)) is not None:
                self._write(block, stream, t, op)
        out = func(*args, **kwargs)
        if func.namespace != "c10d":
            returns = func._schema.returns
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for ret, value in zip(returns, outs, strict=False):
                if ret.alias_info is not None:
                    continue
                for tensor in _tensors(value):
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() == 0 or storage.nbytes() == 0:
                        continue
                    block = self._new_block(storage, stream)
                    block.write = (stream.id, t, op)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, DTensor):
        return [value._local_tensor]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(itertools.chain.from_iterable(map(_tensors, value)))
    return []


def _accesses(func, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors read, tensors written) by one op, from its schema. Views and
    ops that only read their input's metadata access no data."""
    if func.is_view or func.overloadpacket in _METADATA_ONLY:
        return [], []
    if func.namespace == "c10d":
        name = func._schema.name.split("::")[-1]
        writes, reads = _C10D.get(name, (range(len(args)), range(len(args))))
        return (
            [t for i in reads for t in _tensors(args[i])],
            [t for i in writes for t in _tensors(args[i])],
        )
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    positional = [a for a in func._schema.arguments if not a.kwarg_only]
    pairs = list(zip(positional, args, strict=False))
    pairs += [(a, kwargs[a.name]) for a in func._schema.arguments if a.name in kwargs]
    for arg, value in pairs:
        write = arg.alias_info is not None and arg.alias_info.is_write
        (writes if write else reads).extend(_tensors(value))
    return reads, writes


@contextlib.contextmanager
def simulated_streams():
    """fsdp-rs on CPU with the stream protocol of an accelerator: yields the
    ``SimDevice`` and a ``RaceChecker`` (enter it around the steps to check)."""
    import fsdp_rs.runtime.comm.streams as streams

    device = SimDevice()
    original = streams.device_module
    streams.device_module = lambda d: device
    try:
        yield device, RaceChecker(device)
    finally:
        streams.device_module = original
