"""How steadily this machine runs CPU work: the context for every tail latency the bench records (issue 14).

A loop of equal chunks of pure Python work (no I/O, no vrnic code) is timed chunk by chunk. On a machine that
gives its CPU steadily every chunk takes about the median; where the host takes the CPU away (a CPU quota, a
busy neighbour), chunks run several times slower in windows. A request served inside such a window is slow
whatever the server does, so p99 cannot be better than the windows allow.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

SLOW_FACTOR = 4.0  # a chunk this many times the median ran in a window where the machine was slowed


@dataclass(frozen=True)
class Steadiness:
    median_chunk_ms: float
    slowed_share: float  # of the wall time, spent in slowed chunks (0..1)
    slowed_windows: int  # runs of consecutive slowed chunks
    longest_window_ms: float


def steadiness(chunks_ms: list[float], factor: float = SLOW_FACTOR) -> Steadiness:
    """Judge a series of equal chunks' durations, in the order they ran."""
    if not chunks_ms:
        raise ValueError("no chunks timed")
    median = statistics.median(chunks_ms)
    slowed, windows, longest, current = 0.0, 0, 0.0, 0.0
    in_window = False
    for chunk in chunks_ms:
        if chunk >= factor * median:
            slowed += chunk
            if not in_window:
                windows, current = windows + 1, 0.0
            current += chunk
            longest = max(longest, current)
            in_window = True
        else:
            in_window = False
    return Steadiness(median, slowed / sum(chunks_ms), windows, longest)


def spin(seconds: float, chunk_iterations: int = 20_000) -> list[float]:
    """Time equal chunks of Python work for about `seconds` (ms each)."""
    chunks: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        total = 0
        for i in range(chunk_iterations):
            total += i
        finished = time.perf_counter()
        chunks.append((finished - started) * 1e3)
        if finished >= end:
            return chunks
