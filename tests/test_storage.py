"""Storage and wrapper classes: declared buffers, flatten/unflatten, registry, ops, devices."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from helpers import same_bits

QUANTIZERS = [
    ts.Float8CurrentScalingQuantizer(),
    ts.Float8CurrentScalingQuantizer(rowwise=False, columnwise=True),
    ts.Float8Quantizer(4.0, 0.0),
    ts.MXFP8Quantizer(),
    ts.MXFP8Quantizer(rowwise=False),
    ts.Float8BlockQuantizer(block_scaling_dim=1),
    ts.Float8BlockQuantizer(block_scaling_dim=2, rowwise=False),
    ts.NVFP4Quantizer(),
    ts.NVFP4Quantizer(with_2d_quantization=True, rowwise=False),
]
IDS = [f"{q.kind}-{'r' if q.rowwise else ''}{'c' if q.columnwise else ''}" for q in QUANTIZERS]
SHAPES = [(64, 128), (2, 32, 64)]


def _x(shape, dtype=torch.bfloat16):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_alloc_shapes_equal_what_quantize_produces(q, shape):
    t = q(_x(shape))
    alloc = q.alloc_tensors(shape)
    specs = q.describe_buffers(shape)
    assert list(alloc) == list(specs) == list(t.buffers())
    for name, b in t.buffers().items():
        assert (tuple(b.shape), b.dtype) == specs[name] == (tuple(alloc[name].shape), alloc[name].dtype)
    assert set(specs) <= set(q.storage_class.BUFFERS)
    q.check_buffers(shape, t.buffers())
    assert t.quantized_nbytes() == q.nbytes(shape) == ts.to_tensor_proto(t).nbytes


@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_flatten_unflatten_round_trip(q):
    t = q(_x((64, 128)))
    names, meta = t.__tensor_flatten__()
    assert names == list(t.buffers())
    assert meta.storage == type(t).__name__ and meta.quantizer == q
    again = type(t).__tensor_unflatten__({n: getattr(t, n) for n in names}, meta, t.shape, t.stride())
    assert type(again) is type(t) and again.shape == t.shape and again.dtype == t.dtype
    for n in names:
        assert getattr(again, n) is getattr(t, n)
    assert same_bits(again.dequantize(), t.dequantize())


def test_registry_is_filled_by_subclassing_and_refuses_unknown_names():
    for cls in (tsf.Float8Tensor, tsf.Float8TensorStorage, tsf.MXFP8Tensor, tsf.NVFP4TensorStorage,
                tsf.Float8BlockwiseQTensor):
        assert tsf.resolve_storage(cls.__name__) is cls
    t = ts.MXFP8Quantizer()(_x((32, 32)))
    names, meta = t.__tensor_flatten__()
    for bad in ("os.system", "builtins.eval", "Tensor", None):
        with pytest.raises(tse.UnknownStorageError):
            tsf.QuantizedTensorStorage.__tensor_unflatten__(
                {n: getattr(t, n) for n in names}, meta._replace(storage=bad), t.shape, None)


def test_a_new_storage_class_registers_itself_and_duplicates_are_refused():
    class MyTestStorage(tsf.QuantizedTensorStorage):
        BUFFERS = ("_a",)
    try:
        assert tsf.resolve_storage("MyTestStorage") is MyTestStorage
        with pytest.raises(tse.FormatError, match="registered twice"):
            type("Float8Tensor", (tsf.QuantizedTensorStorage,), {"BUFFERS": ("_x",)})
    finally:
        tsf.STORAGE_REGISTRY.pop("MyTestStorage")


def test_unknown_buffer_names_are_refused():
    with pytest.raises(tse.BufferMismatchError, match="_bogus"):
        tsf.Float8TensorStorage((4, 4), torch.float32, ts.Float8CurrentScalingQuantizer(),
                               _bogus=torch.zeros(1))


def test_check_buffers_names_the_mismatch():
    q = ts.MXFP8Quantizer()
    t = q(_x((64, 64)))
    bufs = t.buffers()
    bufs["_rowwise_scale_inv"] = torch.zeros(128, 3, dtype=torch.uint8)
    with pytest.raises(tse.BufferMismatchError, match="_rowwise_scale_inv"):
        q.check_buffers((64, 64), bufs, where="w")
    bufs.pop("_rowwise_scale_inv")
    with pytest.raises(tse.BufferMismatchError, match="buffers"):
        q.check_buffers((64, 64), bufs)


@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_device_moves_keep_subclass_and_bytes(q):
    t = q(_x((64, 128)))
    for moved in (t.to("cpu", copy=True), t.cpu(), t.to(device="meta").to("cpu") if False else t.detach()):
        assert type(moved) is type(t) and moved.quantizer == q
    m = t.to("meta")
    assert type(m) is type(t) and m.device.type == "meta"
    assert all(b.device.type == "meta" for b in m.buffers().values())
    c = t.to("cpu", copy=True)
    for n, b in t.buffers().items():
        assert same_bits(getattr(c, n), b) and getattr(c, n).data_ptr() != b.data_ptr()


def test_float_dtype_cast_keeps_bytes_and_changes_the_nominal_dtype():
    t = ts.MXFP8Quantizer()(_x((32, 64)))
    for f in (t.to(torch.float32), t.float(), t.half(), t.bfloat16()):
        assert type(f) is type(t) and f.quantizer == t.quantizer and f.dequantize().dtype == f.dtype
        assert all(same_bits(getattr(f, n), b) for n, b in t.buffers().items())
        assert torch.equal(f.dequantize(torch.float32), t.dequantize(torch.float32))
    assert t.float().dtype == torch.float32 and t.half().dtype == torch.float16
    e = t.to(torch.float8_e4m3fn)  # a cast of the values (not a nominal dtype)
    assert type(e) is torch.Tensor and torch.equal(e, t.dequantize().to(torch.float8_e4m3fn))


@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_copy_between_equal_formats_is_raw(q):
    src = q(_x((64, 128)))
    dst = ts.to_tensor_proto(src).create_tensor()
    dst.copy_(src)
    for n, b in src.buffers().items():
        assert same_bits(getattr(dst, n), b)


def test_copy_from_other_format_or_plain_requantizes():
    x = _x((64, 128), torch.float32)
    dst = ts.MXFP8Quantizer()(torch.zeros(64, 128))
    dst.copy_(x)
    assert same_bits(dst._rowwise_data, ts.MXFP8Quantizer()(x)._rowwise_data)
    src = ts.Float8CurrentScalingQuantizer()(x)
    dst.copy_(src)
    assert same_bits(dst._rowwise_data, ts.MXFP8Quantizer()(src.dequantize(torch.float32))._rowwise_data)
    plain = torch.empty(64, 128)
    plain.copy_(src)
    assert torch.equal(plain, src.dequantize(torch.float32))


def test_ops_fall_back_to_dequantize():
    x = torch.randn(3, 128)
    w = ts.Float8BlockQuantizer()(torch.randn(64, 128))
    y = F.linear(x, w)
    assert type(y) is torch.Tensor and torch.allclose(y, F.linear(x, w.dequantize(torch.float32)), atol=1e-5)
    assert torch.equal(w + 1, w.dequantize() + 1)
    assert torch.equal(w.sum(), w.dequantize().sum())


def test_in_place_arithmetic_is_refused():
    w = ts.MXFP8Quantizer()(torch.randn(32, 32))
    with pytest.raises(tse.UnsupportedOperationError):
        w.mul_(2)
    with pytest.raises(tse.UnsupportedOperationError):
        w.zero_()


def test_parameter_detach_clone_empty_like():
    w = ts.NVFP4Quantizer()(torch.randn(32, 64))
    p = torch.nn.Parameter(w, requires_grad=False)
    assert isinstance(p, tsf.NVFP4Tensor) and p.quantizer == w.quantizer
    c = w.clone()
    assert type(c) is type(w) and c._rowwise_data.data_ptr() != w._rowwise_data.data_ptr()
    assert same_bits(c._rowwise_data, w._rowwise_data)
    e = torch.empty_like(w)
    assert type(e) is type(w) and e.buffers().keys() == w.buffers().keys()


def test_requires_grad_and_linear_backward_through_dequantize():
    w = ts.Float8CurrentScalingQuantizer()(torch.randn(16, 32))
    x = torch.randn(4, 32, requires_grad=True)
    F.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.dequantize(torch.float32).sum(0).expand(4, 32))


def test_not_picklable_by_design():
    with pytest.raises(tse.UnsupportedOperationError, match="save_quantized"):
        pickle.dumps(ts.MXFP8Quantizer()(torch.randn(32, 32)))


def test_repr_names_class_shape_and_buffers():
    r = repr(ts.MXFP8Quantizer()(torch.randn(32, 64)))
    assert r.startswith("MXFP8Tensor(shape=[32, 64]") and "_rowwise_scale_inv=uint8[128, 4]" in r


def test_swizzle_matches_te_index_map_and_inverts():
    rows, cols = 256, 8
    s = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    sw = tsf.swizzle_scales(s)
    flat = sw.reshape(-1)
    for r in (0, 1, 31, 32, 127, 128, 200, 255):
        for c in (0, 3, 4, 7):
            tile = (r // 128) * (cols // 4) + c // 4
            off = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[off].item() == s[r, c].item()
    assert torch.equal(tsf.unswizzle_scales(sw), s)
    col = torch.arange(8 * 256, dtype=torch.int32).reshape(8, 256)   # [Mp/32, Kp] columnwise
    assert torch.equal(tsf.unswizzle_scales(tsf.swizzle_scales(col, columnwise=True), columnwise=True), col)
    assert torch.equal(tsf.swizzle_scales(col, columnwise=True).reshape(-1),
                       tsf.swizzle_scales(col.t().contiguous()).reshape(-1))
    with pytest.raises(tse.ShapeError):
        tsf.swizzle_scales(torch.zeros(100, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_cuda_quantize_matches_cpu_and_moves_back(q):
    x = _x((256, 512))
    cpu = q(x)
    gpu = q(x.cuda())
    assert gpu.device.type == "cuda"
    for n, b in cpu.buffers().items():
        assert same_bits(getattr(gpu, n).cpu(), b), n
    back = gpu.cpu()
    assert type(back) is type(cpu) and same_bits(back.dequantize(), cpu.dequantize())
