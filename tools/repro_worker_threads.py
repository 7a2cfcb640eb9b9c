"""Checks that te-serial's compiled graphs give the eager bytes when worker threads call them.

Run ``python tools/repro_worker_threads.py`` (about a minute: each setup compiles its own graphs in a
fresh child process). Worker threads quantize with the compiled graphs, and the script counts the
quantized buffers whose bytes differ from the eager path's. It prints one line per setup:

* ``workers compile``: 4 worker threads quantize 4 formats × 8 tensors, graphs first compiled there;
* ``main compiles first``: the same, after the main thread compiled every graph;
* ``one worker``: the first setup with a single worker thread.

Until te_serial.tracing, the first setup went wrong on torch 2.13 (12 to 108 of 96-288 buffers,
99-100% of their bytes): ``torch.compiler.is_compiling()`` is True in every thread while one
thread compiles, so eager code running in the other workers took the compiled branches of the
numerics. The graphs were main-thread-only while the cause was unknown. Exits non-zero if any
buffer differs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import concurrent.futures, sys, torch
sys.path.insert(0, sys.argv[1] + "/tests")
import te_serial as ts
from te_serial.formats import fused
from helpers import make_input

setup, rounds = sys.argv[2], 3
qs = [ts.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1), ts.MXFP8Quantizer(torch.float8_e4m3fn),
      ts.NVFP4Quantizer(), ts.Float8CurrentScalingQuantizer(torch.float8_e5m2)]
xs = [make_input("random", (256 + 128 * (i % 3), 512), torch.bfloat16, seed=40 + i) for i in range(8)]
jobs = [(q, x) for q in range(len(qs)) for x in range(len(xs))]
want = {j: qs[j[0]].quantize(xs[j[1]], eager=True).buffers() for j in jobs}

def work(job):
    with fused.policy("fused"):
        return job, qs[job[0]].quantize(xs[job[1]]).buffers()

if setup == "main":
    with fused.policy("fused"):
        for j in jobs:
            qs[j[0]].quantize(xs[j[1]])
bad = 0
for _ in range(rounds):
    with concurrent.futures.ThreadPoolExecutor(1 if setup == "one" else 4) as pool:
        for job, got in pool.map(work, jobs):
            bad += sum(not torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)) for k, w in want[job].items())
print(bad, len(jobs) * rounds)
"""

SETUPS = [("workers", "workers compile"), ("main", "main compiles first"), ("one", "one worker")]


def main() -> int:
    wrong = 0
    for setup, label in SETUPS:
        res = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), setup], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{label}: the child failed\n{res.stderr[-2000:]}")
            return 2
        bad, calls = res.stdout.split()
        print(f"{label:20s} {bad} wrong buffers in {calls} quantize calls")
        wrong += int(bad)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
