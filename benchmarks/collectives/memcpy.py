"""Memory-bandwidth reference: how fast one process copies a buffer of a row's size.

A shared-memory collective cannot beat the machine's copy bandwidth by much, so each row is
reported next to ``numpy.copyto`` of the same size, measured in the same invocation.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.collectives.sizes import scaled_count

# Enough repetitions for a stable median at small sizes; large sizes scale down to the floor.
_ITERS = 50
_BUDGET_BYTES = 1 << 30
_MIN_ITERS = 5


def copy_bandwidth(nbytes: int) -> float:
    """Median bandwidth of copying ``nbytes`` from one prefaulted buffer to another.

    Args:
        nbytes: bytes copied per repetition (at least 1).

    Returns:
        Bytes copied per second, in GB/s (10**9), counting each byte once (not read + write).
    """
    src = np.ones(max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # faults in the destination's pages, which are not part of a copy
    samples = []
    for _ in range(scaled_count(_ITERS, nbytes, _BUDGET_BYTES, _MIN_ITERS)):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(samples) / 1e9
