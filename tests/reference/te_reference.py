"""Independent test oracle for Transformer Engine (TE) quantization numerics and buffer layouts.

Written from TE's CUDA kernels (commit d0067d0da6cb, 2.20.0.dev0), not from te_serial, and
deliberately using a different technique: no ``tensor.to(torch.float8_*)`` anywhere.  FP8 / FP4
encoding is done with a sorted table of the format's representable magnitudes, ``searchsorted``,
exact float64 midpoints and an explicit ties-to-even rule; E8M0 and power-of-two scale handling is
done on the integer bits of float32 values.  Slow but simple; meant for tensors up to ~300x300.

Every ``ref_*`` quantize function takes ``x`` of any floating dtype and any shape with at least one
element (N-D inputs flatten to M = prod(shape[:-1]), K = shape[-1]) and returns a dict whose keys
are exactly TE's inner buffer attribute names, with TE's shapes and dtypes (uint8 raw bits for
FP8 / E8M0 / E4M3 / packed FP4; float32 for fp32 scales and amaxes).  Only the buffers of the
requested usages are present.  Scale padding is zero.

Kernel facts this follows (paths relative to transformer_engine/common):
- amax reductions use fmaxf / __hmax / max.xorsign.abs (non-NaN-propagating), starting from 0,
  so NaN elements are ignored (amax = max|x| over non-NaN elements, 0 if all NaN); inf gives inf.
- FP32 -> FP8 is ``cvt.rn.satfinite``: RNE, |x| > max -> max (incl. inf), NaN -> 0x7F
  (cuda_fp8.hpp canonicalizes NaN to 0x7FFFFFFF first, so the NaN byte is 0x7F for both dtypes).
  Tiny negatives / -0.0 keep their sign (0x80).
- FP32 -> FP4 E2M1 is ``cvt.rn.satfinite.e2m1x2.f32``: RNE, saturate at +-6, NaN -> +6 (0x7).
- The value multiplied before every cast is ``fp32(x) * scale`` in fp32 round-to-nearest.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FP4_MAX",
    "FLT_MAX",
    "BF16_MAX",
    "FP16_MAX",
    "fp8_max",
    "fp8_encode",
    "fp8_decode",
    "fp8_representable_values",
    "fp4_encode",
    "fp4_decode",
    "fp4_pack",
    "fp4_unpack",
    "e8m0_from_amax",
    "e8m0_to_scale",
    "e8m0_to_scale_inv",
    "bf16_round",
    "amax_ignore_nan",
    "compute_scale_from_amax",
    "nvfp4_global_encode_scale",
    "rht_matrix",
    "apply_rht_bf16",
    "inverse_rht",
    "ref_float8_current",
    "ref_float8_delayed",
    "ref_mxfp8",
    "ref_blockwise",
    "ref_nvfp4",
    "ref_dequantize",
    "ref_nvfp4_variant",
    "ref_dequantize_nvfp4_variant",
]

# ------------------------------------------------------------------------------------------------
# Constants
# ------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP4_MAX = 6.0
FLT_MAX = float(torch.finfo(torch.float32).max)  # 0x1.fffffep127
BF16_MAX = float.fromhex("0x1.FEp127")  # TypeExtrema<bf16>::max in common.h
FP16_MAX = float.fromhex("0x1.FFCp15")  # TypeExtrema<fp16>::max = 65504

_F32 = torch.float32


def _f32(v: float) -> torch.Tensor:
    """A float32 scalar tensor holding fp32(v) (round-to-nearest from the Python double)."""
    return torch.tensor(v, dtype=_F32)


# Format descriptions: exponent bits, mantissa bits, bias, largest finite code (positive half).
_FP8_FORMATS = {
    "e4m3": dict(ebits=4, mbits=3, bias=7, max_code=0x7E, max=E4M3_MAX),
    "e5m2": dict(ebits=5, mbits=2, bias=15, max_code=0x7B, max=E5M2_MAX),
}
_FP8_NAN_CODE = 0x7F  # what the satfinite cvt writes for NaN, for both formats


def _fmt(fp8_dtype) -> str:
    """Normalize an FP8 dtype designator to 'e4m3' or 'e5m2'."""
    if fp8_dtype is getattr(torch, "float8_e4m3fn", object()):
        return "e4m3"
    if fp8_dtype is getattr(torch, "float8_e5m2", object()):
        return "e5m2"
    if isinstance(fp8_dtype, str):
        s = fp8_dtype.lower().replace("float8_", "").replace("kfloat8", "")
        if s.startswith("e4m3"):
            return "e4m3"
        if s.startswith("e5m2"):
            return "e5m2"
    if isinstance(fp8_dtype, int) and not isinstance(fp8_dtype, bool):
        # TE DType enum values: kFloat8E4M3 = 7, kFloat8E5M2 = 8
        if fp8_dtype == 7:
            return "e4m3"
        if fp8_dtype == 8:
            return "e5m2"
    name = getattr(fp8_dtype, "name", None)
    if isinstance(name, str):
        return _fmt(name)
    raise ValueError(f"unsupported FP8 dtype designator: {fp8_dtype!r}")


def fp8_max(fp8_dtype) -> float:
    """Largest finite magnitude of the FP8 format (448 or 57344)."""
    return _FP8_FORMATS[_fmt(fp8_dtype)]["max"]


# ------------------------------------------------------------------------------------------------
# FP8 decode / encode
# ------------------------------------------------------------------------------------------------


def _decode_byte_python(code: int, fmt: str) -> float:
    """Value of one FP8 byte, computed from the bit fields in plain Python."""
    f = _FP8_FORMATS[fmt]
    ebits, mbits, bias = f["ebits"], f["mbits"], f["bias"]
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    emax_field = (1 << ebits) - 1
    if fmt == "e4m3":
        if e == emax_field and m == (1 << mbits) - 1:
            return math.nan
    else:  # e5m2 is IEEE-like
        if e == emax_field:
            return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mbits)
    return sign * math.ldexp((1 << mbits) + m, e - bias - mbits)


_DECODE_TABLES: Dict[str, torch.Tensor] = {}
_GRIDS: Dict[str, torch.Tensor] = {}


def _decode_table(fmt: str) -> torch.Tensor:
    if fmt not in _DECODE_TABLES:
        _DECODE_TABLES[fmt] = torch.tensor(
            [_decode_byte_python(c, fmt) for c in range(256)], dtype=torch.float64
        )
    return _DECODE_TABLES[fmt]


def fp8_representable_values(fp8_dtype) -> torch.Tensor:
    """float64 tensor of the non-negative finite magnitudes, indexed by code 0..max_code."""
    fmt = _fmt(fp8_dtype)
    if fmt not in _GRIDS:
        grid = _decode_table(fmt)[: _FP8_FORMATS[fmt]["max_code"] + 1].clone()
        assert bool((grid[1:] > grid[:-1]).all()), "grid must be strictly increasing"
        _GRIDS[fmt] = grid
    return _GRIDS[fmt]


def fp8_decode(u8: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Raw FP8 bytes (uint8) -> float32 values (NaN codes -> NaN, E5M2 inf codes -> inf)."""
    fmt = _fmt(fp8_dtype)
    if u8.dtype != torch.uint8:
        raise TypeError(f"fp8_decode expects uint8 raw bits, got {u8.dtype}")
    return _decode_table(fmt)[u8.long()].to(_F32)


