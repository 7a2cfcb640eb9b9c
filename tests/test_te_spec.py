"""te_serial.to_te_spec / from_te_spec against TE 2.20's own TensorSpec, and the refusal of TE's
experimental classes (TE wheel + tests/te_shim.py on CPU).

TE's quantizers here are built with TE's own constructors (``_te_quantizer``, written from TE's
signatures, not through te-serial's adapters), so agreement is checked against TE, not ourselves.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial.errors import FormatError, UnsupportedValueError
from te_serial.formats.te_adapter import TE_QUANTIZER_ADAPTERS, te_value_fields
import te_shim
from helpers import E4M3, E5M2, USAGES, assert_same_tensor, make_input, same_bits

te = te_shim.install()
if te is None:  # only where the test extra (transformer-engine wheel) is not installed
    pytest.skip("transformer-engine wheel not installed", allow_module_level=True)

from transformer_engine.pytorch.dynamo import TensorSpec, to_tensor_spec  # noqa: E402  (after the shim)

#: every format and variant TE's TensorSpec implements, each on 2-D, 3-D and (where the format
#: allows) non-multiple-of-128 shapes
VARIANTS = {
    "fp8_current": (lambda r, c: ts.Float8CurrentScalingQuantizer(E5M2, rowwise=r, columnwise=c,
                                                                  force_pow_2_scales=True, amax_epsilon=1e-3),
                    [(37, 53), (3, 5, 70), (128, 256)]),
    "mxfp8": (lambda r, c: ts.MXFP8Quantizer(E4M3, rowwise=r, columnwise=c),
              [(2, 32, 64), (96, 160), (32, 32)]),
    "mxfp8_2d": (lambda r, c: ts.MXFP8Quantizer(E5M2, rowwise=r, columnwise=c, with_2d_quantization=True),
                 [(64, 96), (2, 64, 32)]),
    "block_1d": (lambda r, c: ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=1,
                                                      force_pow_2_scales=False, amax_epsilon=1e-6),
                 [(200, 300), (2, 65, 130), (1, 7)]),
    "block_2d": (lambda r, c: ts.Float8BlockQuantizer(E5M2, rowwise=r, columnwise=c, block_scaling_dim=2),
                 [(2, 65, 130), (128, 256), (130, 129)]),
    "nvfp4": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c), [(2, 16, 32), (48, 80)]),
    "nvfp4_2d": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_2d_quantization=True),
                 [(144, 160), (2, 32, 16)]),
    "nvfp4_rht": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_rht=True, with_post_rht_amax=True,
                                                 with_random_sign_mask=False),
                  [(2, 16, 48), (64, 32)]),
    "nvfp4_rht_sr": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_rht=True, with_post_rht_amax=True,
                                                    stochastic_rounding=True), [(32, 64)]),
    "nvfp4_4over6": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                                                    nvfp4_4over6_err_mode="MSE"), [(32, 64), (2, 16, 48)]),
    "nvfp4_row_scaled": (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, row_scaled_nvfp4=True),
                         [(48, 32), (2, 16, 64)]),
}
PARAMS = [pytest.param(name, usage, id=f"{name}-{'r' * usage[0]}{'c' * usage[1]}")
          for name in VARIANTS for usage in USAGES
          if usage == (True, False) or name != "nvfp4_row_scaled"]  # row-scaled NVFP4 is rowwise only


def _te_quantizer(q):
    """TE's own quantizer with ``q``'s fields, through TE's constructor (the oracle)."""
    use = dict(rowwise=q.rowwise, columnwise=q.columnwise)
    if isinstance(q, ts.NVFP4Quantizer):
        return te.NVFP4Quantizer(**use, with_rht=q.with_rht, with_post_rht_amax=q.with_post_rht_amax,
                                 with_2d_quantization=q.with_2d_quantization,
                                 stochastic_rounding=q.stochastic_rounding,
                                 with_random_sign_mask=q.with_random_sign_mask, row_scaled_nvfp4=q.row_scaled_nvfp4,
                                 nvfp4_use_4over6=q.nvfp4_use_4over6, nvfp4_e4m3_max=q.nvfp4_e4m3_max,
                                 nvfp4_4over6_err_mode=q.nvfp4_4over6_err_mode)
    dt = te_shim.to_te_dtype(q.fp8_dtype)
    if isinstance(q, ts.Float8CurrentScalingQuantizer):
        return te.Float8CurrentScalingQuantizer(dt, torch.device("cpu"), **use, amax_epsilon=q.amax_epsilon,
                                                force_pow_2_scales=q.force_pow_2_scales)
    if isinstance(q, ts.MXFP8Quantizer):
        return te.MXFP8Quantizer(dt, **use, with_2d_quantization=q.with_2d_quantization)
    if isinstance(q, ts.Float8BlockQuantizer):
        return te.Float8BlockQuantizer(dt, **use, amax_epsilon=q.amax_epsilon, block_scaling_dim=q.block_scaling_dim,
                                       force_pow_2_scales=q.force_pow_2_scales)
    raise AssertionError(type(q))


