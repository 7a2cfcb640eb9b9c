"""Tests for tests/te_shim.py: TE 2.x's real tensor classes built and (where TE allows) dequantized on CPU.

Skipped only when the ``transformer_engine`` wheel is not installed.
"""

import io
import math
import warnings

import pytest
import torch

try:
    import te_shim
except ImportError:  # tests/ collected as a package
    from tests import te_shim

te = te_shim.install()
if te is None:
    pytest.skip("transformer_engine wheel not installed", allow_module_level=True)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FAKE_EXT = te.is_fake_extension


def roundup(x, m):
    return (x + m - 1) // m * m


def fp8(x, scale, dtype=E4M3):
    """Simple clamp-then-cast FP8 quantization (torch's cast does not saturate)."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def u8(q):
    return q.view(torch.uint8)


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- install


def test_install_is_idempotent_and_exposes_classes():
    assert te_shim.install() is te
    for name in ("Float8Tensor", "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer",
                 "MXFP8Tensor", "MXFP8TensorStorage", "MXFP8Quantizer", "Float8BlockwiseQTensor",
                 "Float8BlockwiseQTensorStorage", "Float8BlockQuantizer", "NVFP4Tensor",
                 "NVFP4TensorStorage", "NVFP4Quantizer"):  # fmt: skip
        cls = getattr(te, name)
        assert cls.__module__.startswith("transformer_engine.pytorch.tensor"), name
    assert issubclass(te.Float8Tensor, torch.Tensor)
    assert issubclass(te.Float8Tensor, te.Float8TensorStorage)
    assert not issubclass(te.Float8TensorStorage, torch.Tensor)
    # the narrow import must not have run transformer_engine.pytorch.tensor.__init__'s monkey-patch
    assert torch.nn.Module.float.__module__ == "torch.nn.modules.module"


def test_dtype_enums_match_cpp_values():
    for member in te.DType:
        assert int(member) == te_shim.CPP_DTYPE_VALUES[member.name]
    assert te_shim.CPP_DTYPE_VALUES["kFloat8E8M0"] == 9 and te_shim.CPP_DTYPE_VALUES["kInt64"] == 3
    for member in te.tex.DType:
        assert int(member) == te_shim.CPP_DTYPE_VALUES[member.name]
        assert te.DType.cast(member) == member  # TE's DType <-> tex.DType equality by value
    assert te_shim.to_te_dtype(E4M3) is te.DType.kFloat8E4M3
    assert te_shim.to_te_dtype(E5M2) is te.DType.kFloat8E5M2
    assert te_shim.to_te_dtype(torch.bfloat16) is te.DType.kBFloat16


@pytest.mark.skipif(not FAKE_EXT, reason="real TE extension present")
def test_extension_stubs_raise_clearly():
    with pytest.raises(te_shim.TEExtensionUnavailable, match="compiled CUDA extension"):
        te.tex.quantize(torch.zeros(1), None)
    # pybind exposes only these members; TE's constants.py asserts the two enums agree
    assert set(te.tex.DType.__members__) == {m.name for m in te.DType}


@pytest.mark.skipif(not FAKE_EXT, reason="real TE extension present")
def test_uninstall_restores_in_fresh_process():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, te_shim, torch\n"
        "te = te_shim.install(); q = te.NVFP4Quantizer()\n"
        "te_shim.uninstall()\n"
        "assert not any(m.startswith('transformer_engine') for m in sys.modules), sorted(sys.modules)\n"
        "assert 'lambda' not in repr(torch.cuda.current_device)\n"
        "assert te_shim.install() is not te\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- Float8


@pytest.mark.parametrize("shape", [(16, 32), (2, 3, 40)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_float8_tensor_buffers_and_cpu_dequantize(shape, fp8_dtype):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    scale = torch.finfo(fp8_dtype).max / x.abs().max()
    q = fp8(x, scale, fp8_dtype)
    data = u8(q)
    transpose = data.movedim(-1, 0).contiguous()  # TE's N-D "transpose": [S[-1], *S[:-1]]
    scale_inv = (1.0 / scale).reshape(1).float()
    t = te_shim.make_te_float8(data, scale_inv, fp8_dtype, shape, torch.bfloat16, transpose_u8=transpose)

    assert isinstance(t, te.Float8Tensor) and isinstance(t, torch.Tensor)
    assert t.shape == torch.Size(shape) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    bufs = te_shim.te_buffers(t)
    assert set(bufs) == {"_data", "_transpose", "_scale_inv"}
    assert bufs["_data"].data_ptr() == data.data_ptr()
    assert bufs["_transpose"].data_ptr() == transpose.data_ptr()
    assert bufs["_scale_inv"].data_ptr() == scale_inv.data_ptr()
    assert t._fp8_dtype == te_shim.to_te_dtype(fp8_dtype) and t._transpose_invalid is False

    expected = q.float() * scale_inv
    assert torch.equal(t.dequantize(dtype=torch.float32), expected)
    out = t.dequantize()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))

    # columnwise-only ("Hopper" layout): dequantized through the transpose, then movedim(0, -1)
    tc = te_shim.make_te_float8(None, scale_inv, fp8_dtype, shape, torch.float32, transpose_u8=transpose)
    assert set(te_shim.te_buffers(tc)) == {"_transpose", "_scale_inv"}
    assert tc.size() == torch.Size(shape)
    assert torch.equal(tc.dequantize(), expected)

    # bare storage class works the same way
    st = te.Float8TensorStorage(data=data, fp8_scale_inv=scale_inv, fp8_dtype=te_shim.to_te_dtype(fp8_dtype),
                                fake_dtype=torch.float16)  # fmt: skip
    assert not isinstance(st, torch.Tensor)
    assert torch.equal(st.dequantize(), expected.half())


def test_float8_quantizer_fields_and_transpose_rule():
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, "cpu", force_pow_2_scales=True, amax_epsilon=1e-6)
    f = te_shim.te_quantizer_fields(q)
    assert f["cls"] == "Float8CurrentScalingQuantizer" and f["dtype"] is te.DType.kFloat8E4M3
    assert f["rowwise_usage"] and f["columnwise_usage"] and f["force_pow_2_scales"] and f["amax_epsilon"] == 1e-6
    assert "scale" not in f  # deprecated args are dropped, not stored
    dq = te.Float8Quantizer(torch.ones(1), torch.zeros(1), te.DType.kFloat8E5M2)
    assert te_shim.te_quantizer_fields(dq)["dtype"] is te.DType.kFloat8E5M2
    assert "scale" in te_shim.te_quantizer_fields(dq)

    shape = (2, 3, 32)
    assert q.inner_tensor_specs(shape) == {
        "_data": (shape, torch.uint8),
        "_transpose": ((32, 2, 3), torch.uint8),
        "_scale_inv": ((1,), torch.float32),
    }
    if not FAKE_EXT:
        return
    old = te_shim.set_non_tn_fp8_gemm(True)  # Blackwell: _data serves both usages, no _transpose
    try:
        assert list(q.inner_tensor_specs(shape)) == ["_data", "_scale_inv"]
        q.set_usage(rowwise=False, columnwise=True)
        assert list(q.inner_tensor_specs(shape)) == ["_data", "_scale_inv"]
        data = torch.zeros(shape, dtype=torch.uint8)
        t = te_shim.make_te_float8(data, torch.ones(1), E4M3, shape, torch.float32)
        assert t.get_usages() == {"rowwise": True, "columnwise": True}
    finally:
        te_shim.set_non_tn_fp8_gemm(old)


def test_float8_flatten_roundtrip_and_pickle():
    x = torch.randn(8, 16)
    q = fp8(x, 10.0)
    data, tr = u8(q), u8(q).t().contiguous()
    scale_inv = torch.tensor([0.1])
    t = te_shim.make_te_float8(data, scale_inv, E4M3, x.shape, torch.float32, transpose_u8=tr)
    names, ctx = t.__tensor_flatten__()
    assert names == ["_data", "_transpose", "_scale_inv"]
    assert ctx["is_tensor"] and ctx["cls"] is te.Float8Tensor
    assert set(ctx["nontensor_kwargs"]) == {"fp8_dtype", "quantizer", "fake_dtype", "transpose_invalid"}
    t2 = te.Float8Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape, t.stride())
    assert type(t2) is te.Float8Tensor and t2.shape == t.shape
    assert all(te_shim.te_buffers(t2)[n] is te_shim.te_buffers(t)[n] for n in names)
    assert torch.equal(t2.dequantize(), t.dequantize())

    # TE's own pickle: no quantizer, and _transpose only when _data is None
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    with torch.serialization.safe_globals(te_shim.safe_globals()):
        t3 = torch.load(buf, weights_only=True)
    assert type(t3) is te.Float8Tensor and t3._quantizer is None
    assert set(te_shim.te_buffers(t3)) == {"_data", "_scale_inv"}
    assert torch.equal(t3._data, data) and torch.equal(t3.dequantize(), t.dequantize())


# ----------------------------------------------------------------------------- Blockwise


def quant_1x128(x2d):
    """1x128 blocks along the last dim. Returns q [R, C] and TE's scale buffer
    [ceil(C/128), roundup(R, 4)] (stored transposed; padding filled with NaN)."""
    R, C = x2d.shape
    nb = math.ceil(C / 128)
    xp = torch.nn.functional.pad(x2d.float(), (0, nb * 128 - C)).view(R, nb, 128)
    amax = xp.abs().amax(-1).clamp_min(1e-12)
    scale = 448.0 / amax
    q = fp8(xp, scale[..., None]).view(R, nb * 128)[:, :C].contiguous()
    s_buf = torch.full((nb, roundup(R, 4)), float("nan"))
    s_buf[:, :R] = (1.0 / scale).t()
    return q, s_buf


def quant_128x128(x2d):
    """128x128 tiles. Returns q [M, K] and TE's scale buffer [ceil(M/128), roundup(ceil(K/128), 4)]."""
    M, K = x2d.shape
    mb, kb = math.ceil(M / 128), math.ceil(K / 128)
    xp = torch.nn.functional.pad(x2d.float(), (0, kb * 128 - K, 0, mb * 128 - M)).view(mb, 128, kb, 128)
    amax = xp.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = 448.0 / amax
    q = fp8(xp, scale[:, None, :, None]).view(mb * 128, kb * 128)[:M, :K].contiguous()
    s_buf = torch.full((mb, roundup(kb, 4)), float("nan"))
    s_buf[:, :kb] = 1.0 / scale
    return q, s_buf


