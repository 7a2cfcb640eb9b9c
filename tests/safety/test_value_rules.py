"""Buffer values a format never writes are refused on read, naming the tensor and the buffer: MXFP4's
E8M0 NaN scale byte (0xFF), in a scale's valid region or its padding, whole, sliced, or as a member
of a grouped tensor; and on dequantize."""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf


def _poisoned(row: int, col: int) -> ts.MXFP4Tensor:
    t = ts.MXFP4Quantizer()(torch.randn(64, 64))
    s = t._rowwise_scale_inv.clone()
    s[row, col] = 0xFF
    return ts.MXFP4Tensor((64, 64), t.dtype, t.quantizer, _rowwise_data=t._rowwise_data, _rowwise_scale_inv=s)


@pytest.mark.parametrize("where", [(5, 1), (100, 3)], ids=["valid region", "padding"])
def test_nan_scale_byte_is_refused_on_read_naming_tensor_and_buffer(tmp_path, where):
    bad = _poisoned(*where)
    ts.save_quantized({"w": bad, "ok": ts.MXFP4Quantizer()(torch.randn(32, 32))}, tmp_path / "ck.safetensors")
    with ts.open(tmp_path / "ck.safetensors") as ckpt:
        assert ckpt.get("ok").shape == (32, 32)  # the other tensor reads
        with pytest.raises(tse.CheckpointError, match="0xFF") as e:
            ckpt.get("w")
        assert e.value.tensor == "w" and e.value.field == "_rowwise_scale_inv"
        if where[0] < 64:  # a slice holding the block
            with pytest.raises(tse.CheckpointError, match="0xFF"):
                ckpt.get("w", rows=(0, 32))
    with pytest.raises(tse.CheckpointError, match="0xFF"):
        ts.load_quantized(tmp_path / "ck.safetensors")
    with pytest.raises(tse.FormatError, match="_rowwise_scale_inv"):
        bad.dequantize()


def test_nan_scale_byte_in_a_grouped_member_is_refused(tmp_path):
    good = ts.MXFP4Quantizer()(torch.randn(64, 64))
    g = tsf.GroupedTensor.from_members([good, _poisoned(7, 0)])
    ts.save_quantized({"experts": g}, tmp_path / "ck")
    with ts.open(tmp_path / "ck") as ckpt:
        with pytest.raises(tse.CheckpointError, match="member 1.*0xFF") as e:
            ckpt.get("experts")
        assert e.value.tensor == "experts"
        assert ckpt.get("experts", member=0).shape == (64, 64)
        with pytest.raises(tse.CheckpointError, match="0xFF"):
            ckpt.get("experts", member=1)
