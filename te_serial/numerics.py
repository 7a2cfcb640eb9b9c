"""Bit-exact scalar rules of TE's quantization kernels, in pure torch (CPU and CUDA), and the cast
each format calls.

Every rule here cites the TE kernel it reproduces (paths relative to TE's repository; see
``shared/docs/te_formats.md`` section 4). All arithmetic is fp32, as in the kernels. The casts'
rules (FP8 and packed FP4 codes, 4over6, the FP8 dequantize) live in ``cast_rules``, where the
custom ops of ``kernel_ops`` fall back to them too: each cast here runs its rule, or, in a graph
that ``kernel_ops.c_loop_in_graph`` gives to the C loops, the op.
"""

from __future__ import annotations

import torch

from . import cast_rules, kernel_ops
from .cast_rules import FP8_MAX, isinf, isnan
from .tracing import tracing

FP32_MAX = torch.finfo(torch.float32).max

FP8_DTYPES = tuple(FP8_MAX)

# the casts' constants and steps that the formats reach through numerics
FP4_E2M1_VALUES = cast_rules.FP4_E2M1_VALUES
FP4_MAX = cast_rules.FP4_MAX
E2M1_STEPS = cast_rules.E2M1_STEPS
fp8_to_float = cast_rules.fp8_to_float
cast_to_fp4_codes = cast_rules.cast_to_fp4_codes
fp4_codes_to_float = cast_rules.fp4_codes_to_float
pack_fp4 = cast_rules.pack_fp4
unpack_fp4 = cast_rules.unpack_fp4


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 dtype."""
    return FP8_MAX[fp8_dtype]


def _f32(value: float, device=None) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


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


def scale_and_cast_to_fp8(x: torch.Tensor, scale: torch.Tensor | None,
                          fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bits of ``fp32(x) * scale`` (``scale`` broadcastable, fp32): the kernels' quantize step,
    ``cast_rules.scale_and_cast_to_fp8``. Compiled on CPU, the C loop of ``kernel_ops.scale_cast_fp8``
    (the same roundings, 16 lanes at a time, where torch's conversion is scalar and inductor's loop
    ran at half a plain cast's speed for E4M3 and a quarter for E5M2); elsewhere inductor's loop
    (Triton on CUDA). The eager path keeps torch's conversion, so the fused table compares the two.
    """
    if kernel_ops.c_loop_in_graph(x):
        return kernel_ops.scale_cast_fp8(x, scale, fp8_dtype)
    return cast_rules.scale_and_cast_to_fp8(x, scale, fp8_dtype)


def scale_and_cast_to_fp8_pair(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                               fp8_dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 codes of x [M, K] scaled by its 1×b blocks' ``row_scale`` [M, K/b], and by its b×1
    blocks' ``col_scale`` [M/b, K] (MXFP8's two usages): ``cast_rules.scale_and_cast_to_fp8_pair``.
    Compiled on CPU, one C loop reads x once for both (``kernel_ops.scale_cast_fp8_pair``)."""
    if kernel_ops.c_loop_in_graph(x):
        return kernel_ops.scale_cast_fp8_pair(x, row_scale, col_scale, fp8_dtype, b)
    return cast_rules.scale_and_cast_to_fp8_pair(x, row_scale, col_scale, fp8_dtype, b)


def scale_and_cast_to_fp8_transposed(x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                                     shape: tuple[int, int],
                                     keep_rows: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`scale_and_cast_to_fp8`'s codes (None without ``keep_rows``) and their row-major 2-D
    ``shape`` [M, K] transposed, [K, M]: the columnwise copy where both usages share the codes,
    or where columnwise codes are made in row order. Compiled on CPU, one C pass
    (``kernel_ops.scale_cast_fp8_transposed``: each stripe transposed while in cache); else the cast,
    then ``kernel_ops.transpose_bytes`` (``kernel_ops.scale_cast_fp8_transposed_rule``)."""
    if kernel_ops.c_loop_in_graph(x):
        return kernel_ops.scale_cast_fp8_transposed(x, scale, fp8_dtype, shape, keep_rows)
    return kernel_ops.scale_cast_fp8_transposed_rule(x, scale, fp8_dtype, shape, keep_rows)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of FP8 bits times ``scale`` (fp32, broadcastable to the bits, which keep their
    shape): every FP8 format's dequantize step, ``cast_rules.dequantize_fp8`` (torch's conversion,
    then the product in place). Compiled on CPU, the C loop of ``kernel_ops.dequantize_fp8`` (the
    same bits; NaN payloads aside)."""
    if kernel_ops.c_loop_in_graph(bits):
        return kernel_ops.dequantize_fp8(bits, scale, fp8_dtype)
    return cast_rules.dequantize_fp8(bits, scale, fp8_dtype)


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


def e8m0_from_fp4_amax(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent of an MXFP4 block of |x| maximum ``amax`` (fp32, NaN-free):
    ``127 + clamp(ceil(log2(amax / 6)), -127, 127)`` with the ceiling taken exactly.

    TE's reference (custom_recipes/reference_nvfp4.py ``cast_to_e8``, pow_2_scales) forms
    ``ceil(torch.log2(fl32(amax / 6)))``; rounding to fp32 is monotonic and keeps powers of two, so
    the exact ceiling of log2(fl32(amax / 6)) is the least k with amax ≤ 6 · 2^k: from amax's fp32
    bits, k = E − 2 (unbiased E − 127 − 2) plus one where the mantissa exceeds 1.5. No division
    (inductor may turn x / 6 into x · (1/6)) and no log2 (fp32 log2 rounds k + ε down to k for
    values a few ulps above 2^k, |k| ≥ 4, device-dependently). Subnormal or zero amax → 0 (2^−127);
    +inf → 254 (2^127, the clamp); a finite amax never exceeds 253.
    """
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)
    e = torch.clamp(exponent - 2 + up, min=0, max=254)
    return torch.where(isinf(amax.float()), torch.full_like(e, 254), e).to(torch.uint8)


