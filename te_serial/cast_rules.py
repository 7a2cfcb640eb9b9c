"""The casts' rules in torch ops alone: FP8 and packed FP4 (E2M1) codes of scaled values, NVFP4
4over6's choice, FP8 dequantize, bit-exact with TE's kernels (all arithmetic fp32, as theirs).

Each is the eager rule a custom op of ``kernel_ops`` runs where its C kernel declines, and what
``numerics`` runs wherever no C loop does: eager, and in compiled graphs off CPU or without the
library (the ``tracing()`` branches are the forms inductor fuses and vectorizes). Nothing here
imports the C kernels or their ops. TE paths are relative to TE's repository (see
``shared/docs/te_formats.md`` section 4).
"""

from __future__ import annotations

import sys

import torch

from .tracing import tracing

#: Largest finite value of each FP8 format TE uses (``Quantized_Limits<OType>::max_norm``).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

#: E2M1 magnitudes by 3-bit code (``cast_from_fp4x2`` in custom_recipes/reference_nvfp4.py).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0

#: E2M1 round-to-nearest-even as steps between FP4_E2M1_VALUES: (midpoint, whether a tie stays
#: below it). A tie goes to the even magnitude index: 0.25 → 0 (not 0.5), 0.75 → 1.0, 1.25 → 1.0,
#: 1.75 → 2.0, 2.5 → 2.0, 3.5 → 4.0, 5.0 → 4.0.
E2M1_STEPS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))

# pack_fp4 / unpack_fp4 read byte pairs as int16 words, element 2i in the low byte
assert sys.byteorder == "little", "te_serial's FP4 packing assumes a little-endian host"


def isnan(x: torch.Tensor) -> torch.Tensor:
    """``x != x``: torch.isnan's rule, in a form inductor's CPU code generator vectorizes."""
    return x != x


def isinf(x: torch.Tensor) -> torch.Tensor:
    """``|x| == inf``: torch.isinf's rule, in a form inductor's CPU code generator vectorizes."""
    return x.abs() == float("inf")


# --- FP8 -----------------------------------------------------------------------------------------

