"""TensorProto: data-free prototypes of plain and quantized tensors."""

from __future__ import annotations

import msgpack
import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf


def test_plain_proto():
    t = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    p = ts.to_tensor_proto(t)
    assert p == ts.TensorProto((3, 4), torch.float16, None, True, torch.device("cpu"))
    assert not p.is_quantized and p.inner_names() == [] and p.nbytes == 24
    made = p.create_tensor()
    assert made.shape == (3, 4) and made.dtype == torch.float16 and made.requires_grad
    with pytest.raises(tse.FormatError):
        p.create_metadata()


@pytest.mark.parametrize("q", [ts.MXFP8Quantizer(), ts.NVFP4Quantizer(rowwise=False),
                               ts.Float8Quantizer(2.0, 0.0, columnwise=False)], ids=lambda q: q.kind)
def test_quantized_proto_round_trips_through_msgpack(q):
    t = q(torch.randn(64, 96 if q.kind == "mxfp8" else 64))
    p = ts.to_tensor_proto(t)
    assert p.is_quantized and p.quantizer == q and p.inner_names() == list(t.buffers())
    again = ts.TensorProto.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict())), device="cpu")
    assert again == p and hash(again) == hash(p)
    assert again.nbytes == sum(b.numel() * b.element_size() for b in t.buffers().values())


def test_create_tensor_on_meta_and_with_requires_grad():
    p = ts.TensorProto((128, 256), torch.bfloat16, ts.Float8BlockQuantizer(), requires_grad=True,
                       device="meta")
    t = p.create_tensor()
    assert isinstance(t, tsf.Float8BlockwiseQTensor) and t.device.type == "meta" and t.requires_grad
    assert all(b.device.type == "meta" for b in t.buffers().values())
    assert p.create_metadata() == tsf.StorageMeta("Float8BlockwiseQTensor", p.quantizer, torch.bfloat16, True)
    cpu = p.create_tensor(device="cpu")
    assert cpu.device.type == "cpu"


def test_assemble_accepts_list_in_inner_names_order():
    q = ts.NVFP4Quantizer()
    t = q(torch.randn(32, 32))
    p = ts.to_tensor_proto(t)
    again = p.assemble([getattr(t, n) for n in p.inner_names()])
    assert torch.equal(again.dequantize(), t.dequantize())


def test_proto_of_bare_storage():
    s = ts.MXFP8Quantizer().quantize(torch.randn(32, 64, dtype=torch.bfloat16), internal=True)
    p = ts.to_tensor_proto(s)
    assert p.shape == (32, 64) and p.dtype == torch.bfloat16 and p.quantizer == s.quantizer


def test_nbytes_per_recipe_for_a_4096_square_weight():
    # Compact scales with padding: exact figures derived from TE's scale shapes.
    shape, row = (4096, 4096), dict(columnwise=False)
    assert ts.TensorProto(shape, torch.bfloat16, ts.MXFP8Quantizer(**row)).nbytes == 4096 * 4096 + 4096 * 128
    assert ts.TensorProto(shape, torch.bfloat16, ts.Float8BlockQuantizer(**row)).nbytes == 4096 * 4096 + 32 * 32 * 4
    assert ts.TensorProto(shape, torch.bfloat16, ts.NVFP4Quantizer(**row)).nbytes == 4096 * 2048 + 4096 * 256 + 4
    assert ts.TensorProto(shape, torch.bfloat16, ts.Float8CurrentScalingQuantizer(**row)).nbytes == 4096 * 4096 + 4


def test_bad_inputs():
    with pytest.raises(tse.FormatError):
        ts.to_tensor_proto([1, 2])
    with pytest.raises(tse.FormatError):
        ts.TensorProto.from_dict({"shape": [1], "dtype": "object"})