def _rne_onto_grid(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Round non-negative float64 magnitudes onto a sorted grid (index == code), RNE, saturating.

    ``a`` must hold no NaN.  Returns int64 codes in [0, len(grid) - 1].  Ties go to the even code;
    for IEEE-style formats an even code is an even mantissa.  Everything above the top grid point
    (including +inf) saturates to the top code, which is what ``.satfinite`` does.
    """
    top = grid.numel() - 1
    hi = torch.searchsorted(grid, a, right=False).clamp(max=top)  # first grid point >= a
    lo = (hi - 1).clamp(min=0)
    g_lo = grid[lo]
    g_hi = grid[hi]
    mid = (g_lo + g_hi) * 0.5  # exact in float64: grid points have very few significant bits
    pick_hi = a > mid
    tie = a == mid
    even_of_pair = torch.where(hi % 2 == 0, hi, lo)
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(tie & (hi != lo), even_of_pair, code)
    code = torch.where(a >= g_hi, hi, code)  # exact hits (and a == 0 -> code 0)
    code = torch.where(a > grid[top], torch.full_like(code, top), code)  # saturation
    return code


def fp8_encode(x_fp32: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """float32 values -> FP8 bytes (uint8): round-to-nearest-even with saturation to +-max.

    inf -> +-max, NaN -> 0x7F, sign kept for zeros and underflows (-0.0 -> 0x80).
    Inputs of other float dtypes are first rounded to float32.
    """
    fmt = _fmt(fp8_dtype)
    x = x_fp32.to(_F32)
    grid = fp8_representable_values(fmt)
    nan = torch.isnan(x)
    a = torch.where(nan, torch.zeros_like(x), x.abs()).to(torch.float64)
    code = _rne_onto_grid(a, grid)
    code = code | torch.where(torch.signbit(x), 0x80, 0)
    code = torch.where(nan, torch.full_like(code, _FP8_NAN_CODE), code)
    return code.to(torch.uint8)


# ------------------------------------------------------------------------------------------------
# FP4 (E2M1)
# ------------------------------------------------------------------------------------------------

_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_FP4_MAX_CODE = 0x7


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 values -> E2M1 codes, one per uint8 (unpacked, values 0..15).

    RNE with saturation at +-6 (cvt.rn.satfinite.e2m1x2.f32); NaN -> +6 (code 0x7, per
    cuda_fp4.hpp "NaN converts to positive FP4_MAXNORM"); sign bit 0x8 kept for -0.0/underflows.
    """
    x = x.to(_F32)
    nan = torch.isnan(x)
    a = torch.where(nan, torch.zeros_like(x), x.abs()).to(torch.float64)
    code = _rne_onto_grid(a, _FP4_GRID)
    code = code | torch.where(torch.signbit(x), 0x8, 0)
    code = torch.where(nan, torch.full_like(code, _FP4_MAX_CODE), code)
    return code.to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, unpacked) -> float32."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"fp4_decode expects uint8 codes, got {codes.dtype}")
    c = codes.long()
    mag = _FP4_GRID[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag).to(_F32)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes along the last dim: element 2i -> low nibble, 2i+1 -> high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError("last dim must be even to pack FP4")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of fp4_pack: (..., n) bytes -> (..., 2n) codes."""
    p = packed.to(torch.uint8)
    out = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# ------------------------------------------------------------------------------------------------
# E8M0 (MXFP8 block scales)
# ------------------------------------------------------------------------------------------------


def e8m0_from_amax(amax_fp32: torch.Tensor, fp8_max_value: float) -> torch.Tensor:
    """TE's ``float_to_e8m0(amax * fp32(1/fp8_max))`` (util/ptx_arch_spec.cuh, non-Blackwell branch).

    v = amax * fp32(1.0/fp8_max) in fp32; NaN -> 0xFF; inf -> 0xFE; 0 -> 0; else the biased
    exponent of v, plus one if the mantissa is nonzero, except at exponent 0xFE (satfinite) and
    except for subnormals v <= 2^-127 (exponent 0, mantissa <= 0x400000), which stay 0.
    """
    if isinstance(fp8_max_value, str) or not isinstance(fp8_max_value, (int, float)):
        fp8_max_value = fp8_max(fp8_max_value)
    amax = torch.as_tensor(amax_fp32).to(_F32)
    v = amax * _f32(1.0 / float(fp8_max_value))  # max_norm_rcp = 1.0 / max_norm (utils.cuh)
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)
    return e.to(torch.uint8)


def _f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).contiguous().view(_F32)


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """The quantization multiplier TE applies: ``ptx::exp2f_rcp<float>(E)`` = 2^(127-E).

    E = 255 -> NaN; E = 254 -> 2^-127 (subnormal bits 0x00400000); else bits (254-E) << 23,
    so E = 0 -> 2^127.
    """
    ei = e.to(torch.int32)
    bits = (254 - ei).clamp(min=0) << 23
    bits = torch.where(ei == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(ei == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return _f32_from_bits(bits)


def e8m0_to_scale_inv(e: torch.Tensor) -> torch.Tensor:
    """The dequantization multiplier: ``ptx::exp2f(E)`` = 2^(E-127).

    E = 255 -> NaN; E = 0 -> 2^-127 (0x00400000); else bits E << 23.
    """
    ei = e.to(torch.int32)
    bits = ei << 23
    bits = torch.where(ei == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(ei == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return _f32_from_bits(bits)


# ------------------------------------------------------------------------------------------------
# Small shared pieces
# ------------------------------------------------------------------------------------------------


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 -> bfloat16 (RNE, NaN kept) by bit arithmetic; returned as float32 values."""
    x = x.to(_F32).contiguous()
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (b >> 16) & 1
    r = ((b + 0x7FFF + lsb) >> 16) << 16
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC00000), r)
    r = torch.where(r >= 2**31, r - 2**32, r)
    return r.to(torch.int32).view(_F32)


