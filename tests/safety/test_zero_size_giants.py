"""Zero-size tensors with huge dimensions: no bytes, yet more than torch can lay out.

``torch.empty((2**52, 2**52, 2**52, 0))`` raises RuntimeError ("Storage size calculation
overflowed"): torch counts each dimension as at least 1 for the strides. Such a shape in a
manifest, a safetensors header, a single-file checkpoint, a plain safetensors source or a
prototype is refused with te-serial's own error, at every entry point.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import te_serial as ts
import te_serial.dcp as tdcp
from te_serial.errors import TeSerialError

from .safety_helpers import Ck, read_st, st_bytes

GIANT = [2 ** 52, 2 ** 52, 2 ** 52, 0]
ENTRY_POINTS = {
    "open.get": lambda p: ts.open(p).get("z"),
    "load_quantized": lambda p: ts.load_quantized(p),
    "read_protos": lambda p: ts.read_protos(p),
    "verify": lambda p: ts.verify(p),
    "convert": lambda p: ts.convert(p, p.parent / "out", recipe="bf16"),
    "dcp.load": lambda p: tdcp.load({"z": torch.zeros(0), "a": torch.zeros(3)}, p),
}


def _giant_checkpoint(path, single: bool):
    ts.save_quantized({"z": torch.zeros(0), "a": torch.ones(3)}, path)
    ck = Ck(path)

    def grow(doc):
        i = doc["tensors"]["names"].index("z")
        p = doc["protos"][doc["tensors"]["protos"][i]]
        p["shape"] = p["buffers"][0]["shape"] = list(GIANT)
    ck.edit(grow)
    shard = path if single else next(p for p in path.iterdir() if p.suffix == ".safetensors")
    header, body = read_st(shard)  # the manifest edit above rewrote a single file's header too
    header["z"]["shape"] = list(GIANT)
    shard.write_bytes(st_bytes(header, body))
    if not single:
        ck.sync_sizes()


@pytest.mark.parametrize("form", ["dir", "single"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_zero_size_giant_in_a_checkpoint(tmp_path, form, entry):
    path = tmp_path / ("c.safetensors" if form == "single" else "c")
    _giant_checkpoint(path, form == "single")
    if entry == "dcp.load" and form == "single":
        pytest.skip("DCP reads checkpoint directories")
    with pytest.raises(TeSerialError, match="larger than torch can lay out"):
        ENTRY_POINTS[entry](path)


def test_a_zero_size_giant_in_a_plain_safetensors_source(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"z": torch.zeros(0), "a": torch.ones(3)}, str(src / "model.safetensors"))
    header, body = read_st(src / "model.safetensors")
    header["z"]["shape"] = list(GIANT)
    (src / "model.safetensors").write_bytes(st_bytes(header, body))
    with pytest.raises(TeSerialError, match="larger than torch can lay out"):
        ts.convert(src, tmp_path / "out", recipe="mxfp8")


@pytest.mark.parametrize("quantizer", [None, "mxfp8"])
def test_a_prototype_of_a_zero_size_giant(quantizer):
    q = ts.MXFP8Quantizer() if quantizer else None
    with pytest.raises(TeSerialError, match="larger than torch can lay out"):
        ts.TensorProto((2 ** 40, 2 ** 40, 0, 2 ** 20 if q is None else 64), torch.bfloat16, q)
    assert ts.TensorProto((2 ** 20, 0), torch.bfloat16).create_tensor().shape == (2 ** 20, 0)  # fine: fits
