"""Timing of repeated calls: wall clock (``time.perf_counter``, GC paused as in
``timeit``) or, for CUDA work, CUDA events with the L2 cache flushed between calls."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["L2_FLUSH_BYTES", "Timing", "fresh_dtensor_caches", "time_call", "time_cuda"]

T = TypeVar("T")

L2_FLUSH_BYTES = 256 * 2**20
"""Bytes zeroed before each CUDA-timed call: larger than any current GPU's L2 cache."""


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call."""

    seconds: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def time_call(
    fn: Callable[[], T], repeat: int, warmup: int = 0, *, collect: bool = True
) -> tuple[Timing, T]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Returns the timings and the last call's result. The garbage collector is
    paused around each timed call so a collection triggered by earlier
    allocations does not land inside one measurement; with ``collect`` it also
    runs a full collection before each (about 0.1 s once torch is imported, so
    pass False for calls that allocate few Python objects).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    result = None
    for _ in range(warmup):
        result = fn()
    seconds = []
    gc_was_enabled = gc.isenabled()
    try:
        for _ in range(repeat):
            del result  # free the previous plan before timing the next one
            if collect:
                gc.collect()
            gc.disable()
            start = time.perf_counter()
            result = fn()
            seconds.append(time.perf_counter() - start)
            if gc_was_enabled:
                gc.enable()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(tuple(seconds)), result


def time_cuda(fn: Callable[[], object], repeat: int, warmup: int = 3) -> Timing:
    """Call ``fn`` ``warmup`` times, then time ``repeat`` calls with CUDA events.

    Like ``triton.testing.do_bench``, a memset of ``L2_FLUSH_BYTES`` before each
    call evicts the L2 cache, so bandwidths are from device memory. Host time
    spent launching counts whenever it keeps the device waiting.
    """
    import torch

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeat)
    ]
    torch.cuda.synchronize()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(tuple(start.elapsed_time(end) / 1e3 for start, end in events))


def fresh_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches before a library's untimed
    warm-up call; see [Note: One process, two libraries].

    [Note: One process, two libraries]
    DTensor caches each op's sharding decision under a key made of its
    arguments' ``DTensorSpec`` objects, process-wide (per thread; in torch 2.13
    in a C++ cache as well as in Python). Two models sharded separately have
    equal but distinct specs (each library, each model, builds its own meshes
    and specs), so the model that runs second finds the first one's keys: every
    lookup compares its specs with the stored ones field by field
    (``DTensorSpec.__eq__``, ``DeviceMesh.__eq__``: a few microseconds each)
    instead of by identity. A foreach AdamW step over 2,000 DTensor
    parameters (CPU, cProfile) makes 2,000 such calls when its own model filled
    the caches and 12,000 when the other library's did: 68 ms for fsdp-rs alone,
    147 ms right after FSDP2 (FSDP2: 72 ms alone, 92 ms after fsdp-rs). On a GPU,
    where the arithmetic is fast, these Python comparisons are the step. A
    user's process trains one model, which finds its own keys; the benches empty
    the caches before each library's warm-up call so each is timed as it would
    run alone.
    """
    from torch.distributed.tensor import DTensor, debug

    clear_all = getattr(debug, "_clear_sharding_prop_cache", None)  # C++ and Python
    if clear_all is not None:
        clear_all()
        return
    # older torch (2.9): the Python cache only, without a cache_clear of its own
    cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    clear = getattr(cache, "cache_clear", None) or cache.cache.cache_clear
    clear()
