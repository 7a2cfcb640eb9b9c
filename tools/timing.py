"""Timing for the benchmarks: medians of interleaved runs. No te-serial import, so that a child
process running another commit's sources (the quantize baseline) times its work the same way."""

from __future__ import annotations

import statistics
import time


def ab(fns: dict, repeat: int) -> dict[str, float]:
    """Median seconds of each function, runs interleaved A/B/C/A/B/C…"""
    times = {k: [] for k in fns}
    for k, fn in fns.items():  # warm-up
        fn()
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
