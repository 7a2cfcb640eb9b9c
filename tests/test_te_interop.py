"""te_serial.from_te / to_te against TE's real Python classes (TE wheel + tests/te_shim.py on CPU)."""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.te.interop import is_te_tensor
import te_shim
from helpers import E4M3, E5M2, FORMAT_CASES, USAGES, assert_same_tensor, make_input, same_bits, same_values

te = te_shim.install()
if te is None:  # only where the test extra (transformer-engine wheel) is not installed
    pytest.skip("transformer-engine wheel not installed", allow_module_level=True)

CASES = [(make, shape) for make, shape in FORMAT_CASES if make(True, True).has_te_class]
PARAMS = [pytest.param(make, shape, usage, id=f"{make(*usage).kind}{i}-{usage}")
          for i, (make, shape) in enumerate(CASES) for usage in USAGES]


@pytest.mark.parametrize("make,shape,usage", PARAMS)
def test_round_trip_through_te_classes_is_byte_identical(make, shape, usage):
    ours = make(*usage)(make_input("outliers", shape, torch.bfloat16, 3))
    theirs = ts.to_te(ours)
    assert type(theirs).__module__.startswith("transformer_engine.")
    assert is_te_tensor(theirs) and not is_te_tensor(ours)
    assert tuple(theirs.shape) == tuple(shape) and theirs.dtype == torch.bfloat16
    for n, b in te_shim.te_buffers(theirs).items():
        assert b is getattr(ours, n)  # shares the bytes
    back = ts.from_te(theirs)
    assert_same_tensor(back, ours)
    fields = te_shim.te_quantizer_fields(theirs._quantizer)
    assert (fields["rowwise_usage"], fields["columnwise_usage"]) == usage


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_te_float8_dequantize_equals_ours_after_round_trip(fp8):
    x = make_input("specials", (48, 80), torch.bfloat16)
    ours = ts.Float8CurrentScalingQuantizer(fp8)(x)
    theirs = ts.to_te(ours)
    assert same_values(theirs.dequantize(dtype=torch.float32), ours.dequantize(torch.float32))


def test_swizzled_scales_are_unswizzled():
    for q, shape in ((ts.MXFP8Quantizer(), (128, 256)), (ts.NVFP4Quantizer(), (128, 256))):
        ours = q(torch.randn(shape))
        b = ours.buffers()
        sw = {n: (tsf.swizzle_scales(v, columnwise=(n == "_columnwise_scale_inv" and q.kind == "mxfp8"))
                  if "scale_inv" in n else v) for n, v in b.items()}
        if q.kind == "mxfp8":
            theirs = te_shim.make_te_mxfp8(sw["_rowwise_data"], sw["_rowwise_scale_inv"], sw["_columnwise_data"],
                                           sw["_columnwise_scale_inv"], E4M3, shape, torch.float32,
                                           with_gemm_swizzled_scales=True)
        else:
            theirs = te_shim.make_te_nvfp4(*(sw[k] for k in tsf.NVFP4TensorStorage.BUFFERS), shape, torch.float32,
                                           with_gemm_swizzled_scales=True)
        assert not torch.equal(sw["_rowwise_scale_inv"], b["_rowwise_scale_inv"])
        assert_same_tensor(ts.from_te(theirs), ours)


def test_uninitialized_scale_padding_is_zeroed_in_a_copy():
    ours = ts.MXFP8Quantizer(columnwise=False)(torch.randn(64, 64))
    dirty = ours._rowwise_scale_inv.clone()
    dirty[64:] = 0xAB
    dirty[:, 2:] = 0xCD
    theirs = te_shim.make_te_mxfp8(ours._rowwise_data, dirty, None, None, E4M3, (64, 64), torch.float32)
    back = ts.from_te(theirs)
    assert_same_tensor(back, ours)
    assert dirty[64:, :2].eq(0xAB).all() and dirty[:, 2:].eq(0xCD).all()  # TE's tensor is left as it was
    blk = ts.Float8BlockQuantizer(block_scaling_dim=1, columnwise=False)(torch.randn(10, 300))
    s = blk._rowwise_scale_inv.clone()
    s[:, 10:] = float("nan")  # 1-D scales are [ceil(K/128), roundup(M, 4)]: padding columns
    theirs = te_shim.make_te_blockwise(blk._rowwise_data, s, None, None, E4M3, (10, 300), torch.float32,
                                       is_2D_scaled=False)
    assert_same_tensor(ts.from_te(theirs), blk)


