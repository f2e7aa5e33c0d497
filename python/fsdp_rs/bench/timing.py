"""Wall-clock timing of repeated calls (``time.perf_counter``, GC paused as in ``timeit``)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Timing", "time_call"]

T = TypeVar("T")


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


def time_call(fn: Callable[[], T], repeat: int, warmup: int = 0) -> tuple[Timing, T]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Returns the timings and the last call's result. The garbage collector is
    paused around each timed call so a collection triggered by earlier
    allocations does not land inside one measurement.
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
