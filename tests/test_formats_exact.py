"""Bit-exactness of every format against the independent oracle in tests/reference.

The eager path (tests/test_fused.py runs the compiled path against the same table). Every
format × usage × FP8 dtype × input dtype, on 2-D and 3-D shapes (blockwise and per-tensor
also on shapes that are not multiples of the block), on random, all-zero, tiny, outlier-heavy
and inf/NaN inputs: each buffer's bytes must equal the oracle's, and dequantize must equal the
oracle's dequantize and stay within the format's error bound.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import te_serial as ts
from te_serial.formats import fused
from reference import mxfp4_reference as mx_ref
from reference import te_reference as ref
from helpers import INPUT_KINDS, assert_same_buffers, make_input, same_values

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
USAGES = {"row": (True, False), "col": (False, True), "both": (True, True)}


def _case_list():
    cases = []
    for fp8 in (E4M3, E5M2):
        for pow2 in (False, True):
            cases.append((f"fp8cs-{fp8}-pow2={pow2}", "float8",
                          lambda r, c, fp8=fp8, pow2=pow2: ts.Float8CurrentScalingQuantizer(
                              fp8, rowwise=r, columnwise=c, force_pow_2_scales=pow2),
                          lambda x, r, c, fp8=fp8, pow2=pow2: ref.ref_float8_current(
                              x, fp8, rowwise=r, columnwise=c, force_pow_2_scales=pow2),
                          [(37, 53), (3, 5, 70), (128, 256)]))
        cases.append((f"fp8cs-eps-{fp8}", "float8",
                      lambda r, c, fp8=fp8: ts.Float8CurrentScalingQuantizer(
                          fp8, rowwise=r, columnwise=c, amax_epsilon=1e-3),
                      lambda x, r, c, fp8=fp8: ref.ref_float8_current(
                          x, fp8, rowwise=r, columnwise=c, amax_epsilon=1e-3),
                      [(37, 53)]))
        cases.append((f"fp8delayed-{fp8}", "float8",
                      lambda r, c, fp8=fp8: ts.Float8Quantizer(3.5, 0.0, fp8, rowwise=r, columnwise=c),
                      lambda x, r, c, fp8=fp8: ref.ref_float8_delayed(x, 3.5, fp8, rowwise=r, columnwise=c),
                      [(37, 53), (2, 4, 6)]))
        for two_d in (False, True):
            cases.append((f"mxfp8-{fp8}-2d={two_d}", "mxfp8",
                          lambda r, c, fp8=fp8, two_d=two_d: ts.MXFP8Quantizer(
                              fp8, rowwise=r, columnwise=c, with_2d_quantization=two_d),
                          lambda x, r, c, fp8=fp8, two_d=two_d: ref.ref_mxfp8(
                              x, fp8, rowwise=r, columnwise=c, with_2d_quantization=two_d),
                          [(64, 96), (2, 32, 64), (160, 32)]))
        for dim in (1, 2):
            for pow2 in (True, False):
                cases.append((f"block{dim}d-{fp8}-pow2={pow2}", "blockwise",
                              lambda r, c, fp8=fp8, dim=dim, pow2=pow2: ts.Float8BlockQuantizer(
                                  fp8, rowwise=r, columnwise=c, block_scaling_dim=dim,
                                  force_pow_2_scales=pow2),
                              lambda x, r, c, fp8=fp8, dim=dim, pow2=pow2: ref.ref_blockwise(
                                  x, fp8, rowwise=r, columnwise=c, block_scaling_dim=dim,
                                  force_pow_2_scales=pow2),
                              [(200, 300), (2, 65, 130), (128, 128), (1, 7)]))
    for two_d in (False, True):
        cases.append((f"nvfp4-2d={two_d}", "nvfp4",
                      lambda r, c, two_d=two_d: ts.NVFP4Quantizer(
                          rowwise=r, columnwise=c, with_2d_quantization=two_d),
                      lambda x, r, c, two_d=two_d: ref.ref_nvfp4(
                          x, rowwise=r, columnwise=c, with_2d_quantization=two_d),
                      [(32, 48), (2, 16, 32), (144, 160)]))
    return cases


CASES = _case_list()
PARAMS = [pytest.param(case, shape, usage, id=f"{case[0]}-{'x'.join(map(str, shape))}-{usage}")
          for case in CASES for shape in case[4] for usage in USAGES]


@pytest.mark.parametrize("case,shape,usage", PARAMS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bytes_equal_oracle(case, shape, usage, in_dtype):
    name, fmt, make_q, make_ref, _ = case
    r, c = USAGES[usage]
    q = make_q(r, c)
    for kind in INPUT_KINDS:
        x = make_input(kind, shape, in_dtype, seed=hash((name, shape)) % 1000)
        t = q.quantize(x, eager=True)  # the eager path; tests/test_fused.py checks the compiled one
        where = f"{name} {shape} {usage} {in_dtype} {kind}"
        want = make_ref(x, r, c)
        assert_same_buffers(t.buffers(), want, where)
        # our dequantize equals the oracle's dequantize of the same buffers, bit for bit
        fields = {f: getattr(q, f) for f in ("fp8_dtype", "block_scaling_dim", "with_rht")
                  if hasattr(q, f)}
        dq = t.dequantize(torch.float32, eager=True)
        want_dq = ref.ref_dequantize(fmt, want, tuple(shape), **fields)
        assert same_values(dq, want_dq.float()), where


def _error_bound(fmt: str, q, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for finite, unsaturated inputs."""
    a = x.float().abs()
    m, k = a.reshape(-1, a.shape[-1]).shape
    a2 = a.reshape(m, k)
    if fmt == "nvfp4":
        block = a2.reshape(m, k // 16, 16).amax(-1, keepdim=True).expand(m, k // 16, 16).reshape(m, k)
        return (0.3 * a2 + 0.1 * block).reshape(x.shape)
    rel = 2.0 ** -4 if q.fp8_dtype == E4M3 else 2.0 ** -3
    floor = 2.0 ** -17 if q.fp8_dtype == E4M3 else 2.0 ** -31
    if fmt == "float8":
        block = a2.amax().expand(m, k)
    elif fmt == "mxfp8":
        block = a2.reshape(m, k // 32, 32).amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k)
        block = torch.maximum(block, a2.reshape(m // 32, 32, k).amax(1, keepdim=True).expand(m // 32, 32, k).reshape(m, k))
        if q.with_2d_quantization:
            block = block.new_full(block.shape, float(a2.max()))
    else:
        block = a2.amax().expand(m, k)  # loose: any block amax ≤ the tensor's
    return (rel * a2 + floor * block + 1e-45).reshape(x.shape)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("usage", ["row", "col"])
def test_dequantize_error_within_bound(case, usage):
    name, fmt, make_q, _, shapes = case
    q = make_q(*USAGES[usage])
    for shape in shapes:
        x = make_input("random", shape, torch.float32, seed=3) * 5
        dq = q.quantize(x).dequantize(torch.float32)
        err = (dq - x).abs()
        bound = _error_bound(fmt, q, x)
        worst = (err - bound).max()
        assert worst <= 0, f"{name} {shape} {usage}: error exceeds bound by {worst.item():g}"


def test_nan_and_inf_follow_te_kernels():
    x = torch.tensor([[1.0, float("nan"), float("inf"), -2.0] * 8] * 32)
    # Per-tensor: amax ignores NaN but is inf → scale 1; inf saturates to 448 (satfinite), NaN stays NaN.
    t = ts.Float8CurrentScalingQuantizer(rowwise=True, columnwise=False)(x)
    dq = t.dequantize(torch.float32)
    assert t._scale_inv.item() == 1.0
    assert torch.isnan(dq[:, 1]).all() and (dq[:, 2] == 448).all() and (dq[:, 3] == -2).all()
    # MXFP8: an inf block gets E8M0 254; its finite elements flush to 0, inf saturates to
    # 448 · 2^127, which overflows fp32 on dequantize, exactly as TE's dequantize kernel does.
    t = ts.MXFP8Quantizer(rowwise=True, columnwise=False)(x)
    dq = t.dequantize(torch.float32)
    assert (t._rowwise_scale_inv[:32, 0] == 254).all()
    assert torch.isnan(dq[:, 1]).all() and torch.isposinf(dq[:, 2]).all() and (dq[:, 0] == 0).all()


def test_e5m2_saturates_instead_of_inf():
    q = ts.Float8CurrentScalingQuantizer(E5M2, rowwise=True, columnwise=False)
    x = torch.tensor([[1e30, -1e30, 1.0, float("inf")]])
    t = q(x)
    # amax is inf → scale 1 → huge values saturate to ±57344 (bits 0x7B / 0xFB)
    assert t._data.tolist() == [[0x7B, 0xFB, 0x3C, 0x7B]]


def test_mxfp8_uses_ceil_exponent_rule():
    q = ts.MXFP8Quantizer(rowwise=True, columnwise=False)
    x = torch.zeros(32, 32)
    x[0, 0] = 449.0   # just above 448: ceil rule gives exponent 128 (scale 2), OCP floor would give 127
    x[1, 0] = 448.0   # exactly representable: exponent 127
    t = q(x)
    assert t._rowwise_scale_inv[0, 0].item() == 128
    assert t._rowwise_scale_inv[1, 0].item() == 127
    assert t._rowwise_scale_inv[2, 0].item() == 0      # all-zero block
    assert t._rowwise_scale_inv[32:].eq(0).all()      # padding zeroed


def test_nvfp4_nibble_order_low_first():
    q = ts.NVFP4Quantizer(rowwise=True, columnwise=False)
    x = torch.zeros(16, 16)
    x[0, 0], x[0, 1] = 6.0, -0.5  # amax 6 → block scale maps 6 → 6
    t = q(x)
    byte = t._rowwise_data[0, 0].item()
    assert byte & 0xF == 0x7 and byte >> 4 == 0x9  # 6.0 = code 7 low; -0.5 = sign|1 high


def test_blockwise_edge_blocks_use_existing_elements_only():
    q = ts.Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False)
    x = torch.ones(130, 130)
    x[129, 129] = 2.0  # alone in the corner 2×2 edge block
    t = q(x)
    s = t._rowwise_scale_inv
    assert s.shape == (2, 4)
    assert s[1, 1].item() == pytest.approx(2.0 / 448.0)
    assert s[0, 0].item() == pytest.approx(1.0 / 448.0)
    assert s[:, 2:].eq(0).all()  # padding zeroed
    assert list(itertools.chain(*t._columnwise_scale_inv[:2, :2].tolist())) == \
        list(itertools.chain(*s[:2, :2].t().tolist()))


@pytest.mark.parametrize("signs", [True, False])
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_nvfp4_rht_columnwise_only_dequantize_is_the_documented_rule(signs, kind):
    """Inverse RHT: exact 16-term dot products rounded once to fp32 (oracle and fractions agree)."""
    from reference.test_reference_selfcheck import exact_inverse_rht
    shape = (64, 48)
    x = make_input(kind, shape, torch.bfloat16, seed=11) * (275 if kind == "random" else 1)
    q = ts.NVFP4Quantizer(rowwise=False, with_rht=True, with_post_rht_amax=True, with_random_sign_mask=signs)
    t = q(x)
    want = ref.ref_nvfp4(x, rowwise=False, with_rht=True, with_post_rht_amax=True, with_random_sign_mask=signs)
    assert_same_buffers(t.buffers(), want)
    dq = t.dequantize(torch.float32)
    assert same_values(dq, ref.ref_dequantize("nvfp4", want, shape, with_rht=True, with_random_sign_mask=signs))
    rht_domain = ref.ref_dequantize("nvfp4", want, shape).t().reshape(-1, 16)
    if bool(torch.isfinite(rht_domain).all()):
        assert same_values(dq.t().reshape(-1, 16), exact_inverse_rht(rht_domain, ref.rht_matrix(signs)))


# --- MXFP4 (tests/reference/mxfp4_reference.py) ------------------------------------------------------

MXFP4_KINDS = [k for k in INPUT_KINDS if k != "specials"]  # NaN is refused (below)


def mxfp4_adversarial(dtype: torch.dtype) -> torch.Tensor:
    """[64, 128] blocks of 32 along K, each built to hit one edge of the rule: every E2M1 midpoint
    (a tie) and its neighbours at several exponents with the block maximum exactly 6 · 2^e, a maximum
    one ulp above 6 · 2^e, all-zero and ±0 blocks, subnormals, values near the dtype's maximum, and
    magnitudes 2^60 apart in one block; their negatives in the odd rows."""
    f = torch.finfo(dtype)
    rows = []
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for e in (-130, -127, -126, -100, -3, 0, 1, 7, 15):
        scale = 2.0 ** e
        ties = [m * scale for m in mids]
        near = [torch.nextafter(torch.tensor(m * scale), torch.tensor(0.0)).item() for m in mids] + \
               [torch.nextafter(torch.tensor(m * scale), torch.tensor(1e38)).item() for m in mids]
        rows.append([6.0 * scale] + ties + near)  # 22 values, the rest of the block +0
    rows.append([0.0] * 32)
    rows.append([-0.0, 0.0] * 16)
    rows.append([float(torch.nextafter(torch.tensor(6.0), torch.tensor(7.0)))] + [3.0, 1.5, 0.75] * 10 + [0.1])
    rows.append([f.tiny * 0.5, f.tiny, f.tiny * 3, float(2 ** -149)] * 8)
    rows.append([f.max, f.max / 3, f.max / 7, 1.0] * 8)
    rows.append([2.0 ** 30, 2.0 ** -30, 3 * 2.0 ** 28, -(2.0 ** 27)] * 8)
    rows.append([6.0 * 2.0 ** 120, 6.0 * 2.0 ** 120 * (1 + 2 ** -20), 1.0, -1.0] * 8)
    blocks = torch.tensor([r + [0.0] * (32 - len(r)) for r in rows], dtype=torch.float64)
    x = torch.zeros(64, 128, dtype=torch.float64)
    for i in range(64):
        for j in range(4):
            b = blocks[(i * 4 + j) % blocks.shape[0]]
            x[i, 32 * j:32 * j + 32] = b.roll(i) * (-1 if i % 2 else 1)
    return x.to(torch.float32).clamp(-f.max, f.max).to(dtype)


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mxfp4_bytes_equal_oracle(usage, in_dtype):
    r, c = USAGES[usage]
    q = ts.MXFP4Quantizer(rowwise=r, columnwise=c)
    inputs = [(kind, make_input(kind, shape, in_dtype, seed=5)) for kind in MXFP4_KINDS
              for shape in ((64, 96), (2, 32, 64), (32, 32))]
    inputs.append(("adversarial", mxfp4_adversarial(in_dtype)))
    inputs.append(("adversarial-t", mxfp4_adversarial(in_dtype).t().contiguous()))
    for kind, x in inputs:
        where = f"mxfp4 {tuple(x.shape)} {usage} {in_dtype} {kind}"
        want = mx_ref.ref_mxfp4(x, rowwise=r, columnwise=c)
        for eager in (True, False):
            with fused.policy("eager" if eager else "fused"):
                t = q.quantize(x)
                assert_same_buffers(t.buffers(), want, f"{where} eager={eager}")
                dq = t.dequantize(torch.float32)
            assert same_values(dq, mx_ref.ref_dequantize_mxfp4(want, tuple(x.shape))), where


def test_mxfp4_rule_edges():
    """The block exponent is ceil(log2(amax / 6)) exactly: 6 · 2^e is exponent e, one ulp above is e + 1
    (where fp32 log2 would say e); ties go to the even code; −0.0 is +0, a negative rounding to 0 is −0."""
    q = ts.MXFP4Quantizer()
    x = torch.zeros(4, 32)
    x[0, 0] = 6.0 * 2.0 ** 100
    x[1, 0] = float(torch.nextafter(torch.tensor(6.0 * 2.0 ** 100), torch.tensor(1e38)))
    x[2, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[3, :3] = torch.tensor([6.0, -0.0, -0.2])
    t = q(x)
    assert t._rowwise_scale_inv[:4, 0].tolist() == [227, 228, 127, 127]
    codes = torch.stack([t._rowwise_data[2] & 0xF, t._rowwise_data[2] >> 4], dim=1).reshape(-1)
    assert codes[:8].tolist() == [7, 0, 2, 2, 4, 4, 6, 6]
    assert (t._rowwise_data[3, 0] >> 4).item() == 0 and (t._rowwise_data[3, 1] & 0xF).item() == 8
    assert t._rowwise_scale_inv[4:].eq(0).all() and t._rowwise_scale_inv[:, 1:].eq(0).all()  # padding


def test_mxfp4_edge_bytes_dequantize_exactly():
    """Bytes 0 (2^−127, an fp32 subnormal) and 254 (2^127: codes ≥ 2 overflow to ±inf) under every code."""
    q = ts.MXFP4Quantizer()
    codes = torch.arange(16, dtype=torch.uint8).repeat(4).reshape(2, 32)
    bufs = {"_rowwise_data": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
            "_rowwise_scale_inv": torch.zeros(128, 4, dtype=torch.uint8)}
    bufs["_rowwise_scale_inv"][1, 0] = 254
    got = q.dequantize_buffers(bufs, (2, 32), torch.float32)
    want = mx_ref.ref_dequantize_mxfp4(bufs, (2, 32))
    assert same_values(got, want)
    assert got[0, 1].item() == 2.0 ** -128 and got[0, 3].item() == 1.5 * 2.0 ** -127
    assert got[1, 3].item() == 1.5 * 2.0 ** 127 and torch.isinf(got[1, 4]) and torch.isinf(got[1, 15])


def test_mxfp4_refuses_nan_and_its_nan_scale():
    from te_serial import errors as tse
    q = ts.MXFP4Quantizer()
    x = torch.ones(32, 32)
    x[3, 4] = float("nan")
    with pytest.raises(tse.QuantizationError, match="NaN"):
        q(x)
    bufs = q(torch.ones(32, 32)).buffers()
    bufs["_rowwise_scale_inv"] = bufs["_rowwise_scale_inv"].clone()
    bufs["_rowwise_scale_inv"][31, 0] = 0xFF
    with pytest.raises(tse.FormatError, match="_rowwise_scale_inv.*0xFF"):
        q.dequantize_buffers(bufs, (32, 32), torch.float32)