def _layout(specs) -> list:
    return [(n, tuple(s), dt) for n, (s, dt) in specs.items()]


@pytest.mark.parametrize("name,usage", PARAMS)
def test_buffers_and_fields_equal_te_tensor_spec(name, usage):
    make, shapes = VARIANTS[name]
    q = make(*usage)
    tq = _te_quantizer(q)
    for shape in shapes:
        proto = ts.TensorProto(shape, torch.bfloat16, q, requires_grad=usage[1], device="cpu")
        spec = ts.to_te_spec(proto)
        assert isinstance(spec, TensorSpec)
        assert spec.quantizer == tq  # TE's value equality: the same fields as TE's constructor gives
        assert (tuple(spec.shape), spec.dtype, spec.requires_grad, spec.device) == \
               (tuple(shape), torch.bfloat16, usage[1], torch.device("cpu"))
        # names, order, shapes, dtypes: TE's inner_names() and inner_tensor_specs() == ours
        assert list(spec.inner_names()) == proto.inner_names(), shape
        assert _layout(tq.inner_tensor_specs(shape)) == _layout(proto.buffer_specs()), shape
        assert ts.from_te_spec(spec) == proto
        # TE assembles its own tensor over these buffers (pure Python), and from_te reads it back
        made = spec.create_tensor()
        assert type(made) is getattr(te, q.tensor_class.__name__)
        assert list(te_shim.te_buffers(made)) == proto.inner_names()
        assert ts.to_tensor_proto(made) == proto


@pytest.mark.parametrize("name,usage", PARAMS)
def test_spec_of_a_te_tensor_assembles_the_bytes_from_te_reads(name, usage):
    make, shapes = VARIANTS[name]
    q = make(*usage).deterministic()  # stochastic rounding is not reproducible: bytes need RTN
    for i, shape in enumerate(shapes):
        ours = q(make_input("outliers", shape, torch.bfloat16, i))
        # a TE tensor over these bytes, assembled by TE from a spec holding TE's own quantizer
        spec_in = TensorSpec(shape, torch.bfloat16, _te_quantizer(q), device=torch.device("cpu"))
        theirs = spec_in.assemble([getattr(ours, n) for n in spec_in.inner_names()])
        proto = ts.from_te_spec(to_tensor_spec(theirs))
        got = proto.assemble(te_shim.te_buffers(theirs))
        want = ts.from_te(theirs)
        assert_same_tensor(got, want, f"{name}{shape}")
        assert_same_tensor(got, ours, f"{name}{shape}")


def test_delayed_scaling_keeps_te_serial_path():
    """TE's Float8Quantizer has no value key and no inner_tensor_specs: the spec carries a real TE
    Float8Quantizer whose scale / amax read back exactly; the buffers come from our proto."""
    for usage in USAGES:
        q = ts.Float8Quantizer(1 / 3, 7.25, E5M2, rowwise=usage[0], columnwise=usage[1])
        proto = ts.TensorProto((3, 5, 70), torch.float16, q)
        spec = ts.to_te_spec(proto)
        assert type(spec.quantizer) is te.Float8Quantizer
        assert spec.quantizer.scale.dtype == torch.float32 and spec.quantizer.scale.item() == q.scale
        assert ts.from_te_spec(spec) == proto
        with pytest.raises(NotImplementedError):  # TE cannot list its buffers (te-serial can)
            spec.inner_names()
        ours = q(make_input("specials", (3, 5, 70), torch.float16, 1))
        b = ours.buffers()
        tq = te.Float8Quantizer(torch.tensor([q.scale]), torch.tensor([q.amax]), te_shim.to_te_dtype(E5M2),
                                rowwise=usage[0], columnwise=usage[1])
        theirs = te_shim.make_te_float8(b.get("_data"), b["_scale_inv"], E5M2, (3, 5, 70), torch.float16,
                                        transpose_u8=b.get("_transpose"), quantizer=tq)
        back = ts.from_te_spec(to_tensor_spec(theirs))
        assert back.quantizer == q
        assert_same_tensor(back.assemble(te_shim.te_buffers(theirs)), ts.from_te(theirs))


