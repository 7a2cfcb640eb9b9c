"""Native kernels: a small C library built where a build is expected, with torch fallbacks.

* :func:`transpose_bytes` gives a 2-D array of 1-byte codes transposed, the same bytes: how the
  formats derive columnwise codes from codes computed in row order (``formats/``). torch's copy of a
  transposed uint8 view and inductor's transposed stores run far below ``memcpy`` speed; the C
  kernel runs near it (figures: docs/benchmarks.md).
* :func:`block_amax` takes the |x| maxima of a BF16 / FP16 array's 1×b and b×1 blocks and spots
  NaN in one read (|x| of a sign-magnitude float orders as its bits without the sign), where the
  compiled graphs and the NaN check read the input three times; :func:`amax` the tensor's, the same
  way (torch.aminmax took as long as a cast).
* :func:`scale_cast_fp8` is ``numerics.scale_and_cast_to_fp8`` (fp32 product, clamp, FP8 round to
  nearest even, by the FP8 definitions bit for bit), 16 lanes at a time, which the compiled graphs
  use for both FP8 types: torch's fp32 → FP8 conversion is scalar, and inside inductor's loop ran at
  a half (E4M3) or a quarter (E5M2) of a plain cast's speed. The eager path keeps torch's own
  conversion, so the fused table (fused against eager, byte for byte) holds this kernel to torch's
  roundings, and the oracle tests hold both to TE's. :func:`scale_cast_fp8_pair` makes MXFP8's two
  usages (1×32 and 32×1 block scales) from one read of the input.
* :func:`dequantize_fp8` is every FP8 format's dequantize step (codes widened 16 at a time, times
  the block's scale), where inductor converted fp8 → fp32 lane by lane.
* :func:`scale_cast_fp4` is NVFP4's data step by the same rule (E2M1 codes, packed two per byte as
  they are made), and :func:`scale_cast_fp4_4over6` is 4over6's choice in one pass: both candidates
  cast, their block errors summed in order, 2-D tiles' sums in the warp's tree order;
  :func:`scale_cast_fp4_4over6_pair` gives both usages of 16×16 tiles from one pass.
* Outputs of 4 MB and more ask for huge pages (:func:`_output`).

Why a C library built on the machine rather than a compiled wheel: te-serial stays one pure-Python
package, and the compiler it needs is the one inductor (``formats/fused.py``) already calls. So it is
built where a compiler is expected to run: on the first compiled quantize (inductor compiles there
anyway), or explicitly with ``te-serial build-kernels``. An eager path never starts a compiler: it
loads a library already built, else runs torch's own ops, silently. It is
built for the CPU it runs on (``-march=native``), with ``-ffp-contract=off`` and no fast-math, so
each product and sum rounds once, as torch's do, and with ``-fopenmp``: its kernels split their
rows among the OpenMP threads of torch's own runtime, as inductor's kernels do (a pool of its own
contended with the threads torch leaves spinning after each parallel region). Where the compiler
refuses a flag, the build drops it (the generic target, one thread); ``-Wall -Werror`` stay (OpenMP's
pragmas aside, which a build without OpenMP ignores, and the note that vector arguments change the
ABI, which holds for calls between files alone). The
shared object is cached per source, compiler, flags and CPU under :func:`cache_dir`; where a build
cannot be made or loaded (no compiler, a read-only home) one warning says why and torch's own ops
run. ``TE_SERIAL_NATIVE=0`` skips it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from importlib import resources
from pathlib import Path

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
_ABI_VERSION = 1
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
    already built is loaded, and the callers run torch's own ops, without a word."""
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


@torch.compiler.assume_constant_result  # a constant to a graph that asks (the loading is not traced)
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


def _on_cpu(native_fn, x: torch.Tensor, *args):
    """``native_fn(lib, x, *args)`` where x is on CPU and the library is built, else None; the
    custom ops below run their eager rule on None."""
    if x.device.type != "cpu":
        return None
    lib = _library()
    return None if lib is None else native_fn(lib, x, *args)


