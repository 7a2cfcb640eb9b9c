"""TE modules' _extra_state in checkpoints: stateless kept as is, delayed scaling stored decoded
(scales and amax histories as ordinary tensors, no pickle), TE's bytes written back on load."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors import safe_open

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
import te_shim
from te_serial.te.extra_state import decode_te_extra_state, encode_te_extra_state

te = te_shim.install()
if te is None:  # only where the test extra (transformer-engine wheel) is not installed
    pytest.skip("transformer-engine wheel not installed", allow_module_level=True)


def _delayed_state():
    import transformer_engine.common.recipe as recipe
    return {"recipe": recipe.DelayedScaling(amax_history_len=16),
            "scale_fwd": torch.tensor([1.0, 2.0, 0.5]), "amax_history_fwd": torch.rand(16, 3),
            "scale_bwd": torch.tensor([4.0, 8.0]), "amax_history_bwd": torch.rand(16, 2),
            "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "name": "fc1"}}


def test_delayed_scaling_extra_state_round_trips_without_pickle(tmp_path, monkeypatch):
    payload = torch.frombuffer(bytearray(pickle.dumps(_delayed_state())), dtype=torch.uint8)
    sd = {"fc1.weight": ts.Float8Quantizer(2.0, 3.0)(torch.randn(16, 32)), "fc1._extra_state": payload,
          "fc2._extra_state": torch.empty(0, dtype=torch.uint8)}
    path = tmp_path / "te.safetensors"
    ts.save_quantized(sd, path)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert {"fc1._extra_state.scale_fwd", "fc1._extra_state.amax_history_fwd"} <= keys
    assert "fc1._extra_state" not in keys  # the pickle itself is not stored
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    out = ts.load_quantized(path)
    got, want = decode_te_extra_state(out["fc1._extra_state"]), decode_te_extra_state(payload)
    assert got["recipe"] == want["recipe"] and got["extra_fp8_variables"] == want["extra_fp8_variables"]
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(got[k], want[k])
    assert out["fc2._extra_state"].dtype == torch.uint8 and out["fc2._extra_state"].numel() == 0
    assert isinstance(out["fc1.weight"], tsf.Float8Tensor)


def test_unrecognized_extra_state_is_refused_naming_the_key(tmp_path):
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("echo pwned",))

    bad = torch.frombuffer(bytearray(pickle.dumps({"recipe": Evil()})), dtype=torch.uint8)
    with pytest.raises(tse.UnsupportedValueError, match="layer._extra_state"):
        ts.save_quantized({"layer._extra_state": bad}, tmp_path / "x")
    assert not (tmp_path / "x" / "te_serial.msgpack").exists()


def test_decoded_state_encodes_back_to_te_bytes():
    state = decode_te_extra_state(torch.frombuffer(bytearray(pickle.dumps(_delayed_state())), dtype=torch.uint8))
    again = encode_te_extra_state(state)
    assert again.dtype == torch.uint8 and decode_te_extra_state(again)["recipe"] == state["recipe"]


def test_dcp_load_fills_te_extra_state(tmp_path, monkeypatch):
    """``te_serial.dcp.load`` gives a TE module's delayed-scaling ``_extra_state`` back as TE's own
    bytes, as ``load_quantized`` does: the scales and amax histories read, the recipe rebuilt,
    nothing unpickled; a stateless (empty) entry stays empty."""
    import te_serial.dcp as tdcp
    payload = torch.frombuffer(bytearray(pickle.dumps(_delayed_state())), dtype=torch.uint8)
    sd = {"fc1.weight": ts.Float8Quantizer(2.0, 3.0)(torch.randn(16, 32)), "fc1._extra_state": payload,
          "fc2._extra_state": torch.empty(0, dtype=torch.uint8)}
    tdcp.save(sd, tmp_path / "dcp")
    dest = {"fc1.weight": ts.Float8Quantizer(2.0, 3.0)(torch.zeros(16, 32)),
            "fc1._extra_state": torch.empty(0, dtype=torch.uint8), "fc2._extra_state": torch.empty(0, dtype=torch.uint8)}
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    tdcp.load(dest, tmp_path / "dcp")
    monkeypatch.undo()
    got, want = decode_te_extra_state(dest["fc1._extra_state"]), decode_te_extra_state(payload)
    assert got["recipe"] == want["recipe"] and got["extra_fp8_variables"] == want["extra_fp8_variables"]
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(got[k], want[k])
    assert dest["fc2._extra_state"].numel() == 0
    assert torch.equal(dest["fc1.weight"]._data, sd["fc1.weight"]._data)