def test_plain_specs_round_trip():
    proto = ts.TensorProto((4, 6), torch.float32, requires_grad=True, device="cpu")
    spec = ts.to_te_spec(proto)
    assert spec.quantizer is None and spec.inner_names() == ("data",)
    assert ts.from_te_spec(spec) == proto
    assert ts.from_te_spec(to_tensor_spec(torch.zeros(2, 3, dtype=torch.bfloat16))) == \
        ts.TensorProto((2, 3), torch.bfloat16, device="cpu")


def test_blackwell_float8_layout_is_the_documented_difference():
    """With ``is_non_tn_fp8_gemm_supported()`` (Blackwell) TE lists ``_data`` for the columnwise
    usage; te-serial's proto keeps ``_transpose``; from_te derives it from TE's bytes."""
    q = ts.Float8CurrentScalingQuantizer(E4M3, rowwise=False, columnwise=True)
    ours = q(make_input("random", (40, 24)))
    old = te_shim.set_non_tn_fp8_gemm(True)
    try:
        spec = ts.to_te_spec(ts.TensorProto((40, 24), torch.bfloat16, q))
        assert spec.inner_names() == ("_data", "_scale_inv")
        proto = ts.from_te_spec(spec)
        assert proto.inner_names() == ["_transpose", "_scale_inv"]
        data = ours._transpose.movedim(0, -1).contiguous()
        theirs = spec.assemble([data, ours._scale_inv])
        assert_same_tensor(ts.from_te(theirs), ours)
    finally:
        te_shim.set_non_tn_fp8_gemm(old)


def test_te_scale_padding_is_shared_by_assemble_and_zeroed_by_from_te():
    """assemble over TE's buffers keeps TE's bytes (uninitialized scale padding included);
    from_te zeroes that padding in a copy. Both dequantize the same."""
    q = ts.MXFP8Quantizer(rowwise=True, columnwise=False)
    ours = q(make_input("random", (64, 96), torch.float32))
    scale = ours._rowwise_scale_inv.clone()
    scale[64:] = 0xFF
    scale[:, 3:] = 0xFF
    theirs = te_shim.make_te_mxfp8(ours._rowwise_data, scale, None, None, E4M3, (64, 96), torch.float32)
    got = ts.from_te_spec(to_tensor_spec(theirs)).assemble(te_shim.te_buffers(theirs))
    assert got._rowwise_scale_inv is scale
    assert_same_tensor(ts.from_te(theirs), ours)
    assert same_bits(got.dequantize(), ours.dequantize())


def test_fields_te_serial_cannot_hold_are_refused():
    swizzled = te_shim.make_te_mxfp8(torch.zeros(32, 32, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8),
                                     None, None, E4M3, (32, 32), torch.float32, with_gemm_swizzled_scales=True)
    with pytest.raises(FormatError, match="swizzled"):
        ts.from_te_spec(to_tensor_spec(swizzled))
    bad = te.Float8BlockQuantizer(te.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    bad.block_len = 64  # TensorSpec's copy() resets it, so ask the adapter directly
    with pytest.raises(FormatError, match="block_len=64"):
        TE_QUANTIZER_ADAPTERS["Float8BlockQuantizer"].from_te_quantizer(bad)
    # a TE field te-serial's quantizer lacks (a newer TE's) is refused, never dropped
    fields = {**te_value_fields(te.MXFP8Quantizer(te.DType.kFloat8E4M3)), "some_new_field": 1}
    with pytest.raises(FormatError, match="some_new_field=1"):
        TE_QUANTIZER_ADAPTERS["MXFP8Quantizer"].quantizer_from_fields("MXFP8Quantizer", fields)
    # row-scaled NVFP4 with a columnwise copy: te-serial's rule, raised with the field's name
    with pytest.raises(FormatError, match="row_scaled_nvfp4"):
        ts.from_te_spec(TensorSpec((32, 32), torch.float32, te.NVFP4Quantizer(row_scaled_nvfp4=True)))
    # run-time options that do not change the stored tensor are not kept
    cq = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, "cpu", with_amax_reduction=True)
    cq.internal = True
    assert ts.from_te_spec(TensorSpec((8, 8), torch.float32, cq)).quantizer == ts.Float8CurrentScalingQuantizer()
    with pytest.raises(FormatError, match="TensorSpec"):
        ts.from_te_spec(object())
    with pytest.raises(FormatError, match="TensorProto"):
        ts.to_te_spec(TensorSpec((8, 8), torch.float32))


