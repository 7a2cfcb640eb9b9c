"""The C kernels as torch custom ops: each op's body runs its ``native`` kernel, else, where the kernel
declines (the library not built, operands it does not take, a nonzero C return code), the eager rule
(``cast_rules``), the same bytes either way. Inside a compiled graph each op is opaque: inductor
calls it rather than generating its loop (inductor's transposed stores and fp32 ↔ FP8 conversions
are the slow paths these replace; figures: docs/benchmarks.md).

:func:`c_loop_in_graph` is the one choice of C loop or torch's ops for ``numerics``' casts: a graph
traced on CPU with the library built calls these ops; eager code and every other graph run the
rules. :func:`transpose_bytes` runs its kernel wherever it can, eager too (the formats' columnwise
codes, and the rules below that end in a transpose).
"""

from __future__ import annotations

import torch

from . import cast_rules, native
from .tracing import tracing


def c_loop_in_graph(x: torch.Tensor) -> bool:
    """Whether a cast of ``x`` is one of the ops below: while a graph is traced, on CPU, with the
    library built (built here where no build is cached: a graph's first trace is where a build is
    expected). Elsewhere, and eager, the rule runs (torch's conversions, which the fused table holds
    the C loops to)."""
    return tracing() and x.device.type == "cpu" and native.available()


def _fp8_type(e5m2: bool) -> torch.dtype:
    """The FP8 dtype the ops' ``e5m2`` flag names (custom ops take a bool, not a dtype)."""
    return torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn


# --- the byte transpose --------------------------------------------------------------------------

@torch.library.custom_op("te_serial::transpose_bytes", mutates_args=())
def _transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    y = native.transpose_bytes(x)
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


def byte_histogram(x: torch.Tensor) -> torch.Tensor:
    """int64 counts of each byte value 0..255 in a tensor of 1-byte elements (eager only): the C
    kernel on CPU, else torch's bincount of a widened copy (a uint8 bincount runs ~100x slower)."""
    flat = x.reshape(-1).view(torch.uint8).contiguous()
    counts = native.byte_histogram(flat)
    return counts if counts is not None else torch.bincount(flat.int(), minlength=256)


def map_byte_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each byte of uint8 ``x`` as the two bytes ``table[byte]`` (``table``: uint8 [256, 2]), so the last
    dim doubles (eager only; packed FP4 codes to the E4M3 bytes of the same values): the C kernel on
    CPU, else torch's gather through int32 indices (a widened copy)."""
    pairs = table.contiguous().view(torch.int16).reshape(256)
    flat = x.contiguous()
    y = native.map_bytes_u16(flat, pairs)
    if y is None:
        y = torch.index_select(pairs, 0, flat.reshape(-1).int()).view(torch.uint8)
    return y.reshape(*x.shape[:-1], 2 * x.shape[-1])


# --- FP8 -----------------------------------------------------------------------------------------

@torch.library.custom_op("te_serial::scale_cast_fp8", mutates_args=())
def _scale_cast_fp8(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool) -> torch.Tensor:
    fp8_dtype = _fp8_type(e5m2)
    y = native.scale_cast_fp8(x, scale, fp8_dtype)
    return cast_rules.scale_and_cast_to_fp8(x, scale, fp8_dtype).view(fp8_dtype) if y is None else y


@_scale_cast_fp8.register_fake
def _(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool) -> torch.Tensor:
    return torch.empty_like(x, dtype=_fp8_type(e5m2), memory_format=torch.contiguous_format)


def scale_cast_fp8(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 (``fp8_dtype``) of ``fp32(x) * scale`` clamped to the type's range (``scale`` fp32,
    broadcastable to x; None: 1), NaN 0x7F: ``cast_rules.scale_and_cast_to_fp8``, 16 lanes at a time
    through ``native.scale_cast_fp8`` where it takes the operands; an opaque op inside a compiled
    graph."""
    return _scale_cast_fp8(x, scale, fp8_dtype == torch.float8_e5m2)


def scale_cast_fp8_transposed_rule(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                                   shape: tuple[int, int], keep_rows: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The eager rule of :func:`scale_cast_fp8_transposed`: ``cast_rules.scale_and_cast_to_fp8``'s
    codes (None without ``keep_rows``), then :func:`transpose_bytes` of them as the row-major 2-D
    ``shape``."""
    codes = cast_rules.scale_and_cast_to_fp8(x, scale, fp8_dtype)
    return (codes if keep_rows else None), transpose_bytes(codes.reshape(shape))


