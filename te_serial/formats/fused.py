"""Compiled quantize and dequantize: each format's own numerics, fused by ``torch.compile``.

There is no second copy of any format's math here. ``engine.QuantizeEngine`` hands this module the same
pure functions its eager path runs (``_prepare`` + ``_quantize_rows`` over the whole tensor,
``_dequantize``); inductor fuses their dozen elementwise passes and reductions into a few loops
(vectorized C++ on CPU, Triton on CUDA). ``conversion.transforms`` runs its error sums (one pass
per lossy output) through :func:`run` too. This module owns the policy around that:

* **numerics pinned** (:data:`NUMERICS`): no fast-math, no FMA contraction, IEEE division and
  no flush-to-zero on Triton, and explicit low-precision casts kept, so the compiled kernels round
  exactly as the eager ones (and TE's) do. The formats' code must not divide by a constant
  (inductor turns ``x / c`` into ``x * (1 / c)`` on CUDA): every division there has a tensor divisor.
* **one compile per shape class**, not per tensor: dynamic shapes without duck sizing, so a
  model's few dozen weight shapes share a graph per format, usage set and input dtype (dims of size
  0 or 1 and alignment to a format's blocks make their own classes). Per-tensor values such as
  delayed scaling's scale enter as tensors (``Quantizer._kernel_args``), never as constants.
* **block-aligned inputs arrive blocked** (``base._blocked``): [M, K] as the view
  [M / a, a, K / b, b] with the format's block sizes static, so the graph's sizes are a·s0 and b·s1.
  With bare symbols inductor cannot prove K == 16·(K // 16), indexes every element through a
  modulo and leaves the loop scalar (NVFP4's cast ran 20× slower).
* **when**: ``"auto"`` (the default) compiles for tensors of at least :data:`MIN_NUMEL` elements
  on CPU and CUDA; ``"fused"`` compiles whatever the size (tests, benchmarks); ``"eager"`` never.
  ``TE_SERIAL_EAGER=1`` in the environment, ``quantize(x, eager=True)``, ``dequantize(eager=True)``
  or ``with fused.policy("eager")`` force the eager path.
* **NaN inputs run eager** (:func:`nan_free_amaxes`, one cheap pass that also gives the amax, and
  a format's block maxima where the native kernel takes the input): a compiled graph never
  sees a NaN, so its kernels need no NaN masks or canonicalizing selects, which would stop
  inductor vectorizing (transposed FP8 stores among them). NaN handling stays in
  one place, the eager code, which the oracle tests pin.
* **any thread**: calls from several threads take turns on the compiled graphs (one call at a time,
  which uses every core anyway). The formats' code asks :func:`te_serial.tracing.tracing` whether it
  is being traced, not ``torch.compiler.is_compiling()``, which is True in every thread while one
  thread compiles: eager code running meanwhile in another thread took the compiled branches and
  gave wrong bytes (``tools/repro_worker_threads.py``; graphs were main-thread-only until then).
* **fallback**: where compiling fails (no C++ compiler, a dtype the backend lacks) the eager path
  runs and one warning per (function, format, device, dtype) says why; that key stays eager.

Inside someone else's ``torch.compile`` trace the eager code runs (and is traced by their graph).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from .. import native
from ..tracing import tracing

EAGER_ENV = "TE_SERIAL_EAGER"

#: below this many elements ``"auto"`` stays eager. A compile costs seconds (5-30 s per graph on 2
#: busy cores) once per process and shape class; eager quantize of 1M elements costs 10-100 ms, so
#: compiling pays off over a model's large weights, not over norms, biases, small tests or a few
#: small tensors (whose odd shapes, dims of 1, would each make a graph)
MIN_NUMEL = 1 << 20

#: inductor settings that keep TE's roundings; applied to every graph compiled here
NUMERICS: dict[str, Any] = {
    "cpp.enable_unsafe_math_opt_flag": False,       # no -funsafe-math-optimizations
    "cpp.enable_floating_point_contract_flag": "off",  # -ffp-contract=off: a*b+c stays two roundings
    "emulate_precision_casts": True,                # keep explicit casts; Triton: enable_fp_fusion off
    "eager_numerics.division_rounding": True,       # Triton x / y as div_rn, not approximate div.full
    "eager_numerics.disable_ftz": True,             # Triton keeps fp32 denormals (tiny inputs, scales)
    "use_fast_math": False,
}

#: dynamo settings for our calls only: room for one graph per format × usage set × input dtype ×
#: shape class on the two shared code objects (every format and usage set of the oracle table, with
#: its small and unaligned shapes, in one process: about 300 dequantize graphs), and Python float
#: constants (FP8_MAX, epsilons) baked in rather than traced as inputs (which restarts the trace)
_DYNAMO = {"recompile_limit": 1024, "accumulated_recompile_limit": 8192, "specialize_float": True}

_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar("te_serial_fused_policy", default=None)
_POLICIES = ("auto", "fused", "eager")

_lock = threading.Lock()
_call_lock = threading.RLock()  # one patched compiled call at a time (re-entrant: no self-deadlock)
_compiled: dict[Callable, Callable] = {}
_broken: dict[tuple, str] = {}
_stats = {"compiles": 0}


@contextlib.contextmanager
def policy(mode: str) -> Iterator[None]:
    """Within the block, quantize / dequantize run ``"auto"``, always ``"fused"``, or ``"eager"``."""
    if mode not in _POLICIES:
        raise ValueError(f"fused policy must be one of {_POLICIES}, got {mode!r}")
    token = _POLICY.set(mode)
    try:
        yield
    finally:
        _POLICY.reset(token)


def current_policy(eager: bool | None = None) -> str:
    """The policy in force: ``eager=True`` or ``TE_SERIAL_EAGER=1`` → eager, then :func:`policy`'s,
    then ``"auto"``. ``eager=False`` means "the default", not "force compiling"."""
    if eager or os.environ.get(EAGER_ENV, "") not in ("", "0"):
        return "eager"
    return _POLICY.get() or "auto"


def wants_fused(numel: int, device: torch.device, fusable: bool, eager: bool | None = None) -> bool:
    """Whether an op on a tensor of ``numel`` elements on ``device`` should run compiled
    (``fusable``: the quantizer's kernels compile exactly)."""
    if tracing() or not fusable or device.type not in ("cpu", "cuda"):
        return False  # inside a caller's graph the eager code is traced into it
    mode = current_policy(eager)
    return mode == "fused" or (mode == "auto" and numel >= MIN_NUMEL)


#: keys of what :func:`nan_free_amaxes` took, handed to the compiled graphs with ``_kernel_args``
TENSOR_AMAX, ROW_BLOCK_AMAX, COL_BLOCK_AMAX = "tensor_amax", "row_block_amax", "col_block_amax"


def nan_free_amaxes(x: torch.Tensor, block: int | None = None) -> dict[str, torch.Tensor] | None:
    """None where the 2-D ``x`` holds a NaN (it runs eager) or is empty; else ``max|x|`` as a 0-d
    fp32 tensor (:data:`TENSOR_AMAX`), and given a ``block`` b, where the native kernel takes x, the
    fp32 |x| maxima of its 1×b blocks [M, K/b] and b×1 blocks [M/b, K] (:data:`ROW_BLOCK_AMAX`,
    :data:`COL_BLOCK_AMAX`). One pass over x either way: the graphs take these rather than reading
    the input again (``Quantizer._tensor_amax``, the formats' ``_prepare``)."""
    if x.numel() == 0:
        return None
    if block:
        got = native.block_amax(x, block)
        if got is not None:
            rows, cols, nan = got
            if nan:
                return None
            rows = rows.float()
            return {TENSOR_AMAX: rows.amax(), ROW_BLOCK_AMAX: rows, COL_BLOCK_AMAX: cols.float()}
    else:
        got = native.amax(x)
        if got is not None:
            amax, nan = got
            return None if nan else {TENSOR_AMAX: amax.float()}
    lo, hi = torch.aminmax(x)  # min or max is NaN where any element is (infinities are not)
    if bool(torch.isnan(lo) | torch.isnan(hi)):
        return None
    return {TENSOR_AMAX: torch.maximum(lo.abs(), hi.abs()).float()}


def compile_count() -> int:
    """Graphs compiled by this module so far (what the compile-cache tests count)."""
    return _stats["compiles"]


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor with :data:`NUMERICS`, counting compiles."""
    from torch._inductor.compile_fx import compile_fx
    compiled = compile_fx(gm, example_inputs, config_patches=NUMERICS)
    with _lock:
        _stats["compiles"] += 1
    return compiled


def _compiled_fn(fn: Callable) -> Callable:
    with _lock:
        c = _compiled.get(fn)
        if c is None:
            c = _compiled[fn] = torch.compile(fn, backend=_backend, dynamic=True, fullgraph=True)
        return c


def run(fn: Callable, key: tuple, *args: Any) -> Any | None:
    """``fn(*args)`` compiled, or None where compiling failed for ``key`` (then the caller runs
    eager; the first failure per key warns)."""
    if key in _broken:
        return None
    compiled = _compiled_fn(fn)
    try:
        # dynamo's and fx's configs are process-wide: the patch holds for one call at a time (the
        # kernels inside use every core anyway), so two threads never see each other's settings
        with _call_lock, torch.no_grad(), torch._dynamo.config.patch(_DYNAMO), \
                torch.fx.experimental._config.patch(use_duck_shape=False):  # M == K: no graph of its own
            return compiled(*args)
    except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = f"{type(e).__name__}: {' '.join(lines[:3])}"
        with _lock:
            first = key not in _broken
            _broken[key] = reason
        if first:
            warnings.warn(f"te_serial: compiled {key[0]} for {key[1:]} failed, running eager from now on "
                          f"({reason[:300]}); set {EAGER_ENV}=1 to skip compiling", RuntimeWarning,
                          stacklevel=3)
        return None


def failures() -> dict[tuple, str]:
    """Keys whose compile failed (they run eager), with the reason."""
    with _lock:
        return dict(_broken)


def forget_failures() -> None:
    """Let keys that failed to compile try again (tests)."""
    with _lock:
        _broken.clear()
