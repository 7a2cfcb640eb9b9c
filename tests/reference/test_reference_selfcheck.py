"""Self-checks of the TE numerics oracle (tests/reference/te_reference.py).

These tests do not import te_serial.  Three kinds of evidence:
1. exhaustive / edge-case checks of the encoders and decoders against independent re-derivations
   (bit-field decoding, "round by quantum" encoding, ceil(log2) exponents);
2. hand-computed examples for every format and layout;
3. cross-checks against TE's own torch reference *formulas* (ref_per_tensor_cs,
   blockwise_quantizer_reference, _mxfp8_2d_quantize_reference, NVFP4QuantizerRef incl.
   cast_to_fp4x2 and _apply_rht), re-implemented here in our own words.  Those references use
   torch's float8 casts, which the oracle deliberately does not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from . import te_reference as R

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMTS = [("e4m3", E4M3, 448.0), ("e5m2", E5M2, 57344.0)]


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _wide_random_fp32(n, seed, lo_exp=-40, hi_exp=20):
    """Random fp32 values with random signs and exponents spread over [2^lo_exp, 2^hi_exp)."""
    g = _gen(seed)
    mant = 1.0 + torch.rand(n, generator=g)
    exps = torch.randint(lo_exp, hi_exp, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.pow(2.0, exps)).to(torch.float32)


# ------------------------------------------------------------------------------------------------
# Independent re-derivations used by several tests
# ------------------------------------------------------------------------------------------------

_SPEC = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}  # mantissa bits, bias, max


def _encode_by_quantum(v: float, fmt: str) -> int:
    """FP8 encode one Python float by rounding to the local quantum (Python round = half-even)."""
    mbits, bias, mx = _SPEC[fmt]
    if math.isnan(v):
        return 0x7F
    neg = math.copysign(1.0, v) < 0
    a = abs(v)
    if a == 0.0:
        mag = 0.0
    else:
        e = math.frexp(a)[1] - 1  # a in [2^e, 2^(e+1))
        e = max(e, 1 - bias)  # subnormal range shares the min-normal quantum
        quantum = 2.0 ** (e - mbits)
        mag = round(a / quantum) * quantum if a <= mx * 4 else math.inf
        mag = min(mag, mx)
    # find the code of +mag from the decode table
    table = {float(R._decode_byte_python(c, fmt)): c for c in range(0x80)}
    code = table[mag]
    return code | (0x80 if neg else 0)


def _e8m0_by_log2(amax: float, fp8_max: float) -> int:
    """E = 127 + ceil(log2(v)), v = fp32(amax * fp32(1/fp8_max)), clamped to [0, 254]; NaN 255."""
    v = float(np.float32(amax) * np.float32(1.0 / fp8_max))
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0.0:
        return 0
    f, ex = math.frexp(v)  # v = f * 2^ex, f in [0.5, 1)
    ceil_log2 = ex - 1 if f == 0.5 else ex
    return int(min(max(127 + ceil_log2, 0), 254))


def _te_style_cast_fp8(y: torch.Tensor, dtype) -> torch.Tensor:
    """What TE's torch references do: clamp to +-max, then torch's float8 cast (RNE)."""
    mx = torch.finfo(dtype).max
    return torch.clamp(y, -mx, mx).to(dtype).view(torch.uint8)


def _te_style_fp4_codes(c: torch.Tensor) -> torch.Tensor:
    """TE's cast_to_fp4x2 decision table (own formulation): interval -> code, even codes own
    their boundary points; values <= -0.25 .. < 0 are negative zero etc.  Inputs pre-clamped."""
    # (lower, upper, lower_inclusive, upper_inclusive, code) for non-negative magnitudes
    intervals = [
        (0.0, 0.25, True, True, 0),
        (0.25, 0.75, False, False, 1),
        (0.75, 1.25, True, True, 2),
        (1.25, 1.75, False, False, 3),
        (1.75, 2.5, True, True, 4),
        (2.5, 3.5, False, False, 5),
        (3.5, 5.0, True, True, 6),
        (5.0, math.inf, False, True, 7),
    ]
    out = torch.zeros_like(c, dtype=torch.uint8)
    neg = c < 0.0  # -0.0 counts as positive in TE's reference
    m = c.abs()
    for lo, hi, li, hi_inc, code in intervals:
        sel = ((m >= lo) if li else (m > lo)) & ((m <= hi) if hi_inc else (m < hi))
        out = torch.where(sel, torch.tensor(code, dtype=torch.uint8), out)
    return out | torch.where(neg, 8, 0).to(torch.uint8)


# ------------------------------------------------------------------------------------------------
# FP8 encode / decode
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_fp8_all_bytes_roundtrip(fmt, dtype, mx):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    vals = R.fp8_decode(codes, dtype)
    assert vals.dtype == torch.float32
    nan = torch.isnan(vals)
    inf = torch.isinf(vals)
    if fmt == "e4m3":
        assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
        assert not inf.any()
    else:
        assert nan.nonzero().flatten().tolist() == [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
        assert inf.nonzero().flatten().tolist() == [0x7C, 0xFC]
    finite = ~nan & ~inf
    back = R.fp8_encode(vals, dtype)
    assert torch.equal(back[finite], codes[finite])
    assert bool((back[nan] == 0x7F).all())
    # inf saturates to the largest finite code of the same sign
    if fmt == "e5m2":
        assert back[0x7C].item() == 0x7B and back[0xFC].item() == 0xFB
    # bit-field decode agrees with torch's own float8 -> float (decode only, exact)
    torch_vals = codes.view(dtype).float()
    assert torch.equal(torch.isnan(torch_vals), nan)
    assert torch.equal(vals[~nan], torch_vals[~nan])
    assert R.fp8_decode(torch.tensor([0x7E if fmt == "e4m3" else 0x7B], dtype=torch.uint8), fmt).item() == mx


def test_fp8_known_values():
    d = lambda c, f: R.fp8_decode(torch.tensor([c], dtype=torch.uint8), f).item()  # noqa: E731
    assert d(0x38, "e4m3") == 1.0 and d(0x01, "e4m3") == 2.0**-9 and d(0x08, "e4m3") == 2.0**-6
    assert d(0x07, "e4m3") == 7 * 2.0**-9 and d(0xFE, "e4m3") == -448.0
    assert d(0x3C, "e5m2") == 1.0 and d(0x01, "e5m2") == 2.0**-16 and d(0x04, "e5m2") == 2.0**-14
    assert d(0x7B, "e5m2") == 57344.0 and d(0x7C, "e5m2") == math.inf
    assert math.copysign(1.0, d(0x80, "e4m3")) < 0  # negative zero


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_fp8_ties_to_even_at_every_midpoint(fmt, dtype, mx):
    grid = R.fp8_representable_values(dtype)
    lo, hi = grid[:-1], grid[1:]
    mid = ((lo + hi) / 2).to(torch.float32)
    assert torch.equal(mid.double(), (lo + hi) / 2), "midpoints must be exact in fp32"
    codes_lo = torch.arange(grid.numel() - 1)
    expect = torch.where(codes_lo % 2 == 0, codes_lo, codes_lo + 1)
    for sign, sbit in ((1.0, 0), (-1.0, 0x80)):
        got = R.fp8_encode(sign * mid, dtype).long()
        assert torch.equal(got, expect | sbit)
        below = torch.nextafter(mid, torch.zeros_like(mid))
        above = torch.nextafter(mid, torch.full_like(mid, math.inf))
        assert torch.equal(R.fp8_encode(sign * below, dtype).long(), codes_lo | sbit)
        assert torch.equal(R.fp8_encode(sign * above, dtype).long(), (codes_lo + 1) | sbit)


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_fp8_saturation_and_specials(fmt, dtype, mx):
    top = 0x7E if fmt == "e4m3" else 0x7B
    big = torch.tensor([mx, mx * 1.01, mx * 1.5, 1e30, math.inf, torch.finfo(torch.float32).max])
    assert R.fp8_encode(big, dtype).tolist() == [top] * 6
    assert R.fp8_encode(-big, dtype).tolist() == [top | 0x80] * 6
    assert R.fp8_encode(torch.tensor([math.nan, -math.nan]), dtype).tolist() == [0x7F, 0x7F]
    # zeros and underflow keep the sign (CUDA ORs the sign into the result)
    tiny = 2.0**-10 if fmt == "e4m3" else 2.0**-17  # half the smallest subnormal: tie -> 0
    x = torch.tensor([0.0, -0.0, tiny, -tiny, 1e-30, -1e-30, tiny * 1.0000001])
    assert R.fp8_encode(x, dtype).tolist() == [0, 0x80, 0, 0x80, 0, 0x80, 1]
    # E4M3: 464 is the midpoint of 448 and 480 (not representable) -> still 448, never NaN
    if fmt == "e4m3":
        assert R.fp8_encode(torch.tensor([464.0, 479.0, 480.0]), dtype).tolist() == [0x7E] * 3


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_fp8_encode_matches_quantum_rounding_and_torch(fmt, dtype, mx):
    x = _wide_random_fp32(3000, seed=1 if fmt == "e4m3" else 2, lo_exp=-24, hi_exp=18)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, mx, -mx, 2.0**-149])
    x = torch.cat([x, specials])
    got = R.fp8_encode(x, dtype).tolist()
    expect = [_encode_by_quantum(float(v), fmt) for v in x.tolist()]
    assert got == expect
    finite = torch.isfinite(x)
    assert torch.equal(R.fp8_encode(x[finite], dtype), _te_style_cast_fp8(x[finite], dtype))


# ------------------------------------------------------------------------------------------------
# FP4 E2M1
# ------------------------------------------------------------------------------------------------


def test_fp4_codes_roundtrip_and_ties():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = R.fp4_decode(codes)
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(R.fp4_encode(vals), codes)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert R.fp4_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert R.fp4_encode(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]
    near = torch.tensor([0.2500001, 0.7499999, 5.0000005, 4.9999995, 6.5, 1e9, math.inf])
    assert R.fp4_encode(near).tolist() == [1, 1, 7, 6, 7, 7, 7]
    assert R.fp4_encode(torch.tensor([-math.inf, math.nan, -0.0, -0.1])).tolist() == [15, 7, 8, 8]


def test_fp4_pack_unpack():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)
    packed = R.fp4_pack(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x78]]  # element 2i in the low nibble
    assert torch.equal(R.fp4_unpack(packed), codes)


def test_fp4_matches_te_cast_to_fp4x2_logic():
    g = _gen(3)
    x = torch.cat(
        [
            (torch.rand(4000, generator=g) * 14 - 7),
            torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -5.0, -0.25, 0.0]),
        ]
    )
    c = torch.clamp(x, -6.0, 6.0)
    assert torch.equal(R.fp4_encode(x), _te_style_fp4_codes(c))
    # Known, deliberate differences from TE's reference table: -0.0 and NaN.
    assert R.fp4_encode(torch.tensor([-0.0])).item() == 8 and _te_style_fp4_codes(torch.tensor([-0.0])).item() == 0
    assert R.fp4_encode(torch.tensor([math.nan])).item() == 7


# ------------------------------------------------------------------------------------------------
# E8M0 and scale helpers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_e8m0_edge_cases(fmt, dtype, mx):
    flt_max = torch.finfo(torch.float32).max
    amax = torch.tensor(
        [0.0, math.nan, math.inf, flt_max, 2.0**-149, mx * 2.0**-127, mx * 2.0**-126, mx, mx * 2, mx * 0.75, 1.0],
        dtype=torch.float32,
    )
    got = R.e8m0_from_amax(amax, mx).tolist()
    assert got[:3] == [0, 0xFF, 0xFE]
    assert got[4] == 0  # deep subnormal v
    assert got[5] == 0  # v == 2^-127 exactly: subnormal with mantissa 0x400000 -> stays 0
    assert got[6] == 1  # v == 2^-126
    assert got[7] == 127 and got[8] == 128 and got[9] == 127  # exact powers of two are not bumped
    assert got == [_e8m0_by_log2(float(a), mx) for a in amax.tolist()]
    # FLT_MAX: 127 + ceil(log2(FLT_MAX / fp8_max))
    assert got[3] == 127 + math.ceil(math.log2(flt_max / mx))


def test_e8m0_bit_rule_boundaries():
    # fp8_max = 1 makes v == amax exactly, so the float_to_e8m0 bit rule is probed directly
    up = lambda v: float(np.nextafter(np.float32(v), np.float32(math.inf)))  # noqa: E731
    flt_max = float(np.finfo(np.float32).max)
    v = [2.0**-127, up(2.0**-127), 2.0**-126, up(2.0**-126), 1.0, up(1.0), 2.0**127, up(2.0**127), flt_max, 2.0**-149]
    got = R.e8m0_from_amax(torch.tensor(v, dtype=torch.float32), 1.0).tolist()
    assert got == [0, 1, 1, 2, 127, 128, 254, 254, 254, 0]


@pytest.mark.parametrize("fmt,dtype,mx", FMTS)
def test_e8m0_matches_ceil_log2_over_all_binades(fmt, dtype, mx):
    amax = _wide_random_fp32(4000, seed=4, lo_exp=-140, hi_exp=127).abs()
    got = R.e8m0_from_amax(amax, mx).tolist()
    assert got == [_e8m0_by_log2(float(a), mx) for a in amax.tolist()]


def test_e8m0_multiply_by_rcp_vs_te_test_reference_divide():
    # TE's tests/pytorch/test_mxfp8_2d_quantize.py::_float_to_e8m0 divides by 448 instead of
    # multiplying by fp32(1/448); exhaustively over one normal binade they agree.
    base = torch.tensor(448.0).view(torch.int32).item()
    a = torch.arange(base, base + (1 << 23), 7, dtype=torch.int32).view(torch.float32)
    v = (a / 448.0).view(torch.int32)
    e, m = (v >> 23) & 0xFF, v & 0x7FFFFF
    ref = (e + ((m > 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))).int()).to(torch.uint8)
    assert torch.equal(R.e8m0_from_amax(a, 448.0), ref)


def test_exp2f_rcp_and_exp2f_edges():
    e = torch.tensor([0, 1, 126, 127, 128, 253, 254, 255], dtype=torch.uint8)
    s = R.e8m0_to_scale(e)
    assert s[:7].tolist() == [2.0**127, 2.0**126, 2.0, 1.0, 0.5, 2.0**-126, 2.0**-127]
    assert s[6].view(torch.int32).item() == 0x00400000 and math.isnan(s[7].item())
    si = R.e8m0_to_scale_inv(e)
    assert si[:7].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**126, 2.0**127]
    assert math.isnan(si[7].item())
    all_e = torch.arange(255, dtype=torch.int64).to(torch.uint8)
    assert bool((R.e8m0_to_scale(all_e) * R.e8m0_to_scale_inv(all_e) == 1.0).all())


def test_compute_scale_from_amax_edges():
    flt_max = torch.finfo(torch.float32).max
    amax = torch.tensor([0.0, math.inf, math.nan, 1e-38, 448.0, 3.0, 2.0**-149])
    s = R.compute_scale_from_amax(amax, 448.0, force_pow_2_scales=False, epsilon=0.0, value_for_inf=flt_max)
    assert s[:3].tolist() == [1.0, 1.0, 1.0]
    assert s[3].item() == flt_max and s[6].item() == flt_max  # 448/tiny overflows -> FLT_MAX
    assert s[4].item() == 1.0 and s[5].item() == np.float32(448.0) / np.float32(3.0)
    p = R.compute_scale_from_amax(amax, 448.0, force_pow_2_scales=True, epsilon=0.0, value_for_inf=flt_max)
    assert p.tolist() == [1.0, 1.0, 1.0, 2.0**127, 1.0, 128.0, 2.0**127]
    b = R.compute_scale_from_amax(amax, 448.0, force_pow_2_scales=False, epsilon=0.0, value_for_inf=R.BF16_MAX)
    assert b[3].item() == R.BF16_MAX == torch.finfo(torch.bfloat16).max
    e = R.compute_scale_from_amax(torch.tensor([0.0, 0.5]), 448.0, force_pow_2_scales=False, epsilon=1.0, value_for_inf=flt_max)
    assert e.tolist() == [448.0, 448.0]  # eps floors amax (even amax == 0)


def test_bf16_round_matches_torch():
    x = torch.cat([_wide_random_fp32(5000, seed=5, lo_exp=-130, hi_exp=127), torch.tensor([math.inf, -math.inf, 0.0, -0.0])])
    assert torch.equal(R.bf16_round(x), x.to(torch.bfloat16).float())
    assert math.isnan(R.bf16_round(torch.tensor([math.nan])).item())


# ------------------------------------------------------------------------------------------------
# Per-tensor FP8
# ------------------------------------------------------------------------------------------------


def test_float8_current_hand_example():
    x = torch.tensor([[0.5, -1.0], [2.0, 4.0]])
    b = R.ref_float8_current(x, E4M3)
    assert set(b) == {"_data", "_transpose", "_scale_inv"}
    # amax 4 -> scale 448/4 = 112; scaled values 56, -112, 224, 448
    assert b["_data"].tolist() == [[0x66, 0xEE], [0x76, 0x7E]]
    assert b["_transpose"].tolist() == [[0x66, 0x76], [0xEE, 0x7E]]
    assert b["_scale_inv"].dtype == torch.float32 and b["_scale_inv"].shape == (1,)
    assert b["_scale_inv"].item() == np.float32(1) / np.float32(112)
    p = R.ref_float8_current(x, E4M3, force_pow_2_scales=True, rowwise=False)
    assert set(p) == {"_transpose", "_scale_inv"} and p["_scale_inv"].item() == 1 / 64.0
    assert R.ref_float8_current(x, E4M3, columnwise=False).keys() == {"_data", "_scale_inv"}


def test_float8_current_nan_inf_zero():
    x = torch.tensor([[1.0, math.nan], [-3.0, 2.0]])
    b = R.ref_float8_current(x, E4M3)
    assert b["_scale_inv"].item() == np.float32(1) / (np.float32(448) / np.float32(3))  # NaN ignored
    assert b["_data"][0, 1].item() == 0x7F and b["_data"][1, 0].item() == 0xFE
    bi = R.ref_float8_current(torch.tensor([1.0, math.inf, -2.0]), E5M2)
    assert bi["_scale_inv"].item() == 1.0 and bi["_data"].tolist() == [0x3C, 0x7B, 0xC0]
    bz = R.ref_float8_current(torch.zeros(3, 5), E4M3)
    assert bz["_scale_inv"].item() == 1.0 and not bz["_data"].any()
    ball_nan = R.ref_float8_current(torch.full((2, 2), math.nan), E4M3)
    assert ball_nan["_scale_inv"].item() == 1.0 and bool((ball_nan["_data"] == 0x7F).all())


def test_float8_current_nd_and_te_style_reference():
    g = _gen(6)
    x = (torch.randn(3, 5, 40, generator=g) * 7).to(torch.bfloat16)
    for dtype in (E4M3, E5M2):
        for pow2 in (False, True):
            b = R.ref_float8_current(x, dtype, force_pow_2_scales=pow2)
            assert b["_data"].shape == (3, 5, 40) and b["_transpose"].shape == (40, 3, 5)
            assert torch.equal(b["_transpose"], b["_data"].movedim(-1, 0).contiguous())
            # TE ref_per_tensor_cs formula: amax, scale = max/amax (fp32), pow2 by frexp, clamp+cast
            xf = x.float()
            amax = xf.abs().max()
            scale = torch.div(torch.finfo(dtype).max, amax)
            if pow2:
                _, ex = torch.frexp(scale)
                scale = torch.ldexp(torch.tensor(1.0), ex - 1)
            assert b["_scale_inv"].item() == torch.reciprocal(scale).item()
            assert torch.equal(b["_data"], _te_style_cast_fp8(xf * scale, dtype))
            dq = R.ref_dequantize("float8", b, x.shape, fp8_dtype=dtype)
            dq_t = R.ref_dequantize("float8", {k: v for k, v in b.items() if k != "_data"}, x.shape, fp8_dtype=dtype)
            assert torch.equal(dq, dq_t)
            _assert_nearest(xf * scale, R.fp8_decode(b["_data"], dtype), dtype)
            assert bool(((dq - xf).abs() <= 2.0 ** -(4 if dtype is E4M3 else 3) * xf.abs() + 2.0**-17 / scale).all())


def test_float8_delayed():
    x = torch.tensor([[1000.0, -0.5, 3.0]])
    b = R.ref_float8_delayed(x, 2.0, E4M3)
    assert b["_data"].tolist() == [[0x7E, 0xB8, 0x4C]] and b["_scale_inv"].item() == 0.5
    assert b["_transpose"].shape == (3, 1)
    b3 = R.ref_float8_delayed(x, 3.0, E5M2, columnwise=False)
    assert set(b3) == {"_data", "_scale_inv"} and b3["_scale_inv"].item() == np.float32(1) / np.float32(3)


def _assert_nearest(y: torch.Tensor, q: torch.Tensor, dtype):
    """q must be a nearest representable value of the scaled input y (saturating)."""
    grid = R.fp8_representable_values(dtype).float()
    mx = grid[-1]
    ya = y.abs().clamp(max=mx).flatten()
    dist = (ya[:, None] - grid[None, :]).abs().min(dim=1).values
    err = (ya - q.abs().flatten()).abs()
    ok = torch.isnan(y.flatten()) | (err <= dist)
    assert bool(ok.all()), "quantized value is not a nearest grid point"


# ------------------------------------------------------------------------------------------------
# MXFP8
# ------------------------------------------------------------------------------------------------


def test_mxfp8_hand_example():
    x = torch.zeros(32, 64)
    x[0, :32] = 1.0  # rowwise block (0,0): amax 1 -> E = 119 (2^-8 >= 1/448 > 2^-9), scale 256
    x[5, 40] = -448.0  # row 5 block 1 amax 448 -> E = 127
    b = R.ref_mxfp8(x, E4M3)
    rs = b["_rowwise_scale_inv"]
    assert rs.shape == (128, 4) and rs.dtype == torch.uint8
    assert rs[0, 0].item() == 119 and rs[5, 1].item() == 127 and rs[1, 0].item() == 0
    assert b["_rowwise_data"][0, 0].item() == 0x78  # 1 * 256 = 2^8
    assert b["_rowwise_data"][5, 40].item() == 0xFE
    assert not rs[32:].any() and not rs[:, 2:].any()  # padding zero
    cs = b["_columnwise_scale_inv"]
    assert cs.shape == (4, 128) and cs[0, 0].item() == 119 and cs[0, 40].item() == 127
    assert not cs[1:].any() and not cs[:, 64:].any()
    assert b["_columnwise_data"].shape == (32, 64)
    # all-zero block: E = 0, scale 2^127, data 0
    assert rs[2, 0].item() == 0 and b["_rowwise_data"][2, 0].item() == 0


def test_mxfp8_nan_inf_and_layouts():
    g = _gen(7)
    x = torch.randn(64, 96, generator=g)
    x[3, 5] = math.nan
    x[40, 70] = math.inf
    b = R.ref_mxfp8(x, E5M2)
    x_no = x.clone()
    x_no[3, 5] = 0.0
    b_no = R.ref_mxfp8(x_no, E5M2)
    assert torch.equal(b["_rowwise_scale_inv"], b_no["_rowwise_scale_inv"])  # NaN ignored in amax
    assert b["_rowwise_data"][3, 5].item() == 0x7F and b["_columnwise_data"][3, 5].item() == 0x7F
    assert b["_rowwise_scale_inv"][40, 2].item() == 0xFE and b["_columnwise_scale_inv"][1, 70].item() == 0xFE
    assert b["_rowwise_data"][40, 70].item() == 0x7B  # inf * 2^-127 = inf -> saturate
    blk = b["_rowwise_data"][40, 64:96]
    assert bool(((blk & 0x7F) == 0)[torch.arange(32) != 6].all())  # the rest flushes to +-0
    # columnwise == rowwise quantization of the transpose, transposed back
    bt = R.ref_mxfp8(x.t().contiguous(), E5M2)
    assert torch.equal(b["_columnwise_data"], bt["_rowwise_data"].t())
    assert torch.equal(b["_columnwise_scale_inv"][:2, :96], bt["_rowwise_scale_inv"][:96, :2].t())


def test_mxfp8_2d_and_te_2d_reference():
    g = _gen(8)
    x = (torch.randn(96, 64, generator=g) * torch.logspace(-3, 3, 64)).to(torch.bfloat16)
    b = R.ref_mxfp8(x, E4M3, with_2d_quantization=True)
    assert torch.equal(b["_rowwise_data"], b["_columnwise_data"])
    rs, cs = b["_rowwise_scale_inv"][:96, :2], b["_columnwise_scale_inv"][:3, :64]
    # TE's _mxfp8_2d_quantize_reference formula, re-derived: 32x32 amax, e8m0 by division,
    # data = cast(x / 2^(E-127)), scales repeated along rows / columns
    xf = x.float()
    tiles = xf.view(3, 32, 2, 32).permute(0, 2, 1, 3)
    amax = tiles.abs().amax(dim=(-1, -2))
    v = (amax / 448.0).contiguous().view(torch.int32)
    e, m = (v >> 23) & 0xFF, v & 0x7FFFFF
    E = (e + ((m > 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))).int())
    E = torch.where(amax == 0, 0, E).to(torch.uint8)
    assert torch.equal(rs, E.repeat_interleave(32, dim=0)) and torch.equal(cs, E.repeat_interleave(32, dim=1))
    scaled = tiles / torch.pow(2.0, E.float() - 127)[:, :, None, None]
    data = _te_style_cast_fp8(scaled, E4M3).view(3, 2, 32, 32).permute(0, 2, 1, 3).reshape(96, 64)
    assert torch.equal(b["_rowwise_data"], data)


def test_mxfp8_1d_vs_division_reference_and_dequant():
    g = _gen(9)
    x = torch.randn(2, 32, 128, generator=g) * 100
    for dtype in (E4M3, E5M2):
        b = R.ref_mxfp8(x, dtype)
        assert b["_rowwise_data"].shape == (2, 32, 128) and b["_rowwise_scale_inv"].shape == (128, 4)
        assert b["_columnwise_scale_inv"].shape == (4, 128)
        x2 = x.reshape(64, 128)
        E = b["_rowwise_scale_inv"][:64, :4]
        scaled = x2 / torch.pow(2.0, E.float() - 127).repeat_interleave(32, dim=1)
        assert torch.equal(b["_rowwise_data"].reshape(64, 128), _te_style_cast_fp8(scaled, dtype))
        dq = R.ref_dequantize("mxfp8", b, x.shape, fp8_dtype=dtype)
        dqc = R.ref_dequantize("mxfp8", {k: v for k, v in b.items() if k.startswith("_col")}, x.shape, fp8_dtype=dtype)
        # within half a format ULP at each block's scale: relative 2^-4 (E4M3) / 2^-3 (E5M2) in
        # the normal range, half the smallest subnormal times the block scale_inv below it
        rel, half_sub = (2.0**-4, 2.0**-10) if dtype is E4M3 else (2.0**-3, 2.0**-17)
        sinv_r = R.e8m0_to_scale_inv(E).repeat_interleave(32, dim=1)
        Ec = b["_columnwise_scale_inv"][:2, :128]
        sinv_c = R.e8m0_to_scale_inv(Ec).repeat_interleave(32, dim=0)
        for d, sinv in ((dq, sinv_r), (dqc, sinv_c)):
            err = (d.reshape(64, 128) - x2).abs()
            assert bool((err <= torch.maximum(rel * x2.abs(), half_sub * sinv)).all())


def test_mxfp8_shape_errors():
    with pytest.raises(ValueError):
        R.ref_mxfp8(torch.zeros(16, 64), E4M3)
    with pytest.raises(ValueError):
        R.ref_mxfp8(torch.zeros(64, 48), E4M3)


# ------------------------------------------------------------------------------------------------
# Blockwise FP8
# ------------------------------------------------------------------------------------------------


def test_blockwise_2d_hand_example_and_padding():
    x = torch.zeros(130, 260)
    x[0, 0] = 3.0  # tile (0,0) amax 3 -> scale 448/3 -> pow2 128 -> 3*128 = 384 -> 0x7C
    x[129, 259] = -0.001  # partial tile (1,2): amax of existing elements only
    b = R.ref_blockwise(x, E4M3)
    rs, cs = b["_rowwise_scale_inv"], b["_columnwise_scale_inv"]
    assert rs.shape == (2, 4) and cs.shape == (3, 4) and rs.dtype == torch.float32
    assert rs[0, 0].item() == 1 / 128.0 and b["_rowwise_data"][0, 0].item() == 0x7C
    s12 = R.compute_scale_from_amax(torch.tensor(0.001), 448.0, force_pow_2_scales=True, epsilon=0.0, value_for_inf=R.FLT_MAX)
    assert rs[1, 2].item() == 1.0 / s12.item() and rs[0, 1].item() == 1.0  # empty tile -> scale 1
    assert rs[:, 3].tolist() == [0.0, 0.0] and cs[:, 2:].abs().sum().item() == 0.0  # zero padding
    assert torch.equal(cs[:, :2], rs[:, :3].t())
    assert b["_columnwise_data"].shape == (260, 130)
    assert torch.equal(b["_columnwise_data"], b["_rowwise_data"].t())


def test_blockwise_inf_scale_uses_input_dtype_max():
    # 448 / amax overflows fp32 -> scale = TypeInfo<IType>::max_finite_value (input dtype's max)
    for dtype, vmax in ((torch.float32, R.FLT_MAX), (torch.bfloat16, R.BF16_MAX)):
        xi = torch.full((4, 8), 1e-38).to(dtype)
        b = R.ref_blockwise(xi, E4M3, force_pow_2_scales=False)
        assert b["_rowwise_scale_inv"][0, 0].item() == float(np.float32(1) / np.float32(vmax))
        bp = R.ref_blockwise(xi, E4M3)  # pow2 (default): mask of the cap -> 2^127
        assert bp["_rowwise_scale_inv"][0, 0].item() == 2.0**-127
    # fp16 input: 448 / 2^-24 = 7.5e9 is finite, so the cap is not hit; check the cap directly
    s = R.compute_scale_from_amax(torch.tensor(1e-38), 448.0, force_pow_2_scales=True, epsilon=0.0, value_for_inf=R._input_value_for_inf(torch.float16))
    assert s.item() == 2.0**15 and R._input_value_for_inf(torch.float16) == 65504.0
    # per-tensor current scaling uses FLT_MAX regardless of the input dtype
    bc = R.ref_float8_current(torch.full((4, 8), 1e-38).to(torch.bfloat16), E4M3)
    assert bc["_scale_inv"].item() == float(np.float32(1) / np.float32(R.FLT_MAX))


def test_blockwise_1d_layout_and_te_style_reference():
    g = _gen(10)
    x = (torch.randn(3, 70, 300, generator=g) * torch.logspace(-2, 2, 300)).to(torch.bfloat16)
    x[0, 0, 0] = math.nan
    M, K = 210, 300
    b = R.ref_blockwise(x, E4M3, block_scaling_dim=1)
    assert b["_rowwise_data"].shape == (3, 70, 300) and b["_rowwise_scale_inv"].shape == (3, 212)
    assert b["_columnwise_data"].shape == (300, 3, 70) and b["_columnwise_scale_inv"].shape == (2, 300)
    assert not b["_rowwise_scale_inv"][:, 210:].any()
    assert b["_rowwise_data"][0, 0, 0].item() == 0x7F
    # TE blockwise_quantizer_reference formula (pow2 via frexp, zero padding, clamp + cast)
    xf = x.float().reshape(M, K).nan_to_num(0.0)
    def te_ref_rows(t):
        R_, C = t.shape
        pad = torch.nn.functional.pad(t, (0, (128 - C % 128) % 128)).view(R_, -1, 128)
        amax = pad.abs().amax(-1, keepdim=True)
        sc = torch.div(448.0, amax)
        sc = torch.where(sc == math.inf, torch.finfo(torch.bfloat16).max, sc)
        _, ex = torch.frexp(sc)
        sc = torch.ldexp(torch.ones_like(sc), ex - 1)
        sc = torch.where(amax == 0, 1.0, sc)
        q = _te_style_cast_fp8(pad * sc, E4M3).reshape(R_, -1)[:, :C]
        return q, torch.reciprocal(sc).squeeze(-1)
    q, si = te_ref_rows(xf)
    rd = b["_rowwise_data"].reshape(M, K).clone()
    rd[0, 0] = 0  # the NaN element (TE ref here would see 0)
    assert torch.equal(rd, q)
    assert torch.equal(b["_rowwise_scale_inv"][:, :M], si.t())
    qt, sit = te_ref_rows(xf.t().contiguous())
    cd = b["_columnwise_data"].reshape(K, M).clone()
    cd[0, 0] = 0
    assert torch.equal(cd, qt) and torch.equal(b["_columnwise_scale_inv"][:, :K], sit.t())
    xr = x.float().reshape(M, K)
    sinv_row = b["_rowwise_scale_inv"][:, :M].t().repeat_interleave(128, 1)[:, :K]
    sinv_col = b["_columnwise_scale_inv"][:, :K].repeat_interleave(128, 0)[:M, :]
    for bb, sinv in ((b, sinv_row), ({k: v for k, v in b.items() if k.startswith("_col")}, sinv_col)):
        dq = R.ref_dequantize("blockwise", bb, x.shape, fp8_dtype=E4M3, block_scaling_dim=1).reshape(M, K)
        # half an E4M3 ULP: 2^-4 relative (normal range) or 2^-10 * scale_inv (subnormal range)
        ok = (dq - xr).abs() <= torch.maximum(2.0**-4 * xr.abs(), 2.0**-10 * sinv)
        assert bool(ok.reshape(-1)[1:].all()) and math.isnan(dq.reshape(-1)[0].item())


def test_blockwise_2d_dequant_and_nd():
    g = _gen(11)
    x = torch.randn(2, 100, 150, generator=g) * 50
    b = R.ref_blockwise(x, E5M2, force_pow_2_scales=False, amax_epsilon=1e-3)
    assert b["_rowwise_scale_inv"].shape == (2, 4) and b["_columnwise_scale_inv"].shape == (2, 4)
    assert b["_columnwise_data"].shape == (150, 2, 100)
    d1 = R.ref_dequantize("blockwise", b, x.shape, fp8_dtype=E5M2)
    d2 = R.ref_dequantize("blockwise", {k: v for k, v in b.items() if k.startswith("_col")}, x.shape, fp8_dtype=E5M2)
    assert torch.equal(d1, d2) and bool(((d1 - x).abs() <= 2.0**-3 * x.abs()).all())
    only_row = R.ref_blockwise(x, E5M2, columnwise=False)
    assert set(only_row) == {"_rowwise_data", "_rowwise_scale_inv"}
    one = R.ref_blockwise(torch.tensor([5.0]), E4M3, block_scaling_dim=1)
    assert one["_rowwise_scale_inv"].shape == (1, 4) and one["_columnwise_data"].shape == (1,)


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------


def _te_style_nvfp4_rows(x: torch.Tensor, vec_max: torch.Tensor, global_amax: torch.Tensor):
    """NVFP4QuantizerRef._quantize_blockwise_reference (1x16 / 16x16 amax given), own words."""
    s_enc = torch.div(448.0 * 6.0, global_amax)
    s_enc = torch.min(s_enc, torch.tensor(torch.finfo(torch.float32).max))
    s_enc = torch.where(s_enc == 0, 1.0, s_enc)
    s_dec = torch.div(1.0, s_enc)
    dec = vec_max * (s_enc * torch.reciprocal(torch.tensor(6.0)))
    dec = torch.clamp(torch.min(dec, torch.tensor(torch.finfo(torch.float32).max)), -448, 448)
    dec8 = dec.to(E4M3)
    enc = torch.min(torch.div(1.0, dec8.float() * s_dec), torch.tensor(torch.finfo(torch.float32).max))
    c = torch.clamp(x * enc.repeat_interleave(16, dim=1), -6, 6)
    return R.fp4_pack(_te_style_fp4_codes(c)), dec8.view(torch.uint8)


def _nvfp4_dequant_scale(sb: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return R.fp8_decode(sb.contiguous(), "e4m3") * amax.float().reshape(()) / 2688.0


def test_nvfp4_hand_example():
    x = torch.zeros(16, 32)
    x[0, :8] = torch.tensor([6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    x[1, 16:18] = torch.tensor([3.0, -0.75])  # block amax 3 -> s_b = 224 (0x76), enc = 2
    b = R.ref_nvfp4(x)
    assert b["_amax_rowwise"].item() == 6.0 and b["_amax_columnwise"].item() == 6.0
    rs = b["_rowwise_scale_inv"]
    assert rs.shape == (128, 4) and rs[0, 0].item() == 0x7E and rs[1, 1].item() == 0x76
    assert rs[2, 0].item() == 0 and not rs[16:].any() and not rs[:, 2:].any()
    assert b["_rowwise_data"][0, :4].tolist() == [0xF7, 0x21, 0x43, 0x65]  # (6,-6),(0.5,1),(1.5,2),(3,4)
    assert b["_rowwise_data"][1, 8].item() == 0xB7  # 3*2 = 6 -> 7 (low); -0.75*2 = -1.5 -> 0xB (high)
    assert b["_rowwise_data"].shape == (16, 16) and b["_columnwise_data"].shape == (32, 8)
    assert b["_columnwise_scale_inv"].shape == (128, 4)
    dq = R.ref_dequantize("nvfp4", b, x.shape)
    assert torch.allclose(dq, x, rtol=1e-6, atol=0)


def test_nvfp4_1d_vs_te_reference_and_columnwise():
    g = _gen(12)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(64, 80, generator=g) * torch.logspace(-4, 2, 80)).to(dtype)
        b = R.ref_nvfp4(x)
        xf = x.float()
        amax = xf.abs().max().reshape(1)
        assert torch.equal(b["_amax_rowwise"], amax) and torch.equal(b["_amax_columnwise"], amax)
        vec = xf.view(64, 5, 16).abs().amax(-1)
        d, s = _te_style_nvfp4_rows(xf, vec, amax)
        assert torch.equal(b["_rowwise_data"], d) and torch.equal(b["_rowwise_scale_inv"][:64, :5], s)
        xt = xf.t().contiguous()
        dt, st = _te_style_nvfp4_rows(xt, xt.view(80, 4, 16).abs().amax(-1), amax)
        assert torch.equal(b["_columnwise_data"], dt) and torch.equal(b["_columnwise_scale_inv"][:80, :4], st)
        assert not b["_columnwise_scale_inv"][80:].any() and not b["_columnwise_scale_inv"][:, 4:].any()
        d_row = _nvfp4_dequant_scale(b["_rowwise_scale_inv"][:64, :5], amax).repeat_interleave(16, 1)
        d_col = _nvfp4_dequant_scale(b["_columnwise_scale_inv"][:80, :4], amax).repeat_interleave(16, 1).t()
        for bb, d in ((b, d_row), ({k: v for k, v in b.items() if "columnwise" in k}, d_col)):
            dq = R.ref_dequantize("nvfp4", bb, x.shape)
            assert dq.shape == x.shape and bool(torch.isfinite(dq).all())
            # |x - dq| <= half the widest E2M1 gap (1) times the block's dequant scale d, plus
            # whatever saturation at 6*d cut off (the E4M3 block scale may round down)
            bound = d * 1.0 + (xf.abs() - 6.0 * d).clamp(min=0)
            assert bool(((dq - xf).abs() <= bound * (1 + 1e-5)).all())


def test_nvfp4_2d_tiles_and_transpose():
    g = _gen(13)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-1, 1, 64)
    b = R.ref_nvfp4(x, with_2d_quantization=True)
    rs = b["_rowwise_scale_inv"][:48, :4]
    assert torch.equal(rs, rs[::16].repeat_interleave(16, 0))  # 16 rows share one tile scale
    cs = b["_columnwise_scale_inv"][:64, :3]
    assert torch.equal(cs, rs[::16].t().repeat_interleave(16, 0))
    codes = R.fp4_unpack(b["_rowwise_data"])
    assert torch.equal(R.fp4_unpack(b["_columnwise_data"]), codes.t())  # lossless nibble transpose
    tile = x.view(3, 16, 4, 16).abs().amax(dim=(1, 3))
    d, s = _te_style_nvfp4_rows(x, tile.repeat_interleave(16, 0), x.abs().max())
    assert torch.equal(b["_rowwise_data"], d) and torch.equal(rs, s)


def test_nvfp4_specials():
    x = torch.zeros(16, 16)
    x[0, 0], x[0, 1], x[1, 0] = math.nan, 1.0, math.inf
    b = R.ref_nvfp4(x)
    assert b["_amax_rowwise"].item() == math.inf
    # amax inf -> S_enc = 1 -> block with inf: s_b = 448 (via fminf), enc = 1/448
    assert b["_rowwise_scale_inv"][1, 0].item() == 0x7E
    assert (b["_rowwise_data"][1, 0].item() & 0xF) == 0x7
    # NaN element: ignored by the amax, encodes as +6 (code 7)
    assert (b["_rowwise_data"][0, 0].item() & 0xF) == 0x7
    z = R.ref_nvfp4(torch.zeros(32, 16))
    assert z["_amax_rowwise"].item() == 0.0 and not z["_rowwise_data"].any() and not z["_rowwise_scale_inv"].any()
    # a block whose E4M3 scale underflows to 0: enc = FLT_MAX, elements saturate, dequant to 0
    u = torch.zeros(16, 32)
    u[0, 0] = 1000.0
    u[0, 16] = 1e-4
    bu = R.ref_nvfp4(u)
    assert bu["_rowwise_scale_inv"][0, 1].item() == 0 and (bu["_rowwise_data"][0, 8].item() & 0xF) == 7
    assert R.ref_dequantize("nvfp4", bu, u.shape)[0, 16].item() == 0.0


def test_nvfp4_rht_matches_te_apply_rht_formula():
    g = _gen(14)
    x = (torch.randn(64, 48, generator=g) * 3).to(torch.bfloat16)
    for signs in (True, False):
        b = R.ref_nvfp4(x, with_rht=True, with_post_rht_amax=True, with_random_sign_mask=signs)
        # TE NVFP4QuantizerRef._apply_rht: (x^T).view(-1, 16) @ (sign_mat @ H * 1/4) in bf16
        h = torch.ones(1, 1)
        while h.shape[0] < 16:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        s = torch.tensor(R._WGRAD_SIGNS if signs else [1] * 16, dtype=torch.float32)
        mat = ((torch.diag(s) @ h) * 0.25).to(torch.bfloat16)
        y = (x.t().contiguous().view(-1, 16) @ mat).view(48, 64)
        y_or = R.apply_rht_bf16(x.float().t().contiguous(), signs)
        assert torch.equal(y.float(), y_or)
        amax_c = y.float().abs().max().reshape(1)
        assert torch.equal(b["_amax_columnwise"], amax_c)
        assert torch.equal(b["_amax_rowwise"], x.float().abs().max().reshape(1))
        d, sc = _te_style_nvfp4_rows(y.float(), y.float().view(48, 4, 16).abs().amax(-1), amax_c)
        assert torch.equal(b["_columnwise_data"], d) and torch.equal(b["_columnwise_scale_inv"][:48, :4], sc)
        # rowwise is the plain (non-RHT) quantization
        assert torch.equal(b["_rowwise_data"], R.ref_nvfp4(x)["_rowwise_data"])
    # orthogonality: R R^T = I
    m = R.rht_matrix(True)
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    # the inverse (te-serial's rule): exact 16-term sums rounded once to fp32, checked with fractions
    col = {k: v for k, v in b.items() if "columnwise" in k}
    got = R.ref_dequantize("nvfp4", col, x.shape, with_rht=True, with_random_sign_mask=signs)
    rht_domain = R.ref_dequantize("nvfp4", col, x.shape).t().reshape(-1, 16)
    assert torch.equal(got.t().reshape(-1, 16), exact_inverse_rht(rht_domain, R.rht_matrix(signs)))


def exact_inverse_rht(v: torch.Tensor, rm: torch.Tensor) -> torch.Tensor:
    """fp32 of the exact sums sum_i v[g, i] * rm[j, i] (finite v), in Python fractions."""
    from fractions import Fraction
    r = [[Fraction(float(e)) for e in row] for row in rm.tolist()]
    out = []
    for group in v.double().tolist():
        fv = [Fraction(e) for e in group]
        for j in range(16):
            exact = sum(a * b for a, b in zip(fv, r[j]))
            assert Fraction(float(exact)) == exact  # exact in float64, so one rounding to fp32 below
            out.append(float(exact))
    return torch.tensor(out, dtype=torch.float64).to(torch.float32).reshape(v.shape)


def test_nvfp4_shapes_and_errors():
    x = torch.randn(2, 16, 32)
    b = R.ref_nvfp4(x)
    assert b["_rowwise_data"].shape == (2, 16, 16)
    assert b["_columnwise_data"].shape == (32, 2, 8)  # Python spec: (S[-1], *S[:-1]) last halved
    assert b["_rowwise_scale_inv"].shape == (128, 4) and b["_columnwise_scale_inv"].shape == (128, 4)
    b2 = R.ref_nvfp4(x, columnwise_data_2d=True)
    assert b2["_columnwise_data"].shape == (32, 16)
    assert torch.equal(b2["_columnwise_data"].reshape(-1), b["_columnwise_data"].reshape(-1))
    only_col = R.ref_nvfp4(x, rowwise=False)
    assert set(only_col) == {"_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise"}
    with pytest.raises(ValueError):
        R.ref_nvfp4(torch.zeros(16, 3, 16))  # odd S[-2]: the Python spec cannot hold the bytes
    with pytest.raises(ValueError):
        R.ref_nvfp4(torch.zeros(8, 16))
    with pytest.raises(ValueError):
        R.ref_nvfp4(torch.zeros(16, 16), with_rht=True, with_post_rht_amax=True)  # fp32 input
    with pytest.raises(ValueError):
        R.ref_nvfp4(torch.zeros(16, 16, dtype=torch.bfloat16), with_rht=True)


def test_global_encode_scale_edges():
    a = torch.tensor([0.0, math.inf, 6.0, 1e-38, 2688.0])
    s = R.nvfp4_global_encode_scale(a)
    assert s.tolist()[:3] == [1.0, 1.0, 448.0] and s[3].item() == R.FLT_MAX and s[4].item() == 1.0