@torch.library.custom_op("te_serial::scale_cast_fp8_transposed", mutates_args=())
def _scale_cast_fp8_transposed(x: torch.Tensor, scale: torch.Tensor | None, e5m2: bool, rows: int, width: int,
                               keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    got = native.scale_cast_fp8_transposed(x, scale, fp8_dtype, rows, width, keep_rows)
    if got is not None:
        return got
    codes, transposed = scale_cast_fp8_transposed_rule(x, scale, fp8_dtype, (rows, width), keep_rows)
    codes = x.new_empty((0,), dtype=torch.uint8) if codes is None else codes  # an op returns tensors
    return codes.view(fp8_dtype), transposed.view(fp8_dtype)


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
    [K, M], from one pass (``native.scale_cast_fp8_transposed``); without ``keep_rows`` only the
    transpose (the first item None). An opaque op inside a compiled graph."""
    rows, width = shape
    if rows * width != x.numel():
        raise ValueError(f"scale_cast_fp8_transposed: a {rows}x{width} array is not shape {tuple(x.shape)}")
    codes, transposed = _scale_cast_fp8_transposed(x, scale, fp8_dtype == torch.float8_e5m2, rows, width, keep_rows)
    return (codes if keep_rows else None), transposed


@torch.library.custom_op("te_serial::dequantize_fp8", mutates_args=())
def _dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor:
    fp8_dtype = _fp8_type(e5m2)
    y = native.dequantize_fp8(bits, scale, fp8_dtype)
    return cast_rules.dequantize_fp8(bits, scale, fp8_dtype) if y is None else y


@_dequantize_fp8.register_fake
def _(bits: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor:
    return torch.empty_like(bits, dtype=torch.float32, memory_format=torch.contiguous_format)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``cast_rules.dequantize_fp8``: fp32 of the FP8 codes ``bits`` (uint8 or FP8) times ``scale``
    (fp32, broadcastable to them), through a C loop of 16 lanes where it takes the operands; an
    opaque op inside a compiled graph (inductor's fp8 → fp32 conversion ran lane by lane)."""
    return _dequantize_fp8(bits, scale, fp8_dtype == torch.float8_e5m2)


@torch.library.custom_op("te_serial::scale_cast_fp8_pair", mutates_args=())
def _scale_cast_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, e5m2: bool,
                         b: int) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    got = native.scale_cast_fp8_pair(x, row_scale, col_scale, fp8_dtype, b)
    return cast_rules.scale_and_cast_to_fp8_pair(x, row_scale, col_scale, fp8_dtype, b) if got is None else got


@_scale_cast_fp8_pair.register_fake
def _(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, e5m2: bool,
      b: int) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = _fp8_type(e5m2)
    return (torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format))


