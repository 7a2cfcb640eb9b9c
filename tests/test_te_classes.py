"""te-serial against TE's own Python classes (TE's pure-Python wheel + tests/te_shim.py on CPU).

* TE's ``inner_tensor_specs`` (its Python shape rules) equal our ``describe_buffers``.
* TE's ``Float8Tensor`` / ``Float8BlockwiseQTensor`` built from our buffers dequantize (TE's own
  CPU code) to exactly our values; MXFP8 / NVFP4 tensors build from our buffers and hand them back.
* TE's torch reference NVFP4 quantizer (custom_recipes/reference_nvfp4.py) gives our bytes.
"""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import formats as tsf
import te_shim
from helpers import INPUT_KINDS, make_input, same_bits, same_values

te = te_shim.install()
if te is None:  # only where the test extra (transformer-engine wheel) is not installed
    pytest.skip("transformer-engine wheel not installed", allow_module_level=True)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
USAGES = [(True, False), (False, True), (True, True)]


def _te_quantizer_for(q):
    dt = lambda d: te_shim.to_te_dtype(d)  # noqa: E731
    usage = dict(rowwise=q.rowwise, columnwise=q.columnwise)
    if isinstance(q, ts.Float8CurrentScalingQuantizer):
        return te.Float8CurrentScalingQuantizer(dt(q.fp8_dtype), torch.device("cpu"), **usage,
                                                force_pow_2_scales=q.force_pow_2_scales,
                                                amax_epsilon=q.amax_epsilon)
    if isinstance(q, ts.MXFP8Quantizer):
        return te.MXFP8Quantizer(dt(q.fp8_dtype), **usage, with_2d_quantization=q.with_2d_quantization)
    if isinstance(q, ts.Float8BlockQuantizer):
        return te.Float8BlockQuantizer(dt(q.fp8_dtype), **usage, block_scaling_dim=q.block_scaling_dim,
                                       force_pow_2_scales=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon)
    if isinstance(q, ts.NVFP4Quantizer):
        return te.NVFP4Quantizer(**usage, with_2d_quantization=q.with_2d_quantization,
                                 with_rht=q.with_rht, with_post_rht_amax=q.with_post_rht_amax)
    raise TypeError(q)


SPEC_CASES = [
    (ts.Float8CurrentScalingQuantizer(E4M3, rowwise=r, columnwise=c), shape)
    for r, c in USAGES for shape in [(37, 53), (3, 64, 128)]
] + [
    (ts.MXFP8Quantizer(E4M3, rowwise=r, columnwise=c), shape)
    for r, c in USAGES for shape in [(64, 128), (2, 32, 96), (160, 32)]
] + [
    (ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=d), shape)
    for r, c in USAGES for d in (1, 2) for shape in [(200, 300), (2, 65, 130), (1, 7)]
] + [
    (ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_2d_quantization=two_d), shape)
    for r, c in USAGES for two_d in (False, True) for shape in [(32, 48), (2, 32, 64), (144, 160)]
]


@pytest.mark.parametrize("q,shape", SPEC_CASES, ids=lambda v: str(v) if isinstance(v, tuple) else v.kind)
def test_buffer_specs_equal_te_inner_tensor_specs(q, shape):
    theirs = {n: (tuple(s), d) for n, (s, d) in _te_quantizer_for(q).inner_tensor_specs(shape).items()}
    ours = {n: (spec.shape, spec.dtype) for n, spec in q.describe_buffers(shape).items()}
    assert ours == theirs
    assert list(ours) == list(theirs)  # flatten order too


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("shape", [(37, 53), (3, 5, 70)])
def test_te_float8_tensor_dequantizes_our_bytes_exactly(fp8, usage, shape):
    q = ts.Float8CurrentScalingQuantizer(fp8, rowwise=usage[0], columnwise=usage[1])
    for kind in INPUT_KINDS:
        x = make_input(kind, shape, torch.bfloat16)
        ours = q(x)
        b = ours.buffers()
        theirs = te_shim.make_te_float8(b.get("_data"), b["_scale_inv"], fp8, shape, torch.float32,
                                        transpose_u8=b.get("_transpose"))
        assert type(theirs).__name__ == "Float8Tensor" and tuple(theirs.shape) == shape
        assert same_values(theirs.dequantize(dtype=torch.float32), ours.dequantize(torch.float32)), kind
        for name, buf in te_shim.te_buffers(theirs).items():
            assert buf is b[name]


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("shape", [(200, 300), (2, 65, 130), (128, 256), (1, 7)])
def test_te_blockwise_tensor_dequantizes_our_bytes_exactly(dim, usage, shape):
    q = ts.Float8BlockQuantizer(E4M3, rowwise=usage[0], columnwise=usage[1], block_scaling_dim=dim)
    for kind in INPUT_KINDS:
        x = make_input(kind, shape, torch.bfloat16, seed=7)
        ours = q(x)
        b = ours.buffers()
        theirs = te_shim.make_te_blockwise(b.get("_rowwise_data"), b.get("_rowwise_scale_inv"),
                                           b.get("_columnwise_data"), b.get("_columnwise_scale_inv"),
                                           E4M3, shape, torch.float32, is_2D_scaled=dim == 2)
        assert same_values(theirs.dequantize(dtype=torch.float32), ours.dequantize(torch.float32)), kind


@pytest.mark.parametrize("two_d", [False, True])
def test_te_mxfp8_and_nvfp4_tensors_build_from_our_buffers(two_d):
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    m = ts.MXFP8Quantizer(with_2d_quantization=two_d)(x)
    b = m.buffers()
    tm = te_shim.make_te_mxfp8(b["_rowwise_data"], b["_rowwise_scale_inv"], b["_columnwise_data"],
                               b["_columnwise_scale_inv"], E4M3, (64, 128), torch.bfloat16)
    assert tuple(tm.shape) == (64, 128) and all(v is b[k] for k, v in te_shim.te_buffers(tm).items())
    n = ts.NVFP4Quantizer(with_2d_quantization=two_d)(x)
    b = n.buffers()
    tn = te_shim.make_te_nvfp4(*(b[k] for k in tsf.NVFP4TensorStorage.BUFFERS), (64, 128), torch.bfloat16,
                               with_2d_quantization=two_d)
    assert tuple(tn.shape) == (64, 128) and set(te_shim.te_buffers(tn)) == set(b)


@pytest.mark.skipif(te.reference_nvfp4 is None, reason="TE wheel without custom_recipes")
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("shape", [(32, 64), (144, 160)])
def test_nvfp4_bytes_equal_te_reference_quantizer(tile, shape):
    ref = te.reference_nvfp4.NVFP4QuantizerRef(dtype=None, rowwise=True, columnwise=True,
                                               quant_tile_shape=tile)
    q = ts.NVFP4Quantizer(with_2d_quantization=tile == (16, 16))
    for kind in ("random", "zeros", "outliers", "tiny"):
        x = make_input(kind, shape, torch.bfloat16, seed=11)
        qx, sx, qx_t, sx_t, amax_r, amax_c = ref._quantize(x)
        t = q(x)
        m, k = shape
        assert same_bits(t._rowwise_data, qx), kind
        assert same_bits(t._rowwise_scale_inv[:m, : k // 16], sx.view(torch.uint8)), kind
        assert same_bits(t._columnwise_data.reshape(k, m // 2), qx_t.reshape(k, m // 2)), kind
        assert same_bits(t._columnwise_scale_inv[:k, : m // 16], sx_t.view(torch.uint8)), kind
        assert same_bits(t._amax_rowwise, amax_r) and same_bits(t._amax_columnwise, amax_c), kind