def test_hopper_transpose_only_and_blackwell_data_only_float8():
    x = torch.randn(24, 40)
    both = ts.Float8CurrentScalingQuantizer()(x)
    col_only = te_shim.make_te_float8(None, both._scale_inv, E4M3, (24, 40), torch.float32,
                                      transpose_u8=both._transpose)
    got = ts.from_te(col_only)
    assert got.quantizer.rowwise is False and got.quantizer.columnwise is True
    assert same_bits(got._transpose, both._transpose) and got._data is None
    assert torch.equal(got.dequantize(torch.float32), both.dequantize(torch.float32))
    q = te.Float8CurrentScalingQuantizer(te_shim.to_te_dtype(E4M3), torch.device("cpu"), rowwise=True, columnwise=True)
    blackwell = te_shim.make_te_float8(both._data, both._scale_inv, E4M3, (24, 40), torch.float32, quantizer=q)
    got = ts.from_te(blackwell)
    assert_same_tensor(got, both)  # the transpose is derived from _data, exactly


def test_pickled_float8_without_quantizer_keeps_its_bytes():
    ours = ts.Float8CurrentScalingQuantizer(E5M2, columnwise=False)(torch.randn(8, 16))
    theirs = te_shim.make_te_float8(ours._data, ours._scale_inv, E5M2, (8, 16), torch.bfloat16, quantizer=False)
    got = ts.from_te(theirs)
    assert same_bits(got._data, ours._data) and got.quantizer.fp8_dtype == E5M2


def test_te_storage_objects_convert_too():
    ours = ts.Float8BlockQuantizer()(torch.randn(130, 260))
    b = ours.buffers()
    storage = te.Float8BlockwiseQTensorStorage(b["_rowwise_data"], b["_rowwise_scale_inv"], b["_columnwise_data"],
                                               b["_columnwise_scale_inv"], te_shim.to_te_dtype(E4M3), None, True,
                                               fake_dtype=torch.float32)
    assert is_te_tensor(storage) and not isinstance(storage, torch.Tensor)
    assert_same_tensor(ts.from_te(storage), ours)


def test_save_accepts_te_tensors_and_load_can_return_them(tmp_path):
    sd = {f"w{i}": ts.to_te(make(True, True)(make_input("random", shape, torch.bfloat16, i)))
          for i, (make, shape) in enumerate(CASES)}
    sd["bias"] = torch.randn(8)
    path = tmp_path / "te.safetensors"
    ts.save_quantized(sd, path)
    plain = ts.load_quantized(path)
    as_te = ts.load_quantized(path, as_te=True)
    for k, t in sd.items():
        if k == "bias":
            assert torch.equal(as_te[k], t)
            continue
        assert type(as_te[k]) is type(t)
        assert_same_tensor(plain[k], ts.from_te(t))
        for n, b in te_shim.te_buffers(t).items():
            assert same_bits(te_shim.te_buffers(as_te[k])[n], b), (k, n)


def test_a_format_without_a_te_class_is_refused_by_name():
    """MXFP4 (no tensor class in TE 2.20): to_te and to_te_spec name the format, alone or as group members."""
    t = ts.MXFP4Quantizer()(make_input("random", (64, 64), torch.bfloat16))
    for call in (lambda: ts.to_te(t), lambda: ts.to_te_spec(ts.to_tensor_proto(t)),
                 lambda: ts.to_te(tsf.GroupedTensor.from_members([t, t]))):
        with pytest.raises(tse.FormatError, match="mxfp4.*no tensor class"):
            call()