# ----------------------------------------------------------------------------- experimental classes


@pytest.fixture
def experimental(monkeypatch):
    """TE's experimental Identity / Hybrid classes, built for real on CPU.

    ``HybridQuantizer.__init__`` imports ``transformer_engine.pytorch.quantization`` only to reject
    a ``QuantizerRequest``; that module needs ``onnxscript`` (absent here), so where it does not
    import, a stand-in holding just that class is put in ``sys.modules`` for this test.
    """
    try:
        import transformer_engine.pytorch.quantization  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("transformer_engine.pytorch.quantization")
        stand_in.QuantizerRequest = type("QuantizerRequest", (), {})
        monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    from transformer_engine.pytorch.tensor.hybrid_tensor import HybridQuantizedTensor, HybridQuantizer
    from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer, IdentityTensor

    x = make_input("random", (64, 96), torch.bfloat16)
    ident = IdentityQuantizer()(x)
    bare_q = IdentityQuantizer()
    bare_q.internal = True
    bare = bare_q(x)
    mx = ts.to_te(ts.MXFP8Quantizer(rowwise=True, columnwise=False)(x))  # MXFP8 rowwise + BF16 columnwise
    hq = HybridQuantizer(rowwise_quantizer=te.MXFP8Quantizer(te.DType.kFloat8E4M3),
                         columnwise_quantizer=IdentityQuantizer())
    hybrid = HybridQuantizedTensor(shape=x.shape, dtype=x.dtype, rowwise_storage=mx,
                                   columnwise_storage=IdentityQuantizer()(x), quantizer=hq, device=x.device)
    assert type(ident) is IdentityTensor and type(bare).__name__ == "IdentityTensorStorage"
    return {"IdentityTensor": ident, "IdentityTensorStorage": bare, "HybridQuantizedTensor": hybrid}


def test_experimental_te_classes_are_refused_everywhere(experimental, tmp_path):
    for cls, t in experimental.items():
        for fn in (ts.from_te, ts.to_tensor_proto):
            with pytest.raises(UnsupportedValueError, match=f"{cls} is marked experimental"):
                fn(t)
        with pytest.raises(UnsupportedValueError, match=rf"{cls} is marked experimental.*'layers\.0\.w'"):
            ts.save_quantized({"layers": [{"w": t, "b": torch.zeros(3)}]}, tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()  # nothing written, nothing half-written
        quantizer = getattr(t, "_quantizer", None)
        if quantizer is not None:  # a spec of it: refused by its quantizer's class
            with pytest.raises(UnsupportedValueError, match=r"(Hybrid|Identity)Quantizer is marked experimental"):
                ts.from_te_spec(TensorSpec(tuple(t.size()), torch.bfloat16, quantizer))
    # a TE tensor of a supported class still saves beside the refusal's code path
    ok = ts.to_te(ts.MXFP8Quantizer()(make_input("random", (32, 64))))
    ts.save_quantized({"w": ok}, tmp_path / "ok")
    assert_same_tensor(ts.load_quantized(tmp_path / "ok")["w"], ts.from_te(ok))


def test_readme_example_runs():
    text = (Path(__file__).parents[1] / "docs" / "te_interop.md").read_text()
    section = text.split("## Transformer Engine interop", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "to_te_spec" in b)
    exec(compile(code, "docs/te_interop.md", "exec"), {})
