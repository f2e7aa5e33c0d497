"""Planning runs without the GIL: other Python threads keep running meanwhile."""

import threading
import time

import numpy as np

from fsdp_rs import plan_flat, plan_group


def _python_progress_during(call) -> int:
    """Count main-thread loop iterations that ran strictly inside `call`,
    which runs on a second thread (margins skip the call's entry and exit)."""
    window = {}

    def worker():
        window["start"] = time.perf_counter()
        call()
        window["end"] = time.perf_counter()

    thread = threading.Thread(target=worker)
    stamps = []
    thread.start()
    while thread.is_alive():
        stamps.append(time.perf_counter())
    thread.join()
    start, end = window["start"], window["end"]
    margin = (end - start) * 0.2
    return sum(start + margin < t < end - margin for t in stamps)


def test_plans_release_the_gil():
    n = 1_000_000
    ndims = np.full(n, 3, dtype=np.int64)
    dims = np.tile(np.array([7, 5, 3], dtype=np.int64), n)
    assert _python_progress_during(lambda: plan_group(ndims, dims, 8, 1, tile_numel=4)) > 0
    assert _python_progress_during(lambda: plan_flat(ndims, dims, 8, 1, aligned_numel=3)) > 0
