"""The C kernels: a small C library (``kernels.c``) built where a build is expected, loaded, and
called through ctypes. Each kernel returns its result, or None where it declines: the library not
built or switched off, an operand on another device, a dtype, shape or layout its loop does not
take, or a nonzero return code from the C function (a kind this build lacks, a block size it does
not take). What runs instead is the caller's choice: ``kernel_ops`` wraps these as custom ops
that run the eager rule (``cast_rules``) on None; ``formats.fused`` reduces with torch.

* :func:`transpose_bytes` gives a 2-D array of 1-byte codes transposed, the same bytes: how the
  formats derive columnwise codes from codes computed in row order. torch's copy of a transposed
  uint8 view and inductor's transposed stores run far below ``memcpy`` speed; the C kernel runs
  near it (figures: docs/benchmarks.md).
* :func:`block_amax` takes the |x| maxima of a BF16 / FP16 array's 1×b and b×1 blocks and spots
  NaN in one read (|x| of a sign-magnitude float orders as its bits without the sign), where the
  compiled graphs and the NaN check read the input three times; :func:`amax` the tensor's, the same
  way (torch.aminmax took as long as a cast).
* :func:`scale_cast_fp8` is ``cast_rules.scale_and_cast_to_fp8`` (fp32 product, clamp, FP8 round
  to nearest even, by the FP8 definitions bit for bit), 16 lanes at a time: torch's fp32 → FP8
  conversion is scalar, and inside inductor's loop ran at a half (E4M3) or a quarter (E5M2) of a
  plain cast's speed. :func:`scale_cast_fp8_transposed` also writes the codes' transpose, a stripe
  at a time while in cache; :func:`scale_cast_fp8_pair` makes MXFP8's two usages (1×32 and 32×1
  block scales) from one read of the input.
* :func:`dequantize_fp8` is every FP8 format's dequantize step (codes widened 16 at a time, times
  the block's scale), where inductor converted fp8 → fp32 lane by lane.
* :func:`scale_cast_fp4` is NVFP4's data step by the same rule (E2M1 codes, packed two per byte as
  they are made), and :func:`fp4_4over6` is 4over6's choice in one pass: both candidates cast,
  their block errors summed in order, 2-D tiles' sums in the warp's tree order, both usages of
  16×16 tiles from one pass.
* Outputs of 4 MB and more ask for huge pages (:func:`_output`).

:data:`_SIGNATURES` holds every C function's signature; the library declares the interface
version it was written for (``te_serial_abi_version``), and one of another version than
:data:`_ABI_VERSION` is refused at load.

Why a C library built on the machine rather than a compiled wheel: te-serial stays one pure-Python
package, and the compiler it needs is the one inductor (``formats/fused.py``) already calls. So it is
built where a compiler is expected to run: on the first compiled quantize (inductor compiles there
anyway), or explicitly with ``te-serial build-kernels``. An eager path never starts a compiler: the
kernels load a library already built, else decline, silently. It is
built for the CPU it runs on (``-march=native``), with ``-ffp-contract=off`` and no fast-math, so
each product and sum rounds once, as torch's do, and with ``-fopenmp``: its kernels split their
rows among the OpenMP threads of torch's own runtime, as inductor's kernels do (a pool of its own
contended with the threads torch leaves spinning after each parallel region). Where the compiler
refuses a flag, the build drops it (the generic target, one thread); ``-Wall -Werror`` stay (OpenMP's
pragmas aside, which a build without OpenMP ignores, and the note that vector arguments change the
ABI, which holds for calls between files alone). The
shared object is cached per source, compiler, flags and CPU under :func:`cache_dir`; where a build
cannot be made or loaded (no compiler, a read-only home) one warning says why and the kernels
decline. ``TE_SERIAL_NATIVE=0`` skips it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from ..tracing import tracing

NATIVE_ENV = "TE_SERIAL_NATIVE"
CACHE_ENV = "TE_SERIAL_CACHE_DIR"

#: below this many bytes of input the calling thread does the work alone (waking the pool costs more)
_SPLIT_BYTES = 1 << 20
#: outputs from this size on are allocated with a huge-page hint (:func:`_output`)
_HUGE_BYTES = 4 << 20
#: the transpose's rows per stripe: a thread's share of rows is a multiple of it
_STRIPE = 64
#: compiler flags, then the optional ones, tried in this order until the compiler takes a set: this
#: CPU's instruction set and OpenMP, either alone (Apple's clang has no -fopenmp), neither
_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Werror", "-Wno-unknown-pragmas",
          "-Wno-psabi")
_OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())

_I32, _I64, _F32, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
#: the interface version kernels.c declares (te_serial_abi_version) and the table below describes
_ABI_VERSION = 3
#: every C function's signature, in one table: name → (argument types, return type)
_SIGNATURES: dict[str, tuple[list, object]] = {
    "te_serial_abi_version": ([], _I32),
    "te_serial_prefer_huge_pages": ([_PTR, _I64], _I32),
    "te_serial_transpose_u8": ([_PTR, _PTR] + [_I64] * 4 + [_I32], None),
    "te_serial_block_amax_u16": ([_PTR] + [_I64] * 4 + [ctypes.c_uint16, _PTR, _PTR, _I32], _I32),
    "te_serial_amax_u16": ([_PTR] + [_I64] * 3 + [ctypes.c_uint16, _I32], _I32),
    "te_serial_scale_cast_fp8": ([_PTR, _PTR, _PTR, _I32, _I32] + [_I64] * 7 + [_I32, _I32], _I32),
    "te_serial_scale_cast_fp8_t": ([_PTR] * 4 + [_I32, _I32] + [_I64] * 6 + [_I32, _I64, _I64, _I32], _I32),
    "te_serial_scale_cast_fp4": ([_PTR, _PTR, _PTR, _I32] + [_I64] * 7 + [_I32, _I32, _I32], _I32),
    "te_serial_fp4_4over6": ([_PTR, _I32, _I64, _I64] + [_PTR] * 6 + [_I32, _F32, _F32, _I32, _I32], _I32),
    "te_serial_fp4_4over6_tiles": ([_PTR, _I32, _I64, _I64] + [_PTR] * 8 + [_F32, _F32, _I32, _I32], _I32),
    "te_serial_dequant_fp8": ([_PTR, _PTR, _PTR, _I32] + [_I64] * 7 + [_I32, _I32], None),
    "te_serial_scale_cast_fp8_pair": ([_PTR] * 5 + [_I32, _I32, _I64, _I64, _I64, _I32], _I32),
    "te_serial_byte_histogram": ([_PTR, _I64, _PTR], None),
    "te_serial_map_bytes_u16": ([_PTR, _PTR, _I64, _PTR, _I32], None),
}

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TE_SERIAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/te_serial``,
    else ``~/.cache/te_serial``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "te_serial"


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read(1 << 20).splitlines() if ln.startswith((b"model name", b"flags", b"Features"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor().encode()


def _cached(source: bytes) -> Path:
    """Where the shared object for ``source`` (this compiler, flags and CPU) is kept."""
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256(b"\0".join([source, cc.encode(), repr((_FLAGS, _OPTIONAL_FLAGS)).encode(),
                                     platform.machine().encode(), platform.system().encode(),
                                     _cpu_id()])).hexdigest()[:16]
    return cache_dir() / f"te_serial_native-{key}.so"


def _build(source: bytes) -> Path:
    """The shared object for ``source``: from the cache, else compiled into it (written under a
    temporary name and renamed, so concurrent builds never load a half-written file)."""
    cc = os.environ.get("CC") or "cc"
    out = _cached(source)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "kernels.c", Path(tmp) / "lib.so"
        src.write_bytes(source)
        for optional in _OPTIONAL_FLAGS:
            proc = subprocess.run([cc, *_FLAGS, *optional, "-o", str(lib), str(src)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode == 0:
                break
        else:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(lib, out)
    return out


def _library(build: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it is switched off or could not be built (warned once).
    ``build``: compile it where no build is cached; otherwise (the eager paths) only a library
    already built is loaded, and the kernels decline, without a word."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    if "lib" not in _state and not build:
        if "path" not in _state:  # hashed once per process (the source, compiler, flags, CPU)
            _state["path"] = _cached(resources.files(__name__).joinpath("kernels.c").read_bytes())
        if not _state["path"].exists():
            return None
    with _lock:
        if "lib" not in _state:
            try:
                source = resources.files(__name__).joinpath("kernels.c").read_bytes()
                lib = ctypes.CDLL(str(_build(source)))
                for fn, (argtypes, restype) in _SIGNATURES.items():
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
                if lib.te_serial_abi_version() != _ABI_VERSION:
                    raise OSError(f"library interface version {lib.te_serial_abi_version()}, this te-serial "
                                  f"describes {_ABI_VERSION}")
                _state["lib"], _state["pid"] = lib, os.getpid()
            except (OSError, AttributeError, subprocess.SubprocessError) as e:  # AttributeError: a missing symbol
                _state["lib"] = None
                warnings.warn(f"te_serial: native byte kernels unavailable ({e}); torch's own ops run "
                              f"instead, slower. Set {NATIVE_ENV}=0 to skip building them", RuntimeWarning,
                              stacklevel=4)
        return _state["lib"]


@torch.compiler.assume_constant_result  # a constant to a graph that asks (kernel_ops; the loading is not traced)
def available() -> bool:
    """Whether the C kernels are built and loaded, building them where no build is cached: called
    where a build is expected (a compiled graph's first trace, ``te-serial build-kernels``)."""
    return _library(build=True) is not None


def build() -> Path | None:
    """Build (or find) the C kernels for this machine; the shared object's path, None where they
    cannot be built (the warning says why) or are switched off."""
    if not available():
        return None
    return _cached(resources.files(__name__).joinpath("kernels.c").read_bytes())


def _threads(rows: int, nbytes: int, unit: int) -> int:
    """How many of torch's OpenMP threads a kernel over ``rows`` rows of work touching ``nbytes`` of
    input splits into (whole multiples of ``unit`` rows each): as many as torch uses in this
    thread where the work is large enough to pay for a parallel region, one in a forked child
    (GNU OpenMP's threads do not survive a fork, and its next parallel region there would hang)."""
    if os.getpid() != _state.get("pid"):
        return 1
    return max(1, min(torch.get_num_threads(), nbytes // _SPLIT_BYTES, rows // unit))


def _output(lib: ctypes.CDLL, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized output that a kernel writes in full; from :data:`_HUGE_BYTES` on, with a
    huge-page hint over its whole 2 MB pages: where its memory is fresh (glibc had handed it back)
    it faults in per 2 MB, not per 4 KB (a fresh 16 MB output otherwise takes thousands of page
    faults). The first huge pages a process takes cost more, once; memory in reuse is unchanged."""
    y = torch.empty(shape, dtype=dtype)
    if y.numel() * y.element_size() >= _HUGE_BYTES:
        lib.te_serial_prefer_huge_pages(y.data_ptr(), y.numel() * y.element_size())
    return y


def _kernel(loop: Callable) -> Callable:
    """``loop(lib, x, *args)`` as the kernel ``(x, *args)``: declined (None) unless ``x`` is on CPU
    and the library is loaded. Never built here: the kernels run on eager paths too (the custom ops'
    bodies), which start no compiler."""
    @functools.wraps(loop)
    def kernel(x: torch.Tensor, *args):
        lib = _library() if x.device.type == "cpu" else None
        return None if lib is None else loop(lib, x, *args)
    return kernel


@_kernel
def transpose_bytes(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor ``x`` of 1-byte elements (codes, FP8 or packed FP4
    bytes), or None where declined (a column stride other than 1 is made 1 first)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = x.shape
    y = _output(lib, (cols, rows), x.dtype)
    if x.numel():
        lib.te_serial_transpose_u8(x.data_ptr(), y.data_ptr(), rows, cols, x.stride(0), rows,
                                   _threads(rows, x.numel(), _STRIPE))
    return y


@_kernel
def map_bytes_u16(lib: ctypes.CDLL, x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """``lut[x]`` (int16, x's shape) for a contiguous uint8 ``x`` and a 256-entry int16 ``lut`` (each
    entry a pair of bytes, as :func:`te_serial.kernel_ops.map_byte_pairs` builds it), viewed as its
    bytes, or None where declined."""
    if x.dtype != torch.uint8 or not x.is_contiguous() or lut.dtype != torch.int16 or lut.numel() != 256:
        return None
    lut = lut.contiguous()
    y = _output(lib, tuple(x.shape), torch.int16)
    if x.numel():
        lib.te_serial_map_bytes_u16(x.data_ptr(), y.data_ptr(), x.numel(), lut.data_ptr(),
                                    _threads(x.numel() // 4096, x.numel(), 1))
    return y.view(torch.uint8)


@_kernel
def byte_histogram(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """int64 counts of each byte value 0..255 in the contiguous 1-byte tensor ``x`` (torch's
    bincount needs a widened copy and runs one counter), or None where declined."""
    if x.element_size() != 1 or not x.is_contiguous():
        return None
    counts = torch.zeros(256, dtype=torch.int64)
    lib.te_serial_byte_histogram(x.data_ptr(), x.numel(), counts.data_ptr())
    return counts


#: magnitude bits of +inf per 16-bit float type: anything above is a NaN
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _magnitude_pass(x: torch.Tensor) -> tuple[ctypes.CDLL, int] | None:
    """(the library, +inf's magnitude bits) where the C maxima passes take ``x``: built, a 2-D
    BF16 / FP16 CPU tensor with unit column stride and some element, outside a traced graph."""
    inf_bits = _INF_BITS.get(x.dtype)
    if (inf_bits is None or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or x.numel() == 0
            or tracing()):
        return None
    lib = _library(build=True)  # only fused.nan_free_amaxes asks: the compiled path, where a build is expected
    return None if lib is None else (lib, inf_bits)
def block_amax(x: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The |x| maxima of a 2-D BF16 / FP16 ``x`` [M, K] over its 1×b blocks ([M, K/b]) and b×1 blocks
    ([M/b, K]), in x's dtype, and whether x holds a NaN (the maxima then mean nothing), from one pass.
    None where the C kernel does not apply: not built, another dtype or device, a row stride other
    than 1, M or K not a multiple of b, or no element."""
    got = _magnitude_pass(x)
    if got is None or x.shape[0] % b or x.shape[1] % b:
        return None
    lib, inf_bits = got
    (m, k), u16 = x.shape, torch.uint16
    rows, cols = torch.empty((m, k // b), dtype=u16), torch.empty((m // b, k), dtype=u16)
    nan = lib.te_serial_block_amax_u16(x.data_ptr(), m, k, x.stride(0), b, inf_bits, rows.data_ptr(), cols.data_ptr(),
                                       _threads(m, x.numel() * 2, b))
    return rows.view(x.dtype), cols.view(x.dtype), bool(nan)


def amax(x: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """max |x| of a 2-D BF16 / FP16 ``x`` as a 0-d tensor of x's dtype, and whether x holds a NaN (the
    maximum then means nothing), from one pass. None where the C kernel does not apply (as
    :func:`block_amax`: not built, another dtype or device, a row stride other than 1, no element)."""
    got = _magnitude_pass(x)
    if got is None:
        return None
    lib, inf_bits = got
    bits = lib.te_serial_amax_u16(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), inf_bits,
                                  _threads(x.shape[0], x.numel() * 2, 1))
    return torch.tensor(max(bits, 0), dtype=torch.int16).view(x.dtype), bits < 0  # magnitude bits fit int16


#: the C cast's input kinds
_IN_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _cast_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[tuple, tuple] | None:
    """A contiguous x's shape and its broadcast scale's strides as the C loop takes them: four dims,
    the last one's scale stride 0 (one scale per row) or 1 (one per element). Dims of 1 are dropped
    (a 128×1 block's trailing 1 would make rows of one element) and outer dims merged where the
    scale's strides allow; None where more than four remain or the last does not fit."""
    dims = [(n, st) for n, st in zip(shape, strides) if n != 1] or [(1, 0)]
    inner, outer = dims[-1], []
    for n, st in dims[:-1]:
        if outer and outer[-1][1] == st * n:
            outer[-1] = (outer[-1][0] * n, st)
        else:
            outer.append((n, st))
    if len(outer) > 3 or inner[1] not in (0, 1):
        return None
    outer = [(1, 0)] * (3 - len(outer)) + outer
    return tuple(n for n, _ in outer) + (inner[0],), tuple(st for _, st in outer) + (inner[1],)


def _cast_operands(x: torch.Tensor, scale: torch.Tensor | None, kind: int | None = None) -> tuple | None:
    """(input kind, contiguous x, fp32 scale, shape, scale strides) as the C loops take a CPU ``x``
    and its ``scale``, or None where they do not. ``kind``: given for inputs other than the casts'."""
    kind = _IN_KINDS.get(x.dtype) if kind is None else kind
    if kind is None:
        return None
    s = torch.ones((), dtype=torch.float32) if scale is None else scale
    if s.dtype != torch.float32 or s.device.type != "cpu":
        return None
    try:
        s = s.expand(x.shape)
    except RuntimeError:
        return None
    layout = _cast_layout(tuple(x.shape), tuple(s.stride()))
    if layout is None:
        return None
    return kind, x.contiguous(), s, *layout


@_kernel
def scale_cast_fp8(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None,
                   fp8_dtype: torch.dtype) -> torch.Tensor | None:
    """FP8 (``fp8_dtype``) of ``fp32(x) * scale`` clamped to the type's range (``scale`` fp32,
    broadcastable to x; None: 1), NaN 0x7F; or None where declined: more than four dims left after
    merging, a scale varying along x's last dim other than element by element, an input kind this
    build lacks (fp16 without _Float16)."""
    got = _cast_operands(x, scale)
    if got is None:
        return None
    kind, x, s, shape, strides = got
    y = _output(lib, tuple(x.shape), torch.uint8)
    n, outer = shape[3], shape[0] * shape[1] * shape[2]
    if x.numel():
        e5m2 = int(fp8_dtype == torch.float8_e5m2)
        if lib.te_serial_scale_cast_fp8(x.data_ptr(), s.data_ptr(), y.data_ptr(), kind, e5m2, n, *shape[:3], *strides,
                                        _threads(outer, x.numel() * x.element_size(), 1)):
            return None
    return y.view(fp8_dtype)


@_kernel
def scale_cast_fp8_transposed(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                              rows: int, width: int, keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`scale_cast_fp8`'s codes (empty without ``keep_rows``) and their transpose as a row-major
    [rows, width] array, [width, rows], from one pass (64 rows at a time, transposed while in cache);
    or None where declined: as :func:`scale_cast_fp8`, rows that are not whole blocks of the
    scale's layout, no element."""
    if not x.numel():
        return None
    got = _cast_operands(x, scale)
    if got is None:
        return None
    kind, x, s, shape, strides = got
    y = _output(lib, tuple(x.shape) if keep_rows else (0,), torch.uint8)
    yt = _output(lib, (width, rows), torch.uint8)
    y_ptr = y.data_ptr() if keep_rows else None
    if lib.te_serial_scale_cast_fp8_t(x.data_ptr(), s.data_ptr(), y_ptr, yt.data_ptr(), kind,
                                      int(fp8_dtype == torch.float8_e5m2), shape[3], *shape[1:3], *strides,
                                      rows, width, _threads(rows, x.numel() * x.element_size(), _STRIPE)):
        return None
    return y.view(fp8_dtype), yt.view(fp8_dtype)


@_kernel
def dequantize_fp8(lib: ctypes.CDLL, bits: torch.Tensor, scale: torch.Tensor,
                   fp8_dtype: torch.dtype) -> torch.Tensor | None:
    """fp32 of the FP8 (``fp8_dtype``) codes ``bits`` (uint8 or FP8) times ``scale`` (fp32,
    broadcastable to them), NaN codes a NaN (payloads aside, as torch's); or None where declined
    (the scale layouts :func:`scale_cast_fp8` declines)."""
    got = _cast_operands(bits.view(torch.uint8), scale, kind=-1)
    if got is None:
        return None
    _, q, s, shape, strides = got
    y = _output(lib, tuple(q.shape), torch.float32)
    outer = shape[0] * shape[1] * shape[2]
    if q.numel():
        lib.te_serial_dequant_fp8(q.data_ptr(), s.data_ptr(), y.data_ptr(), int(fp8_dtype == torch.float8_e5m2),
                                  shape[3], *shape[:3], *strides, _threads(outer, q.numel() * 5, 1))
    return y


@_kernel
def scale_cast_fp8_pair(lib: ctypes.CDLL, x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                        fp8_dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The FP8 codes of a 2-D x [M, K] times its 1×b blocks' scales [M, K/b] and times its b×1
    blocks' scales [M/b, K], from one read of x (both usages of MXFP8); or None where declined:
    another input dtype, scales of other shapes, dtypes or devices, a kind this build lacks, a
    block size it does not take."""
    kind = _IN_KINDS.get(x.dtype)
    m, k = x.shape
    if (kind is None or row_scale.shape != (m, k // b) or col_scale.shape != (m // b, k)
            or any(s.dtype != torch.float32 or s.device.type != "cpu" for s in (row_scale, col_scale))):
        return None
    x, rs, cs = x.contiguous(), row_scale.contiguous(), col_scale.contiguous()
    yr, yc = _output(lib, (m, k), torch.uint8), _output(lib, (m, k), torch.uint8)
    if x.numel() and lib.te_serial_scale_cast_fp8_pair(
            x.data_ptr(), rs.data_ptr(), cs.data_ptr(), yr.data_ptr(), yc.data_ptr(), kind,
            int(fp8_dtype == torch.float8_e5m2), m, k, b, _threads(m, x.numel() * x.element_size(), 1)):
        return None
    return yr.view(fp8_dtype), yc.view(fp8_dtype)


def fp4_packed_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """The shape of E2M1 codes of ``shape`` packed two per byte along ``dim`` (-1 or -2)."""
    return shape[:-1] + (shape[-1] // 2,) if dim == -1 else shape[:-2] + (shape[-2] // 2, shape[-1])


@_kernel
def scale_cast_fp4(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """E2M1 codes of ``fp32(x) * scale`` (round to nearest even, saturated at ±6, NaN +6), packed two
    per byte along ``dim`` (-1: neighbours in a row; -2: the same element of neighbouring rows),
    element 2i in the low nibble; or None where declined: rows not a whole number of 16-lane
    groups (so no trailing dim of 1 is dropped), the layouts :func:`scale_cast_fp8` declines."""
    if x.shape[-1] % 16:
        return None
    got = _cast_operands(x, scale)
    if got is None:
        return None
    kind, x, s, shape, strides = got
    y = _output(lib, fp4_packed_shape(tuple(x.shape), dim), torch.uint8)
    outer = shape[0] * shape[1] * shape[2]
    if x.numel():
        if lib.te_serial_scale_cast_fp4(x.data_ptr(), s.data_ptr(), y.data_ptr(), kind, shape[3], *shape[:3], *strides,
                                        int(dim == -2), _threads(outer // 2, x.numel() * x.element_size(), 1)):
            return None
    return y


def fp4_4over6_grid(shape: tuple[int, int], along: int, tile: bool) -> tuple[int, int]:
    """4over6's scale and choice grid of a [R, C] ``shape``: one per block of 16 along ``along``, or
    one per 16×16 tile."""
    r, c = shape
    return (r // 16, c // 16) if tile else (r, c // 16) if along == 1 else (r // 16, c)


@_kernel
def fp4_4over6(lib: ctypes.CDLL, x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
               sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool,
               alongs: tuple[int, ...], tile: bool) -> list[torch.Tensor] | None:
    """NVFP4 4over6's codes and choice per block of a 2-D x [R, C] in one pass, for the usages
    ``alongs`` (1 rows, 0 columns; both only with ``tile``): each one's (codes, choices) in turn,
    codes [R, C/16, 8] for rows and [C, R/2] for columns, choices shaped as the grids. Both
    candidates are cast and their errors summed as they are made, the decoded values looked up by
    code from a table per scale value. None where declined: another input dtype, C (or R, for
    columns and tiles) not a multiple of 16, an amax other than one, grids of another shape."""
    kind = _IN_KINDS.get(x.dtype)
    r, c = x.shape
    if (kind is None or c % 16 or ((0 in alongs or tile) and r % 16) or amax.numel() != 1 or denom.numel() != 1
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (enc4, sf4, enc6, sf6))):
        return None
    try:
        scales = [t.expand(fp4_4over6_grid((r, c), alongs[0], tile)).contiguous() for t in (enc4, sf4, enc6, sf6)]
    except RuntimeError:  # grids of another shape (the caller's rule says what is wrong)
        return None
    x = x.contiguous()
    out = {along: (_output(lib, (r, c // 2) if along == 1 else (c, r // 2), torch.uint8),
                   torch.empty(scales[0].shape, dtype=torch.uint8)) for along in alongs}
    common = (x.data_ptr(), kind, r, c, *(t.data_ptr() for t in scales))
    tail = (float(amax.item()), float(denom.item()), int(mse), _threads(r // 16, x.numel() * x.element_size(), 1))
    if x.numel():
        if tile:  # rows', then columns' codes and choices, NULL for a usage not asked
            ptrs = [out[along][i].data_ptr() if along in out else None for along in (1, 0) for i in (0, 1)]
            failed = lib.te_serial_fp4_4over6_tiles(*common, *ptrs, *tail)
        else:
            (along, (y, pick)), = out.items()
            failed = lib.te_serial_fp4_4over6(*common, y.data_ptr(), pick.data_ptr(), int(along == 0), *tail)
        if failed:
            return None
    return [t for along in alongs for t in (out[along][0].view(r, c // 16, 8) if along == 1 else out[along][0],
                                            out[along][1].view(torch.bool))]
