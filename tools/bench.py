"""te-serial benchmarks. Each prints figures as ratios against the baseline its issue names.

    python tools/bench.py quantize     # GB/s of BF16 input quantized per recipe vs a plain FP8 cast

Timings are medians of several runs in one process; nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_serial.recipes import RECIPES, recipe_quantizer  # noqa: E402


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_quantize(args) -> None:
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size).to(torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9
    base = _median_seconds(lambda: x.to(torch.float8_e4m3fn), args.repeat)
    print(f"quantize {args.size}x{args.size} bf16 ({gb * 1e3:.0f} MB), both usages, "
          f"{torch.get_num_threads()} threads, median of {args.repeat}")
    print(f"{'recipe':<18}{'GB/s':>8}{'vs cast':>9}")
    print(f"{'x.to(e4m3) cast':<18}{gb / base:>8.2f}{1.0:>9.2f}")
    for name in RECIPES:
        q = recipe_quantizer(name)
        sec = _median_seconds(lambda: q.quantize(x), args.repeat)
        print(f"{name:<18}{gb / sec:>8.2f}{base / sec:>9.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    q = sub.add_parser("quantize", help="quantize throughput per recipe")
    q.add_argument("--size", type=int, default=4096)
    q.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    {"quantize": bench_quantize}[args.which](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