def amax_ignore_nan(a: torch.Tensor, dim=None) -> torch.Tensor:
    """max|x| over non-NaN elements, 0 when there are none (TE's fmaxf reductions from 0)."""
    a = a.to(_F32)
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a.abs())
    if dim is None:
        return a.max().reshape(()) if a.numel() else torch.zeros((), dtype=_F32)
    return a.amax(dim=dim)


def _input_value_for_inf(dtype: torch.dtype) -> float:
    """TypeInfo<IType>::max_finite_value, used by blockwise kernels when the scale is inf."""
    if dtype == torch.bfloat16:
        return BF16_MAX
    if dtype == torch.float16:
        return FP16_MAX
    return FLT_MAX  # fp32 (fp64 is not a TE input type; it is rounded to fp32 here)


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_max_value: float,
    *,
    force_pow_2_scales: bool,
    epsilon: float,
    value_for_inf: float,
) -> torch.Tensor:
    """recipe/recipe_common.cuh ``compute_scale_from_amax``, element-wise on a float32 tensor.

    amax < eps -> eps; amax inf/0/NaN -> 1; scale = __fdiv_rn(fp8_max, amax) in fp32;
    inf scale -> value_for_inf; pow2 -> keep only sign+exponent bits (& 0xFF800000).
    """
    amax = torch.as_tensor(amax).to(_F32)
    eps = _f32(float(epsilon))
    amax = torch.where(amax < eps, eps.expand_as(amax), amax)
    scale = _f32(float(fp8_max_value)) / amax
    scale = torch.where(torch.isinf(scale), _f32(value_for_inf).expand_as(scale), scale)
    if force_pow_2_scales:
        bits = scale.contiguous().view(torch.int32) & -8388608  # 0xFF800000 as int32
        scale = bits.view(_F32)
    one = torch.ones_like(scale)
    scale = torch.where(torch.isinf(amax) | (amax == 0) | torch.isnan(amax), one, scale)
    return scale


def _recip_f32(s: torch.Tensor) -> torch.Tensor:
    """fp32 round-to-nearest 1/s (__frcp_rn, or 1.0f/s; 1.0/s in double rounds identically)."""
    return _f32(1.0) / s.to(_F32)


def _flatten_2d(x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...], int, int]:
    if not torch.is_floating_point(x):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ValueError("0-d tensors are not supported (TE needs at least one dimension)")
    if x.numel() == 0:
        raise ValueError("empty tensors are not supported by this oracle")
    K = shape[-1]
    M = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return x.detach().to("cpu").to(_F32).reshape(M, K), shape, M, K


