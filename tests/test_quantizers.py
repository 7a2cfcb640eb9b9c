"""Quantizer API: value semantics, serialization, registry, shape rules, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.recipes import RECIPES, recipe_quantizer

ALL = [
    ts.Float8Quantizer(2.0, 1.5, torch.float8_e5m2, rowwise=True, columnwise=False),
    ts.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, force_pow_2_scales=True, amax_epsilon=1e-6),
    ts.MXFP8Quantizer(torch.float8_e4m3fn, with_2d_quantization=True),
    ts.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, force_pow_2_scales=False),
    ts.NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_2d_quantization=False),
]


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.kind)
def test_value_semantics_and_dict_round_trip(q):
    again = tsf.Quantizer.from_dict(q.to_dict())
    assert again == q and hash(again) == hash(q) and again is not q
    assert type(again) is type(q)
    other = q.set_usage(columnwise=not q.columnwise) if q.rowwise else q.set_usage(rowwise=True)
    assert other != q
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.rowwise = False
    import msgpack
    assert tsf.Quantizer.from_dict(msgpack.unpackb(msgpack.packb(q.to_dict()))) == q


def test_te_constructor_signatures():
    # Positional order follows TE: Float8Quantizer(scale, amax, fp8_dtype); others (fp8_dtype, *, ...)
    q = ts.Float8Quantizer(torch.tensor([0.5]), torch.tensor(3.0), torch.float8_e5m2)
    assert (q.scale, q.amax, q.fp8_dtype) == (0.5, 3.0, torch.float8_e5m2)
    assert ts.Float8BlockQuantizer(torch.float8_e4m3fn).force_pow_2_scales is True
    assert ts.Float8BlockQuantizer().block_scaling_dim == 2
    assert ts.MXFP8Quantizer().rowwise_usage and ts.MXFP8Quantizer().columnwise_usage
    with pytest.raises(TypeError):
        ts.MXFP8Quantizer(torch.float8_e4m3fn, True)  # usages are keyword-only


@pytest.mark.parametrize("bad", [
    {"kind": "os.system"}, {"kind": None}, {"kind": "mxfp8", "fp8_dtype": "float32x"},
    {"kind": "mxfp8", "not_a_field": 1}, {"kind": "fp8_blockwise", "block_scaling_dim": 3},
    {"kind": "mxfp8", "rowwise": False, "columnwise": False},
])
def test_from_dict_refuses_bad_input(bad):
    with pytest.raises(tse.FormatError):
        tsf.Quantizer.from_dict(bad)


def test_unknown_kind_is_its_own_error():
    with pytest.raises(tse.UnknownQuantizerError, match="os.system"):
        tsf.Quantizer.from_dict({"kind": "os.system"})


@pytest.mark.parametrize("q,shape,rule", [
    (ts.MXFP8Quantizer(), (64, 48), "divisible by 32"),
    (ts.MXFP8Quantizer(), (3, 10, 64), "divisible by 32"),
    (ts.NVFP4Quantizer(), (16, 40), "divisible by 16"),
    (ts.NVFP4Quantizer(), (16, 1, 32), "odd shape"),
    (ts.Float8CurrentScalingQuantizer(), (), "at least one dim"),
])
def test_shape_rules_raise_clear_errors(q, shape, rule):
    with pytest.raises(tse.ShapeError, match=rule) as info:
        q.describe_buffers(shape)
    assert str(tuple(shape)) in str(info.value)
    with pytest.raises(tse.ShapeError):
        q.quantize(torch.zeros(shape))
    with pytest.raises(tse.ShapeError):
        ts.TensorProto(shape, torch.bfloat16, q)
    assert issubclass(tse.ShapeError, ts.TeSerialError)


def test_stochastic_rounding_is_configurable_but_refused_at_quantize():
    q = ts.NVFP4Quantizer(stochastic_rounding=True)
    assert tsf.Quantizer.from_dict(q.to_dict()) == q
    assert q.describe_buffers((16, 16))  # layout is known
    with pytest.raises(tse.QuantizationError, match="not reproducible"):
        q.quantize(torch.randn(16, 16))


def test_quantize_refuses_non_float_input():
    with pytest.raises(tse.FormatError, match="floating-point"):
        ts.MXFP8Quantizer()(torch.zeros(32, 32, dtype=torch.int32))


def test_quantize_keeps_nominal_dtype_and_accepts_override():
    x = torch.randn(32, 64, dtype=torch.float16)
    assert ts.MXFP8Quantizer()(x).dtype == torch.float16
    assert ts.MXFP8Quantizer().quantize(x, fake_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_internal_quantize_returns_bare_storage():
    x = torch.randn(32, 64)
    s = ts.MXFP8Quantizer().quantize(x, internal=True)
    assert type(s) is tsf.MXFP8TensorStorage and not isinstance(s, torch.Tensor)
    assert s.logical_shape == (32, 64) and s.fake_dtype == torch.float32
    assert torch.equal(s.dequantize(), ts.MXFP8Quantizer()(x).dequantize())


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_named_recipe_builds_a_registered_quantizer(name):
    q = recipe_quantizer(name)
    assert tsf.resolve_quantizer(q.kind) is type(q)
    assert q.quantize(torch.randn(64, 128)).shape == (64, 128)


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(tse.FormatError, match="mxfp8"):
        recipe_quantizer("fp7")


@pytest.mark.parametrize("q", [ts.Float8BlockQuantizer(), ts.Float8BlockQuantizer(block_scaling_dim=1),
                               ts.Float8CurrentScalingQuantizer()], ids=lambda q: q.kind)
@pytest.mark.parametrize("shape", [(128, 0), (0, 64), (0, 0)])
def test_empty_tensors_quantize_to_the_described_buffers(q, shape):
    t = q(torch.zeros(shape))
    q.check_buffers(shape, t.buffers())
    assert t.dequantize().shape == shape