def scale_and_cast_to_fp8(x: torch.Tensor, scale: torch.Tensor | None,
                          fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bits of ``fp32(x) * scale`` (``scale`` broadcastable, fp32): the kernels' quantize step.

    Works on one fresh fp32 buffer in place. After clamping, 0xFF can only come from a negative
    NaN (±inf and the all-ones E4M3 code are out of range), so mapping it to 0x7F canonicalizes NaN.

    Compiled (``formats.fused``), the input holds no NaN (NaN inputs run eager), so there is nothing
    to canonicalize, and the result stays ``fp8_dtype`` (same bytes) for the caller to view as
    bits outside the graph.
    """
    m = FP8_MAX[fp8_dtype]
    if tracing():  # out of place: in-place ops stop inductor's fusion
        y = x.float() * scale if scale is not None else x.float()
        return y.clamp(-m, m).to(fp8_dtype)
    y = x.to(torch.float32, copy=True)
    if scale is not None:
        y.mul_(scale)
    y.clamp_(-m, m)
    bits = y.to(fp8_dtype).view(torch.uint8)
    return bits.masked_fill_(bits == 0xFF, 0x7F)


def scale_and_cast_to_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                               fp8_dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 codes of x [M, K] scaled by its 1×b blocks' ``row_scale`` [M, K/b], and by its b×1
    blocks' ``col_scale`` [M/b, K], each :func:`scale_and_cast_to_fp8`, as [M, K] both (MXFP8's two
    usages)."""
    m, k = x.shape
    rows = scale_and_cast_to_fp8(x.reshape(m, k // b, b), row_scale[..., None], fp8_dtype)
    cols = scale_and_cast_to_fp8(x.reshape(m // b, b, k), col_scale[:, None, :], fp8_dtype)
    return rows.reshape(m, k), cols.reshape(m, k)


def fp8_to_float(bits: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bits (uint8) → fp32 values."""
    return bits.view(fp8_dtype).float()


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of FP8 bits times ``scale`` (fp32, broadcastable to the bits, which keep their
    shape): every FP8 format's dequantize step. torch's conversion, then the product in place."""
    return fp8_to_float(bits, fp8_dtype).mul_(scale)


# --- FP4 E2M1 (NVFP4 data) -----------------------------------------------------------------------

def cast_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 → 4-bit E2M1 codes (uint8, one per element): RNE with saturation at ±6.

    Code = sign (bit 3) | magnitude index 0..7 into FP4_E2M1_VALUES; ties go to the even index
    (PTX ``cvt.rn.satfinite.e2m1x2.f32``). NaN becomes +6 (cuda_fp4.hpp: "NaN converts to
    positive FP4_MAXNORM"). The index is the number of :data:`E2M1_STEPS` midpoints that |x|
    passes: seven compares, which vectorize compiled and eager (the fp32 bit arithmetic it
    replaces was slower eager, and compiled its bit casts went through scalar loops).
    """
    x = x.float()
    a = x.abs()
    passed = ((a > t) if tie_below else (a >= t) for t, tie_below in E2M1_STEPS)  # one mask at a time
    if tracing():  # int32 lanes vectorize (uint8 ones do not); no NaN here (``formats.fused``)
        mag = sum(p.to(torch.int32) for p in passed)
        return (mag | ((x.view(torch.int32) < 0).to(torch.int32) << 3)).to(torch.uint8)
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for p in passed:
        mag += p
    nan = isnan(x)
    mag = mag.masked_fill_(nan, 7)
    sign = ((x.view(torch.int32) < 0) & ~nan).to(torch.uint8) << 3  # the sign bit
    return mag | sign


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes → fp32 values (FP4_E2M1_VALUES, bit 3 the sign; code 8 is -0.0).

    Compiled, built as fp32 bits: magnitude index m ≥ 2 is 2^((m >> 1) - 1) · (1 + (m & 1) / 2),
    i.e. biased exponent (m >> 1) + 126 and the top mantissa bit m & 1; m = 1 is 0.5; m = 0 is 0.
    Inductor vectorizes that, where a table lookup is a gather. Eager, the lookup is one pass where
    the bit arithmetic is eight. Both give the same bits.
    """
    if not tracing():
        table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=codes.device)
        mag = table[(codes & 0x7).long()]
        return torch.where((codes & 0x8) != 0, -mag, mag)
    c = codes.to(torch.int32)
    m = c & 0x7
    normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    half = (m == 1).to(torch.int32) * (126 << 23)
    return (torch.where(m >= 2, normal, half) | ((c & 0x8) << 28)).view(torch.float32)


def pack_fp4(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack codes along ``dim``, two per byte: element 2i in the low nibble.

    Along the last dim each pair is read as one little-endian int16 (element 2i its low byte):
    contiguous loads, which compiled kernels vectorize (two strided byte loads would not be).
    Along another dim the pair's two codes sit in two rows, each loaded contiguously.
    """
    dim %= codes.dim()
    if dim == codes.dim() - 1:
        w = codes.contiguous().view(torch.int16)
        return ((w & 0x0F) | ((w >> 4) & 0xF0)).to(torch.uint8)
    pairs = codes.unflatten(dim, (-1, 2))
    return pairs.select(dim + 1, 0) | (pairs.select(dim + 1, 1) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: (..., n) bytes → (..., 2n) codes, each byte widened to a
    little-endian int16 holding (low nibble, high nibble) as its two bytes (no stack: fusable)."""
    p = packed.to(torch.int16).contiguous()
    return ((p & 0x0F) | ((p & 0xF0) << 4)).view(torch.uint8)


def scale_and_cast_to_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """E2M1 codes of ``fp32(x) * scale`` (``scale`` broadcastable, fp32) packed two per byte along
    ``dim`` (-1 or -2, :func:`pack_fp4`): NVFP4's data step, :func:`cast_to_fp4_codes` and
    :func:`pack_fp4`."""
    return pack_fp4(cast_to_fp4_codes(x.float() * scale if scale is not None else x.float()), dim=dim)


def scale_and_cast_to_fp4_with_error(x: torch.Tensor, scale: torch.Tensor, sf: torch.Tensor, amax: torch.Tensor,
                                     denom: torch.Tensor, mse: bool,
                                     dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scale_and_cast_to_fp4`, and per 16 elements along ``dim`` the fp32 sum, in order, of
    err(((q · sf) · amax) / denom − x) with q the codes' values and err |d|, or d² with ``mse``:
    NVFP4 4over6's candidate codes and block errors (quantize_4over6_nvfp4.cuh). The sums keep
    ``dim`` at a 16th of its size."""
    xf = x.float()
    codes = cast_to_fp4_codes(xf * scale)
    d = fp4_codes_to_float(codes) * sf * amax / denom - xf
    e = (d * d if mse else d.abs()).unflatten(dim, (-1, 16))  # the 16 terms of each sum on dim
    err = e.select(dim, 0)
    for i in range(1, 16):
        err = err + e.select(dim, i)
    return pack_fp4(codes, dim=dim), err


def scale_and_cast_to_fp4_4over6(x2: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                                 sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool,
                                 along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 4over6's choice (quantize_4over6_nvfp4.cuh) for x2 [R, C] in blocks of 16 along dim
    ``along`` (1: per-block grids [R, C/16]; 0: [R/16, C]; with ``tile``, grids per 16×16 tile
    [R/16, C/16]): (codes of the candidate chosen per block or tile, packed along the blocks:
    [R, C/16, 8], or down the columns [R/2, C], whose transpose the usage keeps; whether it is
    map-to-4, shaped as the grids).

    Each candidate (``enc4``/``sf4`` map-to-4, ``enc6``/``sf6`` map-to-6) is cast and its block
    errors summed as :func:`scale_and_cast_to_fp4_with_error`; with ``tile`` the 16 blocks of a 16×16
    tile add their sums in the warp's tree order (reduce_group_sum_16: shfl_down by 8, 4, 2, 1).
    Map-to-4 only where its sum is strictly lower (a NaN keeps map-to-6)."""
    r, c = x2.shape
    bd = 2 if along == 1 else 1  # the dim of a block's 16 elements
    gd = 3 - bd  # the grid dim along which a tile's 16 blocks lie: rows (along=1) or columns (along=0)
    blocks = x2.reshape(r, c // 16, 16) if along == 1 else x2.reshape(r // 16, 16, c)
    if tile:  # each tile's scales spread to its 16 blocks
        enc4, sf4, enc6, sf6 = (t.repeat_interleave(16, dim=gd - 1) for t in (enc4, sf4, enc6, sf6))
    out = []
    for enc, sf in ((enc4, sf4), (enc6, sf6)):
        data, err = scale_and_cast_to_fp4_with_error(blocks, enc.unsqueeze(bd), sf.unsqueeze(bd), amax.unsqueeze(bd),
                                                     denom, mse, dim=bd - 3)
        err = err.squeeze(bd)
        if tile:
            t = err.unflatten(gd - 1, (-1, 16))
            while t.shape[gd] > 1:
                h = t.shape[gd] // 2
                t = t.narrow(gd, 0, h) + t.narrow(gd, h, h)
            err = t.squeeze(gd)  # one sum per tile
        out.append((data, err))
    (d4, e4), (d6, e6) = out
    pick4 = e4 < e6
    each = pick4.repeat_interleave(16, dim=gd - 1) if tile else pick4  # per block
    if bd == 2:  # a block's 8 packed bytes as one int64: one select per block, not a loop of 8 bytes (scalar)
        data = torch.where(each.unsqueeze(2), d4.view(torch.int64), d6.view(torch.int64)).view(torch.uint8)
    else:
        data = torch.where(each.unsqueeze(1), d4, d6).reshape(r // 2, c)
    return data, pick4