def _roundup(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _cdiv(v: int, m: int) -> int:
    return (v + m - 1) // m


def _padded(values: torch.Tensor, shape: Tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(shape, dtype=dtype)
    out[: values.shape[0], : values.shape[1]] = values.to(dtype)
    return out


def _columnwise_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """(S[-1], *S[:-1]) -- movedim(-1, 0) of the logical shape."""
    return (shape[-1], *shape[:-1])


# ------------------------------------------------------------------------------------------------
# Per-tensor FP8 (current and delayed scaling)
# ------------------------------------------------------------------------------------------------


def _float8_buffers(x2, shape, M, K, scale, fmt, rowwise, columnwise):
    q = fp8_encode(x2 * scale, fmt)  # fp32 multiply, then satfinite RNE cast
    out: Dict[str, torch.Tensor] = {}
    if rowwise:
        out["_data"] = q.reshape(shape).clone()
    if columnwise:
        out["_transpose"] = q.t().contiguous().reshape(_columnwise_shape(shape))
    out["_scale_inv"] = _recip_f32(scale).reshape(1)
    return out


def ref_float8_current(
    x: torch.Tensor,
    fp8_dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    force_pow_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    amax: Optional[float] = None,
) -> Dict[str, torch.Tensor]:
    """Float8CurrentScalingQuantizer: amax -> compute_scale_from_amax (inf -> FLT_MAX) -> cast.
    ``amax``: the value in the quantizer's amax buffer in place of max|x| (a shared one).

    Buffers: ``_data`` (S) if rowwise, ``_transpose`` (S[-1], *S[:-1]) if columnwise (the
    Hopper/Ada/SM12x layout; on SM10x TE keeps only ``_data``), ``_scale_inv`` (1,) float32.
    """
    fmt = _fmt(fp8_dtype)
    x2, shape, M, K = _flatten_2d(x)
    amax = amax_ignore_nan(x2) if amax is None else _f32(amax)
    scale = compute_scale_from_amax(
        amax,
        _FP8_FORMATS[fmt]["max"],
        force_pow_2_scales=force_pow_2_scales,
        epsilon=amax_epsilon,
        value_for_inf=FLT_MAX,  # current_scaling.cu passes std::numeric_limits<float>::max()
    )
    return _float8_buffers(x2, shape, M, K, scale, fmt, rowwise, columnwise)


def ref_float8_delayed(
    x: torch.Tensor,
    scale: float,
    fp8_dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> Dict[str, torch.Tensor]:
    """Float8Quantizer (delayed scaling): cast with the given fp32 scale, scale_inv = fp32(1/scale)."""
    fmt = _fmt(fp8_dtype)
    x2, shape, M, K = _flatten_2d(x)
    s = torch.as_tensor(scale).to(_F32).reshape(())
    return _float8_buffers(x2, shape, M, K, s, fmt, rowwise, columnwise)


# ------------------------------------------------------------------------------------------------
# MXFP8
# ------------------------------------------------------------------------------------------------


def ref_mxfp8(
    x: torch.Tensor,
    fp8_dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    with_2d_quantization: bool = False,
) -> Dict[str, torch.Tensor]:
    """MXFP8Quantizer: 1x32 (rowwise) and 32x1 (columnwise) blocks, E8M0 scales, compact layout.

    Buffers: ``_rowwise_data`` (S), ``_rowwise_scale_inv`` (roundup(M,128), roundup(K/32,4)),
    ``_columnwise_data`` (S, not transposed), ``_columnwise_scale_inv`` (roundup(M/32,4),
    roundup(K,128)).  2D mode: one E8M0 per 32x32 tile, repeated into both 1D layouts.
    """
    fmt = _fmt(fp8_dtype)
    x2, shape, M, K = _flatten_2d(x)
    if M % 32 or K % 32:
        raise ValueError(f"MXFP8 needs M % 32 == 0 and K % 32 == 0, got M={M}, K={K}")
    mx = _FP8_FORMATS[fmt]["max"]
    a = torch.where(torch.isnan(x2), torch.zeros_like(x2), x2.abs())
    if with_2d_quantization:
        tile = a.reshape(M // 32, 32, K // 32, 32).amax(dim=(1, 3))  # (M/32, K/32)
        e_tile = e8m0_from_amax(tile, mx)
        e_row = e_tile.repeat_interleave(32, dim=0)  # (M, K/32)
        e_col = e_tile.repeat_interleave(32, dim=1)  # (M/32, K)
    else:
        e_row = e8m0_from_amax(a.reshape(M, K // 32, 32).amax(dim=2), mx)
        e_col = e8m0_from_amax(a.reshape(M // 32, 32, K).amax(dim=1), mx)
    out: Dict[str, torch.Tensor] = {}
    if rowwise:
        s = e8m0_to_scale(e_row).repeat_interleave(32, dim=1)  # (M, K)
        out["_rowwise_data"] = fp8_encode(x2 * s, fmt).reshape(shape)
        out["_rowwise_scale_inv"] = _padded(
            e_row, (_roundup(M, 128), _roundup(K // 32, 4)), torch.uint8
        )
    if columnwise:
        s = e8m0_to_scale(e_col).repeat_interleave(32, dim=0)  # (M, K)
        out["_columnwise_data"] = fp8_encode(x2 * s, fmt).reshape(shape)
        out["_columnwise_scale_inv"] = _padded(
            e_col, (_roundup(M // 32, 4), _roundup(K, 128)), torch.uint8
        )
    return out


# ------------------------------------------------------------------------------------------------
# Blockwise FP8 (1x128 and 128x128)
# ------------------------------------------------------------------------------------------------


def _block_amax_1d(a: torch.Tensor, block: int = 128) -> torch.Tensor:
    """(R, C) non-negative -> (R, ceil(C/block)) amax over runs along the last dim (zero padded)."""
    R, C = a.shape
    nb = _cdiv(C, block)
    p = torch.zeros(R, nb * block, dtype=a.dtype)
    p[:, :C] = a
    return p.reshape(R, nb, block).amax(dim=2)


def ref_blockwise(
    x: torch.Tensor,
    fp8_dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    block_scaling_dim: int = 2,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> Dict[str, torch.Tensor]:
    """Float8BlockQuantizer (transpose/quantize_transpose_{square,vector}_blockwise.cu).

    Per block: scale = compute_scale_from_types<IType, OType>(amax, eps, pow2), i.e. the
    per-tensor formula with value_for_inf = the *input* dtype's max; scale_inv = 1/scale (fp32);
    q = satfinite_rne(fp32(x) * scale).  Edge blocks use the amax of the existing elements.
    Buffers (float32 scales, GEMM_READY layout):
      2D: _rowwise_scale_inv (ceil(M/128), roundup(ceil(K/128),4)) [mb, kb];
          _columnwise_scale_inv (ceil(K/128), roundup(ceil(M/128),4)) [kb, mb];
          _columnwise_data = transpose of the rowwise bytes, shape (S[-1], *S[:-1]).
      1D: _rowwise_scale_inv (ceil(K/128), roundup(M,4)) [kb, m] (stored transposed);
          _columnwise_scale_inv (ceil(M/128), roundup(K,4)) [mb, k]; columnwise data is a
          separate quantization of x^T with 128-blocks along M.
    """
    fmt = _fmt(fp8_dtype)
    if block_scaling_dim not in (1, 2):
        raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim}")
    value_for_inf = _input_value_for_inf(x.dtype)
    x2, shape, M, K = _flatten_2d(x)
    mx = _FP8_FORMATS[fmt]["max"]
    a = torch.where(torch.isnan(x2), torch.zeros_like(x2), x2.abs())
    mb, kb = _cdiv(M, 128), _cdiv(K, 128)

    def scale_of(amax):
        return compute_scale_from_amax(
            amax,
            mx,
            force_pow_2_scales=force_pow_2_scales,
            epsilon=amax_epsilon,
            value_for_inf=value_for_inf,
        )

    out: Dict[str, torch.Tensor] = {}
    if block_scaling_dim == 2:
        p = torch.zeros(mb * 128, kb * 128, dtype=_F32)
        p[:M, :K] = a
        tile_amax = p.reshape(mb, 128, kb, 128).amax(dim=(1, 3))  # (mb, kb)
        scale = scale_of(tile_amax)
        scale_inv = _recip_f32(scale)
        s_el = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :K]
        q = fp8_encode(x2 * s_el, fmt)
        if rowwise:
            out["_rowwise_data"] = q.reshape(shape)
            out["_rowwise_scale_inv"] = _padded(scale_inv, (mb, _roundup(kb, 4)), _F32)
        if columnwise:
            out["_columnwise_data"] = q.t().contiguous().reshape(_columnwise_shape(shape))
            out["_columnwise_scale_inv"] = _padded(scale_inv.t(), (kb, _roundup(mb, 4)), _F32)
        return out

    if rowwise:
        scale = scale_of(_block_amax_1d(a))  # (M, kb)
        s_el = scale.repeat_interleave(128, 1)[:, :K]
        out["_rowwise_data"] = fp8_encode(x2 * s_el, fmt).reshape(shape)
        out["_rowwise_scale_inv"] = _padded(_recip_f32(scale).t(), (kb, _roundup(M, 4)), _F32)
    if columnwise:
        xt = x2.t().contiguous()  # (K, M)
        scale = scale_of(_block_amax_1d(a.t().contiguous()))  # (K, mb)
        s_el = scale.repeat_interleave(128, 1)[:, :M]
        out["_columnwise_data"] = fp8_encode(xt * s_el, fmt).reshape(_columnwise_shape(shape))
        out["_columnwise_scale_inv"] = _padded(_recip_f32(scale).t(), (mb, _roundup(K, 4)), _F32)
    return out


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------

_INV6_F32 = 1.0 / 6.0  # fp4_max_inv = 1.0f / 6.0f (core_nvfp4.cuh), rounded to fp32 by _f32


def nvfp4_global_encode_scale(global_amax: torch.Tensor, e4m3_max: float = 448.0) -> torch.Tensor:
    """core_nvfp4.cuh compute_global_encode_scaling_factor_FP4.

    S_enc = fp32(e4m3_max * 6) / amax (fp32 RN); fminf(S_enc, FLT_MAX) (so NaN -> FLT_MAX);
    amax == 0 or S_enc == 0 (amax = inf) -> 1.
    """
    amax = torch.as_tensor(global_amax).to(_F32)
    s = _f32(e4m3_max * FP4_MAX) / amax
    s = torch.where(torch.isnan(s) | (s > FLT_MAX), _f32(FLT_MAX).expand_as(s), s)
    s = torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)
    return s


def _nvfp4_quantize_rows(
    x2: torch.Tensor, block_amax: torch.Tensor, global_amax: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize (R, C) float32 rows with per-(row, 16-block) amax (R, C/16).

    Returns (packed data (R, C/2) uint8, E4M3 scale bytes (R, C/16) uint8).  Order of fp32 ops
    (quantize_transpose_nvfp4.cuh + core_nvfp4.cuh):
      S_enc = nvfp4_global_encode_scale(amax); S_dec = fp32(1 / S_enc)
      s_b   = e4m3_satfinite_rne( fminf( block_amax * fp32(S_enc * fp32(1/6)), FLT_MAX ) )
      enc_b = fminf( 1.0f / fp32(float(s_b) * S_dec), FLT_MAX )          # a true division
      q     = e2m1_satfinite_rne( fp32(x) * enc_b )
    """
    R, C = x2.shape
    s_enc = nvfp4_global_encode_scale(global_amax)
    s_dec = _recip_f32(s_enc)
    mult = s_enc * _f32(_INV6_F32)
    sdb = block_amax.to(_F32) * mult
    sdb = torch.where(torch.isnan(sdb) | (sdb > FLT_MAX), _f32(FLT_MAX).expand_as(sdb), sdb)
    s_b = fp8_encode(sdb, "e4m3")
    s_b_val = fp8_decode(s_b, "e4m3")
    enc = _f32(1.0) / (s_b_val * s_dec)
    enc = torch.where(torch.isnan(enc) | (enc > FLT_MAX), _f32(FLT_MAX).expand_as(enc), enc)
    codes = fp4_encode(x2 * enc.repeat_interleave(16, dim=1))
    return fp4_pack(codes), s_b


def _sylvester_hadamard16() -> torch.Tensor:
    idx = torch.arange(16)
    parity = torch.zeros(16, 16, dtype=torch.int64)
    andm = idx[:, None] & idx[None, :]
    for bit in range(4):
        parity ^= (andm >> bit) & 1
    return (1 - 2 * parity).to(torch.float64)


_WGRAD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def rht_matrix(with_random_sign_mask: bool = True) -> torch.Tensor:
    """diag(signs) @ H16 / 4 as float64 (every entry is +-0.25, exact in bf16 too)."""
    signs = torch.tensor(
        _WGRAD_SIGNS if with_random_sign_mask else [1] * 16, dtype=torch.float64
    )
    return signs[:, None] * _sylvester_hadamard16() * 0.25


def apply_rht_bf16(xt: torch.Tensor, with_random_sign_mask: bool = True) -> torch.Tensor:
    """RHT of a (R, C) tensor along its last dim in 16-groups, with TE's precision model.

    y[r, 16g + j] = sum_i xt[r, 16g + i] * R[i, j] with R = diag(s) H16 / 4: bf16 operands,
    products exact, accumulated in fp32 (tensor-core MMA; modelled as the exact sum rounded once
    to fp32), then rounded to bf16 (cvt.rn.bf16x2.f32 / NumericConverter) before amax and
    quantization.  Returned as float32 holding bf16 values.
    """
    R_, C = xt.shape
    if C % 16:
        raise ValueError("RHT needs the transformed dim to be a multiple of 16")
    v = xt.to(torch.float64).reshape(-1, 16) @ rht_matrix(with_random_sign_mask)
    return bf16_round(v.to(_F32)).reshape(R_, C)


def inverse_rht(t: torch.Tensor, with_random_sign_mask: bool = True) -> torch.Tensor:
    """Undo the RHT on decoded columnwise values (R, C), groups of 16 along the last dim.

    te-serial's documented rule (TE has no CPU inverse): R = diag(s) H16 / 4 is orthogonal, so
    y[r, 16g + j] = sum_i t[r, 16g + i] * R[j, i], formed exactly and rounded once to fp32. The 16
    values of a group share one block scale, so the float64 sum below is exact.
    """
    R_, C = t.shape
    v = t.to(torch.float64).reshape(-1, 16) @ rht_matrix(with_random_sign_mask).t()
    return v.to(_F32).reshape(R_, C)


def _nvfp4_columnwise_data_shape(shape: Tuple[int, ...], M: int, K: int, two_d: bool):
    if two_d or len(shape) <= 2:
        return (K, M // 2)
    cshape = list(_columnwise_shape(shape))
    if cshape[-1] % 2:
        raise ValueError(
            f"TE's Python NVFP4 columnwise spec {tuple(cshape[:-1]) + (cshape[-1] // 2,)} cannot "
            f"hold {K * M // 2} bytes for shape {shape} (odd S[-2]); pass columnwise_data_2d=True "
            f"for the C++ (K, M/2) layout"
        )
    cshape[-1] //= 2
    return tuple(cshape)


def ref_nvfp4(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    with_2d_quantization: bool = False,
    with_rht: bool = False,
    with_random_sign_mask: bool = True,
    with_post_rht_amax: bool = False,
    columnwise_data_2d: bool = False,
    global_amax: Optional[float] = None,
) -> Dict[str, torch.Tensor]:
    """NVFP4Quantizer (no stochastic rounding, no row-scaling, no 4over6; E4M3_MAX = 448).

    ``global_amax``: the amax the global encode scale is computed from in place of max|x| (TE
    takes it from the quantizer's amax buffer, which an amax kernel fills before the cast: the
    buffer may hold a fused group's shared amax). Without RHT both usages use it.

    Buffers: ``_rowwise_data`` (*S[:-1], K/2), ``_rowwise_scale_inv`` (roundup(M,128),
    roundup(K/16,4)) E4M3 bytes, ``_columnwise_data`` per TE Python inner_tensor_specs:
    convert_shape_for_fp4((S[-1], *S[:-1])) -- for 2-D input (K, M/2); ``columnwise_data_2d=True``
    gives the C++ allocation (K, M/2) for N-D input -- ``_columnwise_scale_inv``
    (roundup(K,128), roundup(M/16,4)), ``_amax_rowwise`` (1,), ``_amax_columnwise`` (1,).

    Without RHT both amaxes equal max|x|.  With RHT (bf16 input only, needs
    with_post_rht_amax=True as in TE), the columnwise operand is RHT(x^T) rounded to bf16 and
    ``_amax_columnwise`` = max|RHT(x^T)|; the rowwise operand is x itself.
    2D mode: one block amax per 16x16 tile of x; columnwise = lossless transpose.
    """
    x2, shape, M, K = _flatten_2d(x)
    if M % 16 or K % 16:
        raise ValueError(f"NVFP4 needs M % 16 == 0 and K % 16 == 0, got M={M}, K={K}")
    if with_rht:
        if x.dtype != torch.bfloat16:
            raise ValueError("TE supports RHT only for bfloat16 input")
        if not with_post_rht_amax:
            raise ValueError("TE rejects with_rht without with_post_rht_amax ('Pre-RHT amax')")
        if with_2d_quantization:
            raise NotImplementedError("RHT together with 2D quantization is not modelled")

    amax_row = amax_ignore_nan(x2) if global_amax is None else _f32(global_amax)
    a = torch.where(torch.isnan(x2), torch.zeros_like(x2), x2.abs())
    out: Dict[str, torch.Tensor] = {}

    if with_2d_quantization:
        tile = a.reshape(M // 16, 16, K // 16, 16).amax(dim=(1, 3))  # (M/16, K/16)
        row_block_amax = tile.repeat_interleave(16, dim=0)  # (M, K/16)
        col_block_amax = tile.t().contiguous().repeat_interleave(16, dim=0)  # (K, M/16)
        col_src = x2.t().contiguous()
        amax_col = amax_row
    else:
        row_block_amax = a.reshape(M, K // 16, 16).amax(dim=2)
        if with_rht:
            col_src = apply_rht_bf16(x2.t().contiguous(), with_random_sign_mask)
            amax_col = amax_ignore_nan(col_src)
        else:
            col_src = x2.t().contiguous()
            amax_col = amax_row
        ca = torch.where(torch.isnan(col_src), torch.zeros_like(col_src), col_src.abs())
        col_block_amax = ca.reshape(K, M // 16, 16).amax(dim=2)

    if rowwise:
        data, sb = _nvfp4_quantize_rows(x2, row_block_amax, amax_row)
        out["_rowwise_data"] = data.reshape(*shape[:-1], K // 2)
        out["_rowwise_scale_inv"] = _padded(
            sb, (_roundup(M, 128), _roundup(_cdiv(K, 16), 4)), torch.uint8
        )
    if columnwise:
        data, sb = _nvfp4_quantize_rows(col_src, col_block_amax, amax_col)
        out["_columnwise_data"] = data.reshape(
            _nvfp4_columnwise_data_shape(shape, M, K, columnwise_data_2d)
        )
        out["_columnwise_scale_inv"] = _padded(
            sb, (_roundup(K, 128), _roundup(_cdiv(M, 16), 4)), torch.uint8
        )
    if rowwise:
        out["_amax_rowwise"] = amax_row.reshape(1).clone()
    if columnwise:
        out["_amax_columnwise"] = amax_col.reshape(1).clone()
    return out


# ------------------------------------------------------------------------------------------------
# Dequantize references
# ------------------------------------------------------------------------------------------------

_NVFP4_FACTOR_INV = 1.0 / (6.0 * 448.0)  # constexpr float factor_inv in dequantize_nvfp4.cuh


def ref_dequantize(
    kind: str, buffers: Dict[str, torch.Tensor], shape: Sequence[int], **fields
) -> torch.Tensor:
    """Dequantize TE buffers to float32 of the logical ``shape``.

    kind: "float8" (fields: fp8_dtype), "mxfp8" (fp8_dtype), "blockwise" (fp8_dtype,
    block_scaling_dim=2), "nvfp4" (with_rht=False, with_random_sign_mask=True).  Rowwise data is
    used when present, else the columnwise data (undoing its transpose/layout; NVFP4 with RHT:
    :func:`inverse_rht`, te-serial's rule, where TE has no CPU path).
    """
    shape = tuple(int(s) for s in shape)
    K = shape[-1]
    M = math.prod(shape[:-1]) if len(shape) > 1 else 1
    get = lambda name: buffers.get(name)  # noqa: E731

    if kind == "float8":
        fmt = _fmt(fields["fp8_dtype"])
        si = get("_scale_inv").to(_F32).reshape(())
        if get("_data") is not None:
            return (fp8_decode(get("_data"), fmt) * si).reshape(shape)
        t = fp8_decode(get("_transpose"), fmt) * si
        return t.reshape(K, M).t().reshape(shape)

    if kind == "mxfp8":
        fmt = _fmt(fields["fp8_dtype"])
        if get("_rowwise_data") is not None:
            e = get("_rowwise_scale_inv")[:M, : K // 32]
            s = e8m0_to_scale_inv(e).repeat_interleave(32, dim=1)
            q = fp8_decode(get("_rowwise_data"), fmt).reshape(M, K)
        else:
            e = get("_columnwise_scale_inv")[: M // 32, :K]
            s = e8m0_to_scale_inv(e).repeat_interleave(32, dim=0)
            q = fp8_decode(get("_columnwise_data"), fmt).reshape(M, K)
        return (s * q).reshape(shape)

    if kind == "blockwise":
        fmt = _fmt(fields["fp8_dtype"])
        dim = int(fields.get("block_scaling_dim", 2))
        mb, kb = _cdiv(M, 128), _cdiv(K, 128)
        if get("_rowwise_data") is not None:
            q = fp8_decode(get("_rowwise_data"), fmt).reshape(M, K)
            si = get("_rowwise_scale_inv").to(_F32)
            if dim == 2:
                s = si[:mb, :kb].repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :K]
            else:
                s = si[:kb, :M].t().repeat_interleave(128, 1)[:, :K]
            return (q * s).reshape(shape)
        qt = fp8_decode(get("_columnwise_data"), fmt).reshape(K, M)
        si = get("_columnwise_scale_inv").to(_F32)
        if dim == 2:
            s = si[:kb, :mb].repeat_interleave(128, 0).repeat_interleave(128, 1)[:K, :M]
        else:
            s = si[:mb, :K].t().repeat_interleave(128, 1)[:, :M]
        return (qt * s).t().reshape(shape)

    if kind == "nvfp4":
        factor_inv = _f32(_NVFP4_FACTOR_INV)

        def deq(packed, sb, amax, R, C):
            q = fp4_decode(fp4_unpack(packed.reshape(R, C // 2)))
            final = (fp8_decode(sb[:R, : C // 16].contiguous(), "e4m3") * amax.to(_F32).reshape(()))
            final = final * factor_inv
            return q * final.repeat_interleave(16, dim=1)

        if get("_rowwise_data") is not None:
            return deq(get("_rowwise_data"), get("_rowwise_scale_inv"), get("_amax_rowwise"), M, K).reshape(shape)
        t = deq(get("_columnwise_data"), get("_columnwise_scale_inv"), get("_amax_columnwise"), K, M)
        if fields.get("with_rht", False):
            t = inverse_rht(t, fields.get("with_random_sign_mask", True))
        return t.t().reshape(shape)

    raise ValueError(f"unknown kind {kind!r}")


# ------------------------------------------------------------------------------------------------
# NVFP4 variants (TE 2.20): row-scaled and 4over6
# ------------------------------------------------------------------------------------------------


def _warp_tree_sum16(lanes: torch.Tensor) -> torch.Tensor:
    """``reduce_group_sum_16`` (quantize_4over6_nvfp4.cuh) over the last dim (16 lanes), lane 0's
    result: ``v += __shfl_down_sync(v, offset)`` for offset 8, 4, 2, 1 (a lane whose source is out
    of the group keeps its own value), each add an fp32 RN add."""
    v = [lanes[..., i] for i in range(16)]
    offset = 8
    while offset:
        v = [v[i] + v[i + offset] if i + offset < 16 else v[i] for i in range(16)]
        offset //= 2
    return v[0]


def _nvfp4_4over6_rows(
    x2: torch.Tensor,
    block_amax: torch.Tensor,
    global_amax: torch.Tensor,
    *,
    e4m3_max: int,
    err_mode: str,
    two_d: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """4over6 quantization of (R, C) float32 rows in 16-blocks (quantize_4over6_nvfp4.cuh, default
    ``nvfp4_4over6_err_use_fast_math=False``).  ``global_amax`` is one value or one per row (R,).

    Per block (block_amax from the block, or its 16x16 tile in 2D):
      S_enc = nvfp4_global_encode_scale(amax, e4m3_max); S_dec = fp32(1 / S_enc)
      base  = fp32(fp32(block_amax / 6) * S_enc)
      s4 = e4m3(fminf(fp32(base * 1.5), 448)), s6 = e4m3(fminf(base, 448))   (448 = E4M3's max)
      enc_c = fminf(1 / fp32(float(s_c) * S_dec), FLT_MAX); q_c = e2m1(x * enc_c)
      err_c = sum over the 16 elements, in order, of |d| (MAE) or d*d (MSE),
              d = fp32(fp32(fp32(fp32(q_c * float(s_c)) * amax) / fp32(6 * e4m3_max)) - x)
      2D: err_c of the 16 rows of a tile summed in the warp's tree order (:func:`_warp_tree_sum16`)
      map-to-4 iff err_4 < err_6 (ties and NaN: map-to-6).
    Returns (packed data (R, C/2), E4M3 scale bytes (R, C/16)).
    """
    R, C = x2.shape
    nb = C // 16
    xs = x2.to(_F32).reshape(R, nb, 16)
    g = torch.as_tensor(global_amax).to(_F32).reshape(-1, 1)
    s_enc = nvfp4_global_encode_scale(g, float(e4m3_max))
    s_dec = _recip_f32(s_enc)
    base = (block_amax.to(_F32) / _f32(FP4_MAX)) * s_enc
    denom = _f32(FP4_MAX * e4m3_max)
    results = []
    for pre in (base * _f32(1.5), base):
        pre = torch.where(pre > E4M3_MAX, _f32(E4M3_MAX).expand_as(pre), pre)
        sb = fp8_encode(pre, "e4m3")
        sv = fp8_decode(sb, "e4m3")
        enc = _f32(1.0) / (sv * s_dec)
        enc = torch.where(torch.isnan(enc) | (enc > FLT_MAX), _f32(FLT_MAX).expand_as(enc), enc)
        codes = fp4_encode(xs * enc[..., None])
        value = ((fp4_decode(codes) * sv[..., None]) * g[..., None]) / denom
        diff = value - xs
        per = diff.abs() if err_mode == "MAE" else diff * diff
        err = torch.zeros(R, nb, dtype=_F32)
        for i in range(16):
            err = err + per[..., i]
        if two_d:
            tiles = err.reshape(R // 16, 16, nb).permute(0, 2, 1)  # (tile rows, nb, 16 lanes)
            err = _warp_tree_sum16(tiles).repeat_interleave(16, dim=0)
        results.append((codes, sb, err))
    (c4, s4, e4), (c6, s6, e6) = results
    pick4 = e4 < e6
    codes = torch.where(pick4[..., None], c4, c6).reshape(R, C)
    return fp4_pack(codes), torch.where(pick4, s4, s6)


def ref_nvfp4_variant(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    with_2d_quantization: bool = False,
    row_scaled_nvfp4: bool = False,
    nvfp4_use_4over6: bool = False,
    nvfp4_e4m3_max: int = 448,
    nvfp4_4over6_err_mode: str = "MAE",
) -> Dict[str, torch.Tensor]:
    """NVFP4 with TE 2.20's row-scaled and/or 4over6 modes (no RHT, no stochastic rounding).

    Row-scaled (common/cast/dispatch/quantize.cuh -> compute_rowwise_amax, then the quantize
    kernels' ROW_SCALED_NVFP4 path): rowwise only, 1x16; ``_amax_rowwise`` (M,) holds each row's
    max|x| (NaN ignored) and each row is quantized with its own global scale.  4over6
    (quantize_4over6_nvfp4.cuh): :func:`_nvfp4_4over6_rows`; both amaxes are max|x|; the columnwise
    copy is x^T quantized the same way (in 2D its tile errors add up the 16 columns, each summed
    along M).  Without 4over6 the plain NVFP4 rules of :func:`_nvfp4_quantize_rows` apply.
    Buffers, shapes and padding as :func:`ref_nvfp4` (columnwise data (K, M/2) for 2-D input).
    """
    x2, shape, M, K = _flatten_2d(x)
    if M % 16 or K % 16:
        raise ValueError(f"NVFP4 needs M % 16 == 0 and K % 16 == 0, got M={M}, K={K}")
    if row_scaled_nvfp4 and (columnwise or with_2d_quantization or not rowwise):
        raise ValueError("row-scaled NVFP4 is rowwise-only with 1x16 blocks")
    if nvfp4_e4m3_max != 448 and not nvfp4_use_4over6:
        raise ValueError("E4M3 max 256 is a 4over6 option")
    a = torch.where(torch.isnan(x2), torch.zeros_like(x2), x2.abs())
    amax_row = a.amax(dim=1) if row_scaled_nvfp4 else amax_ignore_nan(x2)

    def block_amax(src_abs: torch.Tensor) -> torch.Tensor:
        R, C = src_abs.shape
        if with_2d_quantization:
            tile = src_abs.reshape(R // 16, 16, C // 16, 16).amax(dim=(1, 3))
            return tile.repeat_interleave(16, dim=0)
        return src_abs.reshape(R, C // 16, 16).amax(dim=2)

    def encode(src: torch.Tensor, src_abs: torch.Tensor, amax: torch.Tensor):
        if nvfp4_use_4over6:
            return _nvfp4_4over6_rows(src, block_amax(src_abs), amax, e4m3_max=nvfp4_e4m3_max,
                                      err_mode=nvfp4_4over6_err_mode.upper(), two_d=with_2d_quantization)
        return _nvfp4_quantize_rows(src, block_amax(src_abs), amax.reshape(-1, 1))

    out: Dict[str, torch.Tensor] = {}
    if rowwise:
        data, sb = encode(x2, a, amax_row)
        out["_rowwise_data"] = data.reshape(*shape[:-1], K // 2)
        out["_rowwise_scale_inv"] = _padded(sb, (_roundup(M, 128), _roundup(_cdiv(K, 16), 4)), torch.uint8)
    if columnwise:
        data, sb = encode(x2.t().contiguous(), a.t().contiguous(), amax_row)
        out["_columnwise_data"] = data.reshape(_nvfp4_columnwise_data_shape(shape, M, K, False))
        out["_columnwise_scale_inv"] = _padded(sb, (_roundup(K, 128), _roundup(_cdiv(M, 16), 4)), torch.uint8)
    if rowwise:
        out["_amax_rowwise"] = amax_row.reshape(-1).clone()
    if columnwise:
        out["_amax_columnwise"] = amax_row.reshape(1).clone()
    return out


def ref_dequantize_nvfp4_variant(
    buffers: Dict[str, torch.Tensor], shape: Sequence[int], *, nvfp4_e4m3_max: int = 448
) -> torch.Tensor:
    """dequantize_nvfp4.cuh with its ROW_SCALED_NVFP4 / E4M3_MAX template arguments:
    x = q * fp32(fp32(float(s_b) * amax) * fp32(1.0f / (6.0f * E4M3_MAX))), amax = the row's when
    ``_amax_rowwise`` holds one per row.  Rowwise data when present, else the columnwise copy."""
    shape = tuple(int(s) for s in shape)
    K = shape[-1]
    M = math.prod(shape[:-1]) if len(shape) > 1 else 1
    factor_inv = _f32(1.0) / _f32(6.0 * nvfp4_e4m3_max)

    def deq(packed, sb, amax, R, C):
        q = fp4_decode(fp4_unpack(packed.reshape(R, C // 2)))
        final = fp8_decode(sb[:R, : C // 16].contiguous(), "e4m3") * amax.to(_F32).reshape(-1, 1)
        return q * (final * factor_inv).repeat_interleave(16, dim=1)

    if buffers.get("_rowwise_data") is not None:
        t = deq(buffers["_rowwise_data"], buffers["_rowwise_scale_inv"], buffers["_amax_rowwise"], M, K)
        return t.reshape(shape)
    t = deq(buffers["_columnwise_data"], buffers["_columnwise_scale_inv"], buffers["_amax_columnwise"], K, M)
    return t.t().reshape(shape)
