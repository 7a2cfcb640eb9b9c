"""Bit-exact scalar rules of TE's quantization kernels, in pure torch (CPU and CUDA).

Every rule here cites the TE kernel it reproduces (paths relative to TE's repository; see
``shared/docs/te_formats.md`` section 4). All arithmetic is fp32, as in the kernels.
"""

from __future__ import annotations

import sys

import torch

from . import native
from .tracing import tracing

FP32_MAX = torch.finfo(torch.float32).max

#: Largest finite value of each FP8 format TE uses (``Quantized_Limits<OType>::max_norm``).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

FP8_DTYPES = tuple(FP8_MAX)

#: E2M1 magnitudes by 3-bit code (``cast_from_fp4x2`` in custom_recipes/reference_nvfp4.py).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0

# pack_fp4 / unpack_fp4 read byte pairs as int16 words, element 2i in the low byte
assert sys.byteorder == "little", "te_serial's FP4 packing assumes a little-endian host"


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 dtype."""
    return FP8_MAX[fp8_dtype]


def _f32(value: float, device=None) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def isnan(x: torch.Tensor) -> torch.Tensor:
    """``x != x``: torch.isnan's rule, in a form inductor's CPU code generator vectorizes."""
    return x != x


def isinf(x: torch.Tensor) -> torch.Tensor:
    """``|x| == inf``: torch.isinf's rule, in a form inductor's CPU code generator vectorizes."""
    return x.abs() == float("inf")


def nan_ignoring_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max|x| in fp32 that skips NaN, as TE's ``fmaxf``/PTX ``max`` reductions do (0 if all NaN).

    TE: common/recipe/current_scaling.cu (amax_kernel), cast/mxfp8/quantize_mxfp8.cuh. The max
    of |x| is one of the inputs, so it is taken in the input dtype (exact) and widened after.
    Eager, the NaN-masking pass runs only when a NaN reached the result; a compiled graph never
    sees a NaN (``formats.fused`` runs such inputs eager), so it is a plain reduction.
    """
    if x.numel() == 0:  # amax of nothing is 0, in the shape the reduction would have
        if dim is None:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return torch.zeros_like(x, dtype=torch.float32).sum(dim=dim, keepdim=keepdim)
    a = x.abs()
    if tracing():  # compiled graphs see NaN-free inputs only (``formats.fused``)
        return (a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)).float()
    m = a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)
    if bool(isnan(m).any()):
        masked = torch.where(isnan(x), torch.zeros((), dtype=x.dtype, device=x.device), a)
        m = masked.amax() if dim is None else masked.amax(dim=dim, keepdim=keepdim)
    return m.float()