def scale_cast_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype,
                        b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cast_rules.scale_and_cast_to_fp8_pair``: the codes of x [M, K] times its 1×b blocks' scales
    ([M, K/b]) and times its b×1 blocks' scales ([M/b, K]), from one read of x (both usages of
    MXFP8) where the C loop takes the operands; an opaque op inside a compiled graph."""
    m, k = x.shape
    if b <= 0 or m % b or k % b:
        raise ValueError(f"scale_cast_fp8_pair: blocks of {b} do not divide shape {tuple(x.shape)}")
    return _scale_cast_fp8_pair(x, row_scale, col_scale, fp8_dtype == torch.float8_e5m2, b)


# --- FP4 (E2M1) ----------------------------------------------------------------------------------

@torch.library.custom_op("te_serial::scale_cast_fp4", mutates_args=())
def _scale_cast_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    y = native.scale_cast_fp4(x, scale, dim)
    return cast_rules.scale_and_cast_to_fp4(x, scale, dim) if y is None else y


@_scale_cast_fp4.register_fake
def _(x: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    return x.new_empty(native.fp4_packed_shape(tuple(x.shape), dim), dtype=torch.uint8)


def scale_cast_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """E2M1 codes of ``fp32(x) * scale`` (round to nearest even, saturated at ±6, NaN +6), packed two
    per byte along ``dim`` (-1: neighbours in a row; -2: the same element of neighbouring rows),
    element 2i in the low nibble: ``cast_rules.scale_and_cast_to_fp4``, through the C loop where it
    takes the operands; an opaque op inside a compiled graph."""
    if dim not in (-1, -2) or x.dim() < -dim or x.shape[dim] % 2:
        raise ValueError(f"scale_cast_fp4 packs pairs along dim -1 or -2 of even size, got dim {dim} of "
                         f"shape {tuple(x.shape)}")
    return _scale_cast_fp4(x, scale, dim)


def scale_cast_fp4_4over6_rule(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                               sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int,
                               tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager rule of :func:`scale_cast_fp4_4over6`: ``cast_rules.scale_and_cast_to_fp4_4over6``,
    a column usage's codes then transposed by :func:`transpose_bytes` ([C, R/2], as the usage keeps
    them)."""
    data, pick = cast_rules.scale_and_cast_to_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)
    return (data if along == 1 else transpose_bytes(data)), pick


def _fp4_4over6_fake(x: torch.Tensor, along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = x.shape
    packed = x.new_empty((r, c // 16, 8) if along == 1 else (c, r // 2), dtype=torch.uint8)
    return packed, x.new_empty(native.fp4_4over6_grid((r, c), along, tile), dtype=torch.bool)


def _check_4over6(x: torch.Tensor, along: int, tile: bool) -> None:
    if x.dim() != 2 or along not in (0, 1) or x.shape[along] % 16 or (tile and x.shape[1 - along] % 16):
        raise ValueError(f"scale_cast_fp4_4over6 takes a 2-D x in blocks of 16 along dim {along} (tiles: both "
                         f"dims), got shape {tuple(x.shape)}")


@torch.library.custom_op("te_serial::scale_cast_fp4_4over6", mutates_args=())
def _scale_cast_fp4_4over6(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                           sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int,
                           tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    got = native.fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, (along,), tile)
    if got is not None:
        return tuple(got)
    return scale_cast_fp4_4over6_rule(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)


@_scale_cast_fp4_4over6.register_fake
def _(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor, sf6: torch.Tensor,
      amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp4_4over6_fake(x, along, tile)


def scale_cast_fp4_4over6(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                          sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool, along: int,
                          tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 4over6's codes and choice per block (:func:`scale_cast_fp4_4over6_rule`) in one pass
    over x [R, C] where the C loop takes the operands (``native.fp4_4over6``); an opaque op inside a
    compiled graph."""
    _check_4over6(x, along, tile)
    return _scale_cast_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)


@torch.library.custom_op("te_serial::scale_cast_fp4_4over6_pair", mutates_args=())
def _scale_cast_fp4_4over6_pair(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                                sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor,
                                mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    got = native.fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, (1, 0), True)
    if got is not None:
        return tuple(got)
    return (*scale_cast_fp4_4over6_rule(x, enc4, sf4, enc6, sf6, amax, denom, mse, 1, True),
            *scale_cast_fp4_4over6_rule(x, enc4, sf4, enc6, sf6, amax, denom, mse, 0, True))


@_scale_cast_fp4_4over6_pair.register_fake
def _(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor, sf6: torch.Tensor,
      amax: torch.Tensor, denom: torch.Tensor,
      mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (*_fp4_4over6_fake(x, 1, True), *_fp4_4over6_fake(x, 0, True))


def scale_cast_fp4_4over6_pair(x: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                               sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor,
                               mse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both usages of :func:`scale_cast_fp4_4over6` with 16×16 tiles (rowwise codes, choices,
    columnwise codes, choices) in one pass on CPU where the C loop takes the operands: a tile's
    candidates are the same in either usage, so each element is cast and its errors taken once for
    both; an opaque op inside a compiled graph."""
    _check_4over6(x, 1, True)
    return _scale_cast_fp4_4over6_pair(x, enc4, sf4, enc6, sf6, amax, denom, mse)