BLOCK_SHAPES = [(128, 256), (200, 300), (3, 50, 130), (1, 7)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_blockwise_1x128_cpu_dequantize(shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * 5
    M, K = math.prod(shape[:-1]), shape[-1]
    x2 = x.reshape(M, K)
    q, s = quant_1x128(x2)  # rowwise: element (m, k) uses s[k // 128, m]
    qt, st = quant_1x128(x2.t())  # columnwise: data [K, M]; element (m, k) uses st[m // 128, k]
    assert s.shape == (math.ceil(K / 128), roundup(M, 4)) and st.shape == (math.ceil(M / 128), roundup(K, 4))
    col_shape = (K, *shape[:-1])
    t = te_shim.make_te_blockwise(u8(q).reshape(shape), s, u8(qt).reshape(col_shape), st, E4M3, shape,
                                  torch.bfloat16, is_2D_scaled=False)  # fmt: skip
    assert isinstance(t, te.Float8BlockwiseQTensor) and t.shape == torch.Size(shape) and t.dtype == torch.bfloat16
    bufs = te_shim.te_buffers(t)
    assert set(bufs) == {"_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"}
    assert bufs["_rowwise_scale_inv"] is s and bufs["_columnwise_scale_inv"] is st
    assert torch.equal(bufs["_rowwise_data"].view(-1), u8(q).view(-1))
    # our buffers match TE's own spec for this quantizer
    specs = t._quantizer.inner_tensor_specs(shape)
    assert {k: (tuple(v.shape), v.dtype) for k, v in bufs.items()} == specs
    assert te_shim.te_quantizer_fields(t._quantizer)["block_scaling_dim"] == 1

    m, k = torch.arange(M), torch.arange(K)
    expected = q.float() * s[k[None, :] // 128, m[:, None]]
    got = t.dequantize(dtype=torch.float32)
    assert not got.isnan().any()  # NaN scale padding must be ignored
    assert torch.equal(got, expected.reshape(shape))
    assert torch.equal(t.dequantize(), expected.reshape(shape).to(torch.bfloat16))

    # columnwise-only: dequantized from the [K, M] copy and permuted back to the logical shape
    expected_col = (qt.float() * st[m[None, :] // 128, k[:, None]]).t().reshape(shape)
    tc = te_shim.make_te_blockwise(None, None, u8(qt).reshape(col_shape), st, E4M3, shape, torch.float32, False)
    assert tc.size() == torch.Size(shape)
    assert torch.equal(tc.dequantize(), expected_col)


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_blockwise_128x128_cpu_dequantize(shape):
    torch.manual_seed(2)
    x = torch.randn(shape) * 5
    M, K = math.prod(shape[:-1]), shape[-1]
    q, s = quant_128x128(x.reshape(M, K))  # element (m, k) uses s[m // 128, k // 128]
    mb, kb = math.ceil(M / 128), math.ceil(K / 128)
    st = torch.full((kb, roundup(mb, 4)), float("nan"))
    st[:, :mb] = s[:, :kb].t()  # columnwise 2D = transpose of data and scales (lossless)
    col_shape = (K, *shape[:-1])
    qt = u8(q).t().contiguous().reshape(col_shape)
    t = te_shim.make_te_blockwise(u8(q).reshape(shape), s, qt, st, E4M3, shape, torch.float32, is_2D_scaled=True)
    bufs = te_shim.te_buffers(t)
    assert {k: (tuple(v.shape), v.dtype) for k, v in bufs.items()} == t._quantizer.inner_tensor_specs(shape)
    assert t._is_2D_scaled and te_shim.te_quantizer_fields(t._quantizer)["block_scaling_dim"] == 2

    m, k = torch.arange(M), torch.arange(K)
    expected = (q.float() * s[m[:, None] // 128, k[None, :] // 128]).reshape(shape)
    got = t.dequantize()
    assert not got.isnan().any() and torch.equal(got, expected)
    tc = te_shim.make_te_blockwise(None, None, qt, st, E4M3, shape, torch.float32, is_2D_scaled=True)
    assert torch.equal(tc.dequantize(), expected)

    st_only = te.Float8BlockwiseQTensorStorage(u8(q).reshape(shape), s, None, None, te.DType.kFloat8E4M3, None,
                                               True, fake_dtype=torch.float32)  # fmt: skip
    assert torch.equal(st_only.dequantize(), expected)


# ----------------------------------------------------------------------------- MXFP8 / NVFP4


def _random_bytes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8)


def _mxfp8_buffers(shape):
    M, K = math.prod(shape[:-1]), shape[-1]
    data = u8(fp8(torch.randn(shape), 1.0))
    rs = torch.randint(120, 135, (roundup(M, 128), roundup(K // 32, 4)), dtype=torch.uint8)
    cs = torch.randint(120, 135, (roundup(M // 32, 4), roundup(K, 128)), dtype=torch.uint8)
    return data, rs, data.clone(), cs


@pytest.mark.parametrize("shape", [(64, 96), (2, 32, 64)])
def test_mxfp8_tensor_buffers(shape):
    rd, rs, cd, cs = _mxfp8_buffers(shape)
    t = te_shim.make_te_mxfp8(rd, rs, cd, cs, E4M3, shape, torch.bfloat16)
    assert isinstance(t, te.MXFP8Tensor) and t.shape == torch.Size(shape) and t.dtype == torch.bfloat16
    bufs = te_shim.te_buffers(t)
    assert [bufs[n].data_ptr() for n in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                                         "_columnwise_scale_inv")] == [b.data_ptr() for b in (rd, rs, cd, cs)]  # fmt: skip
    assert {k: (tuple(v.shape), v.dtype) for k, v in bufs.items()} == t._quantizer.inner_tensor_specs(shape)
    assert t._with_gemm_swizzled_scales is False and t._fp8_dtype is te.DType.kFloat8E4M3
    names, ctx = t.__tensor_flatten__()
    t2 = te.MXFP8Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape, t.stride())
    assert all(getattr(t2, n) is getattr(t, n) for n in names)
    sw = te_shim.make_te_mxfp8(rd, rs, None, None, E4M3, shape, torch.float32, with_gemm_swizzled_scales=True)
    assert sw._with_gemm_swizzled_scales and sw._quantizer.optimize_for_gemm
    assert set(te_shim.te_buffers(sw)) == {"_rowwise_data", "_rowwise_scale_inv"}
    if FAKE_EXT and not torch.cuda.is_available():
        # TE moves CPU MXFP8 to CUDA for tex.dequantize: there is no CPU path
        with pytest.raises((AssertionError, RuntimeError)):
            t.dequantize()


def _nvfp4_buffers(shape):
    M, K = math.prod(shape[:-1]), shape[-1]
    rd = _random_bytes(*shape[:-1], K // 2)
    rs = _random_bytes(roundup(M, 128), roundup(math.ceil(K / 16), 4))
    cd = _random_bytes(K, *shape[:-2], shape[-2] // 2) if len(shape) > 1 else None
    cs = _random_bytes(roundup(K, 128), roundup(math.ceil(M / 16), 4))
    return rd, rs, cd, cs, torch.tensor([3.5]), torch.tensor([3.5])


@pytest.mark.parametrize("shape", [(32, 64), (2, 32, 64)])
def test_nvfp4_tensor_buffers(shape):
    rd, rs, cd, cs, ar, ac = _nvfp4_buffers(shape)
    t = te_shim.make_te_nvfp4(rd, rs, cd, cs, ar, ac, shape, torch.bfloat16)
    assert isinstance(t, te.NVFP4Tensor) and t.shape == torch.Size(shape) and t.dtype == torch.bfloat16
    bufs = te_shim.te_buffers(t)
    assert list(bufs) == ["_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
                          "_amax_rowwise", "_amax_columnwise"]  # fmt: skip
    assert all(bufs[n] is b for n, b in zip(bufs, (rd, rs, cd, cs, ar, ac)))
    # TE's Python spec keeps N-D columnwise data: (K, *S[:-2], S[-2] // 2), not a flat (K, M // 2)
    assert {k: (tuple(v.shape), v.dtype) for k, v in bufs.items()} == t._quantizer.inner_tensor_specs(shape)
    f = te_shim.te_quantizer_fields(t._quantizer)
    assert f["dtype"] is te.DType.kFloat4E2M1 and f["with_rht"] is False and f["nvfp4_e4m3_max"] == 448
    assert t._quantizer.rht_matrix.device.type == "cpu"
    names, ctx = t.__tensor_flatten__()
    t2 = te.NVFP4Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape, t.stride())
    assert all(getattr(t2, n) is getattr(t, n) for n in names) and t2.shape == t.shape

    tc = te_shim.make_te_nvfp4(None, None, cd, cs, None, ac, shape, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tc.size() == torch.Size(shape)  # storage size() rebuilds the shape from the N-D columnwise data
    with pytest.raises(NotImplementedError):
        tc.dequantize()  # columnwise-only NVFP4 dequant is not implemented in TE
    if FAKE_EXT and not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            t.dequantize()  # rowwise dequant moves to CUDA for tex.dequantize


def test_nvfp4_quantizer_options_and_reference_decoder():
    q = te.NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_2d_quantization=True,
                          stochastic_rounding=True, with_random_sign_mask=False)  # fmt: skip
    f = te_shim.te_quantizer_fields(q)
    assert f["with_rht"] and f["with_post_rht_amax"] and f["with_2d_quantization"] and f["stochastic_rounding"]
    assert f["rht_matrix_random_sign_mask_t"] == 0 and not q.is_requantization_safe()
    assert te.NVFP4Quantizer().rht_matrix_random_sign_mask_t != 0
    ref = te.reference_nvfp4
    if ref is None:
        pytest.skip("reference_nvfp4 not importable")
    # nibble order: element 2i in the low nibble; codes 0..7 -> {0,.5,1,1.5,2,3,4,6}, bit 3 = sign
    packed = torch.tensor([[0x21, 0xF7, 0x80]], dtype=torch.uint8)
    vals = ref.cast_from_fp4x2(packed, torch.float32)
    assert vals.tolist() == [[0.5, 1.0, 6.0, -6.0, 0.0, -0.0]]


# ----------------------------------------------------------------------------- TE pickles of every class


def _all_kinds():
    x = torch.randn(64, 128)
    q, s = quant_128x128(x)
    yield "float8", te_shim.make_te_float8(u8(fp8(x, 1.0)), torch.ones(1), E4M3, x.shape, torch.float32)
    yield "blockwise", te_shim.make_te_blockwise(u8(q), s, None, None, E4M3, x.shape, torch.float32, True)
    yield "mxfp8", te_shim.make_te_mxfp8(*_mxfp8_buffers((64, 128)), E4M3, (64, 128), torch.bfloat16)
    yield "nvfp4", te_shim.make_te_nvfp4(*_nvfp4_buffers((64, 128)), (64, 128), torch.bfloat16)


def test_te_pickle_roundtrip_weights_only():
    for kind, t in _all_kinds():
        buf = io.BytesIO()
        torch.save({"w": t}, buf)
        buf.seek(0)
        with torch.serialization.safe_globals(te_shim.safe_globals()):
            t2 = torch.load(buf, weights_only=True)["w"]
        assert type(t2) is type(t) and t2.shape == t.shape and t2.dtype == t.dtype, kind
        b1, b2 = te_shim.te_buffers(t), te_shim.te_buffers(t2)
        assert set(b1) == set(b2) and all(same_bytes(b1[n], b2[n]) for n in b1), kind
        if kind != "float8":  # Float8Tensor pickles drop the quantizer
            assert te_shim.te_quantizer_fields(t2._quantizer) == te_shim.te_quantizer_fields(t._quantizer), kind