@torch.library.custom_op("te_serial::per_block", mutates_args=())
def _per_block(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@_per_block.register_fake
def _(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def per_blocks(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` (per-block scales), computed once per block in a compiled graph: an opaque op that
    inductor cannot inline, so the scale's dozen integer ops and selects are not redone for every
    vector of elements in the cast loop. Scales given together are all ready before
    any cast that uses them, so the casts can share one loop over the input. The identity, with no
    copy, when eager."""
    return tuple(_per_block(list(xs))) if tracing() else xs


def per_block(x: torch.Tensor) -> torch.Tensor:
    """:func:`per_blocks` of one tensor."""
    return per_blocks(x)[0]


def _c_loop_in_graph(x: torch.Tensor) -> bool:
    """Whether a traced graph's cast of ``x`` is the native C loop (CPU, library built); elsewhere,
    and eager, torch's ops run."""
    return tracing() and x.device.type == "cpu" and native.available()


def scale_and_cast_to_fp8(x: torch.Tensor, scale: torch.Tensor | None,
                          fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bits of ``fp32(x) * scale`` (``scale`` broadcastable, fp32): the kernels' quantize step.

    Works on one fresh fp32 buffer in place. After clamping, 0xFF can only come from a negative
    NaN (±inf and the all-ones E4M3 code are out of range), so mapping it to 0x7F canonicalizes NaN.

    Compiled (``formats.fused``), the input holds no NaN (NaN inputs run eager), so there is nothing
    to canonicalize, and the result stays ``fp8_dtype`` (same bytes) for the caller to view as
    bits outside the graph. On CPU the cast is the C loop of ``native.scale_cast_fp8`` (the same
    roundings, 16 lanes at a time, where torch's conversion is scalar and inductor's loop ran at
    half a plain cast's speed for E4M3 and a quarter for E5M2); elsewhere inductor's loop (Triton
    on CUDA). The eager path keeps torch's conversion, so the fused table compares the two.
    """
    m = FP8_MAX[fp8_dtype]
    if _c_loop_in_graph(x):
        return native.scale_cast_fp8(x, scale, fp8_dtype)  # the C loop: the same roundings, faster
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
    usages). Compiled on CPU, one C loop reads x once for both (``native.scale_cast_fp8_pair``)."""
    if _c_loop_in_graph(x):
        return native.scale_cast_fp8_pair(x, row_scale, col_scale, fp8_dtype, b)
    m, k = x.shape
    rows = scale_and_cast_to_fp8(x.reshape(m, k // b, b), row_scale[..., None], fp8_dtype)
    cols = scale_and_cast_to_fp8(x.reshape(m // b, b, k), col_scale[:, None, :], fp8_dtype)
    return rows.reshape(m, k), cols.reshape(m, k)


def scale_and_cast_to_fp8_transposed(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                                     shape: tuple[int, int],
                                     keep_rows: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`scale_and_cast_to_fp8`'s codes (None without ``keep_rows``) and their row-major 2-D
    ``shape`` [M, K] transposed, [K, M]: the columnwise copy where both usages share the codes,
    or where columnwise codes are made in row order. Compiled on CPU, one C pass
    (``native.scale_cast_fp8_transposed``: each stripe transposed while in cache); else the cast, then
    ``native.transpose_bytes``."""
    if _c_loop_in_graph(x):
        return native.scale_cast_fp8_transposed(x, scale, fp8_dtype, shape, keep_rows)
    codes = scale_and_cast_to_fp8(x, scale, fp8_dtype)
    return (codes if keep_rows else None), native.transpose_bytes(codes.reshape(shape))


def fp8_to_float(bits: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bits (uint8) → fp32 values."""
    return bits.view(fp8_dtype).float()


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of FP8 bits times ``scale`` (fp32, broadcastable to the bits, which keep their
    shape): every FP8 format's dequantize step. Eager: torch's conversion, then the product in place.
    Compiled on CPU, the C loop of ``native.dequantize_fp8`` (the same bits; NaN payloads aside)."""
    if _c_loop_in_graph(bits):
        return native.dequantize_fp8(bits, scale, fp8_dtype)
    return fp8_to_float(bits, fp8_dtype).mul_(scale)


def scale_from_amax(amax: torch.Tensor, max_fp8: float, *, force_pow_2_scales: bool,
                    epsilon: float, value_for_inf: float) -> torch.Tensor:
    """Quantization scale from amax: ``compute_scale_from_amax`` (common/recipe/recipe_common.cuh).

    amax < eps → eps; inf/NaN/0 amax → 1; scale = max_fp8 / amax (fp32 RN); inf → value_for_inf;
    pow-2 → keep sign and exponent bits only (``& 0xFF800000``).
    """
    amax = amax.float()
    eps = _f32(epsilon, amax.device)
    amax = torch.where(amax < eps, eps, amax)
    scale = _f32(max_fp8, amax.device) / amax
    scale = torch.where(isinf(scale), _f32(value_for_inf, amax.device), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000
    special = isinf(amax) | isnan(amax) | (amax == 0)
    return torch.where(special, torch.ones_like(scale), scale)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``1.0f / scale`` (IEEE round-to-nearest), as the kernels write scale_inv."""
    return torch.ones_like(scale, dtype=torch.float32) / scale.float()


# --- E8M0 (MXFP8 block scales) -------------------------------------------------------------

def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Biased E8M0 exponent for a block amax: ``float_to_e8m0(amax * max_norm_rcp)``.

    TE: common/util/ptx_arch_spec.cuh. The exponent is rounded *up* (so the block max never
    saturates), saturates at 254; NaN → 255; 0 → 0; values ≤ 2^-127 → 0. Not the OCP floor rule.
    """
    rcp = _f32(1.0 / FP8_MAX[fp8_dtype], amax.device)  # constexpr float(1.0 / max_norm)
    v = amax.float() * rcp
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + round_up.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(isinf(v), torch.full_like(e, 0xFE), e)
    e = torch.where(isnan(v), torch.full_like(e, 0xFF), e)
    return e.to(torch.uint8)


def e8m0_quant_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(127-E) as fp32: ``exp2f_rcp<float>`` (common/util/ptx.cuh); E=254 → 2^-127, 255 → NaN."""
    e = e.to(torch.int32)
    bits = (254 - e) << 23
    bits = torch.where(e == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return bits.view(torch.float32)


def e8m0_dequant_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(E-127) as fp32: ``exp2f`` (common/util/ptx.cuh); E=0 → 2^-127, 255 → NaN."""
    e = e.to(torch.int32)
    bits = e << 23
    bits = torch.where(e == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return bits.view(torch.float32)


# --- FP4 E2M1 (NVFP4 data) -----------------------------------------------------------------

#: E2M1 round-to-nearest-even as steps between FP4_E2M1_VALUES: (midpoint, whether a tie stays
#: below it). A tie goes to the even magnitude index: 0.25 → 0 (not 0.5), 0.75 → 1.0, 1.25 → 1.0,
#: 1.75 → 2.0, 2.5 → 2.0, 3.5 → 4.0, 5.0 → 4.0.
E2M1_STEPS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


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


def scale_and_cast_to_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """E2M1 codes of ``fp32(x) * scale`` (``scale`` broadcastable, fp32) packed two per byte along
    ``dim`` (-1 or -2, :func:`pack_fp4`): NVFP4's data step. Compiled on CPU, the C loop of
    ``native.scale_cast_fp4`` (the same product and roundings, 16 lanes at a time, packed as it
    goes); else :func:`cast_to_fp4_codes` and :func:`pack_fp4`, which the fused table compares it to."""
    if _c_loop_in_graph(x):
        return native.scale_cast_fp4(x, scale, dim)
    return pack_fp4(cast_to_fp4_codes(x.float() * scale if scale is not None else x.float()), dim=dim)


def scale_and_cast_to_fp4_with_error(x: torch.Tensor, scale: torch.Tensor, sf: torch.Tensor, amax: torch.Tensor,
                                     denom: torch.Tensor, mse: bool,
                                     dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scale_and_cast_to_fp4`, and per 16 elements along ``dim`` the fp32 sum, in order, of
    err(((q · sf) · amax) / denom − x) with q the codes' values and err |d|, or d² with ``mse``:
    NVFP4 4over6's candidate codes and block errors (quantize_4over6_nvfp4.cuh). The sums keep
    ``dim`` at a 16th of its size: the eager rule of :func:`scale_and_cast_to_fp4_4over6`'s candidates."""
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
    [R/16, C/16]): (codes packed along the blocks, of the candidate chosen per block or tile, as
    the usage keeps them: [R, C/16, 8], or transposed [C, R/2]; whether it is map-to-4, shaped as
    the grids).

    Each candidate (``enc4``/``sf4`` map-to-4, ``enc6``/``sf6`` map-to-6) is cast and its block
    errors summed as :func:`scale_and_cast_to_fp4_with_error`; with ``tile`` the 16 blocks of a 16×16
    tile add their sums in the warp's tree order (reduce_group_sum_16: shfl_down by 8, 4, 2, 1).
    Map-to-4 only where its sum is strictly lower (a NaN keeps map-to-6). Compiled on CPU, the
    one-pass C loop of ``native.scale_cast_fp4_4over6``."""
    if _c_loop_in_graph(x2):
        return native.scale_cast_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)
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
        data = native.transpose_bytes(torch.where(each.unsqueeze(1), d4, d6).reshape(r // 2, c))
    return data, pick4


def scale_and_cast_to_fp4_4over6_pair(x2: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor,
                                      enc6: torch.Tensor, sf6: torch.Tensor, amax: torch.Tensor,
                                      denom: torch.Tensor, mse: bool
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both usages of :func:`scale_and_cast_to_fp4_4over6` with 16×16 tiles (grids [R/16, C/16]):
    (rowwise codes, choices, columnwise codes, choices), each as that rule gives it. Compiled on
    CPU, ``native.scale_cast_fp4_4over6_pair``: one pass, as a tile's candidates are the same in
    both usages (only the order of the error sums differs)."""
    if _c_loop_in_graph(x2):
        return native.scale_cast_fp4_4over6_pair(x2, enc4, sf4, enc6, sf6, amax, denom, mse)
    return (*scale_and_cast_to_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, 1, True),
            *scale_and_cast_to_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, 0, True))


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: (..., n) bytes → (..., 2n) codes, each byte widened to a
    little-endian int16 holding (low nibble, high nibble) as its two bytes (no stack: fusable)."""
    p = packed.to(torch.int16).contiguous()
    return ((p & 0x0F) | ((p & 0xF0) << 4)).view(torch.uint8)


# --- shared helpers ------------------------------------------------------------------------

def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ≥ ``value``."""
    return (value + multiple - 1) // multiple * multiple


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative ints."""
    return (a + b - 1) // b


def pad_to(t: torch.Tensor, shape: tuple[int, ...], value: float = 0) -> torch.Tensor:
    """Pad a 2-D tensor at the bottom/right to ``shape`` with ``value`` (padding is zeroed)."""
    rows, cols = shape
    if (rows, cols) == tuple(t.shape):  # compiled: a guard, so block-aligned shapes (every real
        return t                         # weight) get a graph without masked loads or padded copies
    return torch.nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]), value=value)