def _transpose_native(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    y = _output(lib, (cols, rows), x.dtype)
    if x.numel():
        lib.te_serial_transpose_u8(x.data_ptr(), y.data_ptr(), rows, cols, x.stride(0), rows,
                                   _threads(rows, x.numel(), _STRIPE))
    return y


@torch.library.custom_op("te_serial::transpose_bytes", mutates_args=())
def _transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    y = _on_cpu(_transpose_native, x if x.stride(1) == 1 else x.contiguous())
    return x.t().contiguous() if y is None else y


@_transpose_bytes.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of 1-byte elements (codes, FP8 or packed FP4 bytes),
    on CPU through the C kernel; an opaque op inside a compiled graph (inductor's own transposed
    stores are the slow path this replaces)."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"transpose_bytes needs a 2-D tensor of 1-byte elements, got {x.dtype} {tuple(x.shape)}")
    return _transpose_bytes(x)


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


def _fp8_type(e5m2: bool) -> torch.dtype:
    """The FP8 dtype the ops' ``e5m2`` flag names (custom ops take a bool, not a dtype)."""
    return torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn


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
    """(input kind, contiguous x, fp32 scale, shape, scale strides) as the C loops take them, or None
    where they do not (then torch's ops run). ``kind``: given for inputs other than the casts'."""
    kind = _IN_KINDS.get(x.dtype) if kind is None else kind
    if kind is None or x.device.type != "cpu":
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


def _scale_cast_native(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None,
                       fp8_dtype: torch.dtype) -> torch.Tensor | None:
    """The C cast, or None where it does not take the operands (then torch's ops run)."""
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
            return None  # a kind this build lacks (fp16 without _Float16)
    return y.view(fp8_dtype)


@torch.library.custom_op("te_serial::scale_cast_fp8", mutates_args=())
def _scale_cast_fp8(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool) -> torch.Tensor:
    fp8_dtype = _fp8_type(e5m2)
    y = _on_cpu(_scale_cast_native, x, scale, fp8_dtype)
    if y is not None:
        return y
    from .. import numerics  # the eager rule itself (numerics imports this module)
    return numerics.scale_and_cast_to_fp8(x, scale, fp8_dtype).view(fp8_dtype)


@_scale_cast_fp8.register_fake
def _(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool) -> torch.Tensor:
    return torch.empty_like(x, dtype=_fp8_type(e5m2),
                            memory_format=torch.contiguous_format)


def scale_cast_fp8(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 (``fp8_dtype``) of ``fp32(x) * scale`` clamped to the type's range (``scale`` fp32,
    broadcastable to x; None: 1): on CPU through the C loop, else torch's ops; an opaque op inside a
    compiled graph. NaN gives 0x7F. Where the C loop does not take the operands (more than four dims
    left after merging, a scale varying along x's last dim other than element by element) the eager
    rule runs."""
    return _scale_cast_fp8(x, scale, fp8_dtype == torch.float8_e5m2)


def _scale_cast_t_native(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                         rows: int, width: int, keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C cast with its codes also transposed, or None where it does not take the operands."""
    got = _cast_operands(x, scale)
    if got is None:
        return None
    kind, x, s, shape, strides = got
    y = _output(lib, tuple(x.shape) if keep_rows else (0,), torch.uint8)
    yt = _output(lib, (width, rows), torch.uint8)
    if x.numel():
        y_ptr = y.data_ptr() if keep_rows else None
        if lib.te_serial_scale_cast_fp8_t(x.data_ptr(), s.data_ptr(), y_ptr, yt.data_ptr(), kind,
                                          int(fp8_dtype == torch.float8_e5m2), shape[3], *shape[1:3], *strides,
                                          rows, width, _threads(rows, x.numel() * x.element_size(), _STRIPE)):
            return None  # a kind this build lacks, rows that are not whole blocks of the layout
    return y.view(fp8_dtype), yt.view(fp8_dtype)


@torch.library.custom_op("te_serial::scale_cast_fp8_transposed", mutates_args=())
def _scale_cast_fp8_transposed(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool, rows: int, width: int,
                               keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    got = _on_cpu(_scale_cast_t_native, x, scale, fp8_dtype, rows, width, keep_rows) if x.numel() else None
    if got is not None:
        return got
    from .. import numerics  # the eager rule itself (numerics imports this module)
    codes = numerics.scale_and_cast_to_fp8(x, scale, fp8_dtype).view(fp8_dtype)
    return (codes if keep_rows else codes.new_empty((0,))), transpose_bytes(codes.reshape(rows, width))


@_scale_cast_fp8_transposed.register_fake
def _(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool, rows: int, width: int,
      keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    codes = torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format) if keep_rows \
        else x.new_empty((0,), dtype=fp8_dtype)
    return codes, x.new_empty((width, rows), dtype=fp8_dtype)


def scale_cast_fp8_transposed(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                              shape: tuple[int, int],
                              keep_rows: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`scale_cast_fp8`'s codes and their transpose as a row-major 2-D ``shape`` [M, K] array,
    [K, M], from one pass (64 rows at a time, transposed while in cache); without ``keep_rows`` only
    the transpose (the first item None). An opaque op inside a compiled graph."""
    rows, width = shape
    if rows * width != x.numel():
        raise ValueError(f"scale_cast_fp8_transposed: a {rows}x{width} array is not shape {tuple(x.shape)}")
    codes, transposed = _scale_cast_fp8_transposed(x, scale, fp8_dtype == torch.float8_e5m2, rows, width, keep_rows)
    return (codes if keep_rows else None), transposed


def _dequantize_native(lib: ctypes.CDLL, bits: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor | None:
    """The C dequantize, or None where it does not take the operands (then torch's ops run)."""
    got = _cast_operands(bits.view(torch.uint8), scale, kind=-1)
    if got is None:
        return None
    _, q, s, shape, strides = got
    y = _output(lib, tuple(q.shape), torch.float32)
    outer = shape[0] * shape[1] * shape[2]
    if q.numel():
        lib.te_serial_dequant_fp8(q.data_ptr(), s.data_ptr(), y.data_ptr(), int(e5m2), shape[3], *shape[:3], *strides,
                                  _threads(outer, q.numel() * 5, 1))
    return y


@torch.library.custom_op("te_serial::dequantize_fp8", mutates_args=())
def _dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor:
    y = _on_cpu(_dequantize_native, bits, scale, e5m2)
    if y is not None:
        return y
    from .. import numerics  # the eager rule itself (numerics imports this module)
    return numerics.dequantize_fp8(bits, scale, _fp8_type(e5m2))


@_dequantize_fp8.register_fake
def _(bits: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor:
    return torch.empty_like(bits, dtype=torch.float32, memory_format=torch.contiguous_format)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``numerics.dequantize_fp8``: fp32 of the FP8 codes ``bits`` (uint8 or FP8) times ``scale`` (fp32,
    broadcastable to them), on CPU through a C loop of 16 lanes; an opaque op inside a compiled graph
    (inductor's fp8 → fp32 conversion ran lane by lane). NaN codes give a NaN (payloads aside, as
    torch's). Where the C loop does not take the operands the eager rule runs."""
    return _dequantize_fp8(bits, scale, fp8_dtype == torch.float8_e5m2)


def _scale_cast_pair_native(lib: ctypes.CDLL, x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                            fp8_dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The paired C cast, or None where it does not take the operands."""
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
        return None  # a kind this build lacks, a block size it does not take
    return yr.view(fp8_dtype), yc.view(fp8_dtype)


@torch.library.custom_op("te_serial::scale_cast_fp8_pair", mutates_args=())
def _scale_cast_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, e5m2: bool,
                         b: int) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    got = _on_cpu(_scale_cast_pair_native, x, row_scale, col_scale, fp8_dtype, b)
    if got is not None:
        return got
    from .. import numerics  # the eager rule itself (numerics imports this module)
    return numerics.scale_and_cast_to_fp8_pair(x, row_scale, col_scale, fp8_dtype, b)


@_scale_cast_fp8_pair.register_fake
def _(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, e5m2: bool,
      b: int) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    return (torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format))


def scale_cast_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype,
                        b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.scale_and_cast_to_fp8_pair``: the codes of x [M, K] times its 1×b blocks' scales
    ([M, K/b]) and times its b×1 blocks' scales ([M/b, K]) from one read of x (both usages of
    MXFP8), on CPU through a C loop; an opaque op inside a compiled graph."""
    m, k = x.shape
    if b <= 0 or m % b or k % b:
        raise ValueError(f"scale_cast_fp8_pair: blocks of {b} do not divide shape {tuple(x.shape)}")
    return _scale_cast_fp8_pair(x, row_scale, col_scale, fp8_dtype == torch.float8_e5m2, b)


def _fp4_packed_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:-1] + (shape[-1] // 2,) if dim == -1 else shape[:-2] + (shape[-2] // 2, shape[-1])


def _scale_cast_fp4_native(lib: ctypes.CDLL, x: torch.Tensor, scale: torch.Tensor | None,
                           dim: int) -> torch.Tensor | None:
    """The C E2M1 cast, or None where it does not take the operands (then torch's ops run)."""
    if x.shape[-1] % 16:
        return None  # rows of whole 16-lane groups (so no trailing dim of 1 is dropped)
    got = _cast_operands(x, scale)
    if got is None:
        return None
    kind, x, s, shape, strides = got
    y = _output(lib, _fp4_packed_shape(tuple(x.shape), dim), torch.uint8)
    outer = shape[0] * shape[1] * shape[2]
    if x.numel():
        if lib.te_serial_scale_cast_fp4(x.data_ptr(), s.data_ptr(), y.data_ptr(), kind, shape[3], *shape[:3], *strides,
                                        int(dim == -2), _threads(outer // 2, x.numel() * x.element_size(), 1)):
            return None
    return y


@torch.library.custom_op("te_serial::scale_cast_fp4", mutates_args=())
def _scale_cast_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    y = _on_cpu(_scale_cast_fp4_native, x, scale, dim)
    if y is not None:
        return y
    from .. import numerics  # the eager rule itself (numerics imports this module)
    return numerics.scale_and_cast_to_fp4(x, scale, dim)


@_scale_cast_fp4.register_fake
def _(x: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    return x.new_empty(_fp4_packed_shape(tuple(x.shape), dim), dtype=torch.uint8)


def scale_cast_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """E2M1 codes of ``fp32(x) * scale`` (round to nearest even, saturated at ±6, NaN +6), packed two
    per byte along ``dim`` (-1: neighbours in a row; -2: the same element of neighbouring rows),
    element 2i in the low nibble: ``numerics.scale_and_cast_to_fp4``, on CPU through the C loop; an
    opaque op inside a compiled graph. Where the C loop does not take the operands the eager rule runs."""
    if dim not in (-1, -2) or x.dim() < -dim or x.shape[dim] % 2:
        raise ValueError(f"scale_cast_fp4 packs pairs along dim -1 or -2 of even size, got dim {dim} of "
                         f"shape {tuple(x.shape)}")
    return _scale_cast_fp4(x, scale, dim)


def _grid_shape(shape: tuple[int, ...], along: int, tile: bool) -> tuple[int, int]:
    """4over6's scale and choice grid: one per block of 16 along ``along``, or one per 16×16 tile."""
    r, c = shape
    return (r // 16, c // 16) if tile else (r, c // 16) if along == 1 else (r // 16, c)


def _fp4_4over6_native(lib: ctypes.CDLL, x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                       sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool,
                       alongs: tuple[int, ...], tile: bool) -> list[torch.Tensor] | None:
    """The one-pass C loop of 4over6 for the usages ``alongs`` (1 rows, 0 columns; both only with
    ``tile``): each one's (codes, choices) in turn, or None where it does not take the operands."""
    kind = _IN_KINDS.get(x.dtype)
    r, c = x.shape
    if (kind is None or c % 16 or ((0 in alongs or tile) and r % 16) or amax.numel() != 1 or denom.numel() != 1
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (enc4, sf4, enc6, sf6))):
        return None  # one amax (a per-row one runs torch's rule)
    try:
        scales = [t.expand(_grid_shape((r, c), alongs[0], tile)).contiguous() for t in (enc4, sf4, enc6, sf6)]
    except RuntimeError:  # grids of another shape: the eager rule says what is wrong
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


def _fp4_4over6_fake(x: torch.Tensor, along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = x.shape
    packed = x.new_empty((r, c // 16, 8) if along == 1 else (c, r // 2), dtype=torch.uint8)
    return packed, x.new_empty(_grid_shape((r, c), along, tile), dtype=torch.bool)


def _check_4over6(x: torch.Tensor, along: int, tile: bool) -> None:
    if x.dim() != 2 or along not in (0, 1) or x.shape[along] % 16 or (tile and x.shape[1 - along] % 16):
        raise ValueError(f"scale_cast_fp4_4over6 takes a 2-D x in blocks of 16 along dim {along} (tiles: both "
                         f"dims), got shape {tuple(x.shape)}")


@torch.library.custom_op("te_serial::scale_cast_fp4_4over6", mutates_args=())
def _scale_cast_fp4_4over6(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                           sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int,
                           tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    got = _on_cpu(_fp4_4over6_native, x, enc4, sf4, enc6, sf6, amax, denom, mse, (along,), tile)
    if got is not None:
        return tuple(got)
    from .. import numerics  # the eager rule itself (numerics imports this module)
    return numerics.scale_and_cast_to_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)


@_scale_cast_fp4_4over6.register_fake
def _(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor, sf6: torch.Tensor,
      amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp4_4over6_fake(x, along, tile)


def scale_cast_fp4_4over6(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                          sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int,
                          tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.scale_and_cast_to_fp4_4over6`` (NVFP4 4over6's codes and choice per block) in one
    pass over x [R, C] on CPU: both candidates cast and their errors summed as they are made, the
    decoded values looked up by code from a table per scale value; an opaque op inside a compiled
    graph. Where the C loop does not take the operands the eager rule runs."""
    _check_4over6(x, along, tile)
    return _scale_cast_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)


@torch.library.custom_op("te_serial::scale_cast_fp4_4over6_pair", mutates_args=())
def _scale_cast_fp4_4over6_pair(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                                sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor,
                                mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    got = _on_cpu(_fp4_4over6_native, x, enc4, sf4, enc6, sf6, amax, denom, mse, (1, 0), True)
    if got is not None:
        return tuple(got)
    from .. import numerics
    return numerics.scale_and_cast_to_fp4_4over6_pair(x, enc4, sf4, enc6, sf6, amax, denom, mse)


@_scale_cast_fp4_4over6_pair.register_fake
def _(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor, sf6: torch.Tensor,
      amax: torch.Tensor, denom: torch.Tensor,
      mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (*_fp4_4over6_fake(x, 1, True), *_fp4_4over6_fake(x, 0, True))


def scale_cast_fp4_4over6_pair(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                               sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor,
                               mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``numerics.scale_and_cast_to_fp4_4over6_pair`` (both usages of 16×16 tiles) in one pass on
    CPU: a tile's candidates are the same in either usage, so each element is cast and its errors
    taken once for both; an opaque op inside a compiled graph. Where the C loop does not take the
    operands the eager rule runs."""
    _check_4over6(x, 1, True)
    return _scale_cast_fp4_4over6_pair(x, enc4, sf4, enc6, sf6, amax, denom, mse)