# --- FP4 E2M1 (NVFP4 data) -----------------------------------------------------------------

def scale_and_cast_to_fp4(x: torch.Tensor, scale: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """E2M1 codes of ``fp32(x) * scale`` (``scale`` broadcastable, fp32) packed two per byte along
    ``dim`` (-1 or -2, :func:`pack_fp4`): NVFP4's data step, ``cast_rules.scale_and_cast_to_fp4``.
    Compiled on CPU, the C loop of ``kernel_ops.scale_cast_fp4`` (the same product and roundings, 16
    lanes at a time, packed as it goes), which the fused table compares to the rule."""
    if kernel_ops.c_loop_in_graph(x):
        return kernel_ops.scale_cast_fp4(x, scale, dim)
    return cast_rules.scale_and_cast_to_fp4(x, scale, dim)


def scale_and_cast_to_fp4_4over6(x2: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor, enc6: torch.Tensor,
                                 sf6: torch.Tensor, amax: torch.Tensor, denom: torch.Tensor, mse: bool,
                                 along: int, tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 4over6's choice for x2 [R, C] in blocks of 16 along dim ``along`` (with ``tile``, per
    16×16 tile): (codes packed along the blocks, of the candidate chosen per block or tile, as the
    usage keeps them: [R, C/16, 8], or transposed [C, R/2]; whether it is map-to-4, shaped as the
    grids), ``cast_rules.scale_and_cast_to_fp4_4over6`` with a column usage's codes transposed
    (``kernel_ops.scale_cast_fp4_4over6_rule``). Compiled on CPU, the one-pass C loop of
    ``kernel_ops.scale_cast_fp4_4over6``."""
    if kernel_ops.c_loop_in_graph(x2):
        return kernel_ops.scale_cast_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)
    return kernel_ops.scale_cast_fp4_4over6_rule(x2, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)


def scale_and_cast_to_fp4_4over6_pair(x2: torch.Tensor, enc4: torch.Tensor, sf4: torch.Tensor,
                                      enc6: torch.Tensor, sf6: torch.Tensor, amax: torch.Tensor,
                                      denom: torch.Tensor, mse: bool
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both usages of :func:`scale_and_cast_to_fp4_4over6` with 16×16 tiles (grids [R/16, C/16]):
    (rowwise codes, choices, columnwise codes, choices), each as that rule gives it. Compiled on
    CPU, ``kernel_ops.scale_cast_fp4_4over6_pair``: one pass, as a tile's candidates are the same in
    both usages (only the order of the error sums differs)."""
    if kernel_ops.c_loop_in_graph(x2):
        return kernel_ops.scale_cast_fp4_4over6_pair(x2, enc4, sf4, enc6, sf6, amax, denom, mse)
    return (*scale_and_cast_to_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, 1, True),
            *scale_and_cast_to_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, denom, mse, 0, True))


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
