"""Whether the calling thread is being traced by ``torch.compile``: the switch between the compiled
and the eager forms of te-serial's numerics.

``torch.compiler.is_compiling()`` alone is process-wide: it stays True while any thread compiles.
Code running eagerly in another thread at that moment took the compiled branches (casts that
return FP8-typed values where bits were expected, no NaN handling) and gave wrong bytes
(``tools/repro_worker_threads.py``). Dynamo's tracing context is per thread, so both must hold.
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result  # dynamo calls it while tracing and bakes in the answer
def tracing() -> bool:
    """True while torch.compile traces the calling thread's code (ours or a caller's graph)."""
    return torch.compiler.is_compiling() and torch._guards.TracingContext.try_get() is not None
