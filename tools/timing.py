"""Timing for the benchmarks: medians of interleaved runs. No te-serial import, so that a child
process running another commit's sources (the quantize baseline) times its work the same way."""

from __future__ import annotations

import resource
import statistics
import time


def ab(fns: dict, repeat: int, faults: dict | None = None) -> dict[str, float]:
    """Median seconds of each function, runs interleaved A/B/C, C/B/A, A/B/C… (the order alternates,
    so no function always follows the same one); with ``faults``, the median count of page faults
    (fresh pages touched) of each's runs is put there too."""
    times = {k: [] for k in fns}
    counts = {k: [] for k in fns}
    for k, fn in fns.items():  # warm-up
        fn()
    for r in range(repeat):
        for k, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            counts[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if faults is not None:
        faults.update({k: statistics.median(v) for k, v in counts.items()})
    return {k: statistics.median(v) for k, v in times.items()}
