"""MXFP4's exact conversions (shared/docs/mxfp4.md §6) through ``te_serial.convert`` of checkpoints
written by ``save_quantized``: the report says lossless exactly where the rule holds for the tensor's
bytes, and lossy (with figures) where it does not; values against the independent oracle."""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from reference import mxfp4_reference as mx_ref
from reference import te_reference as ref
from helpers import same_values


def _convert(tmp_path, tensors: dict, recipe: str, usages: str | None = None):
    src, dst = tmp_path / "src", tmp_path / f"dst-{recipe}-{usages}"
    ts.save_quantized(tensors, src)
    report = ts.convert(src, dst, recipe=recipe, usages=usages, overwrite=True)
    return {t.name: t for t in report.tensors}, ts.load_quantized(dst)


def _mxfp4_from_blocks(exps: torch.Tensor, codes: torch.Tensor, columnwise: bool = False) -> ts.MXFP4Tensor:
    """An MXFP4 rowwise tensor [M, K] with block exponents ``exps`` [M, K/32] and codes [M, K]."""
    m, k = codes.shape
    q = ts.MXFP4Quantizer()
    s = torch.zeros(q.describe_buffers((m, k))["_rowwise_scale_inv"].shape, dtype=torch.uint8)
    s[:m, :k // 32] = (exps + 127).to(torch.uint8)
    return ts.MXFP4Tensor((m, k), torch.bfloat16, q, _rowwise_data=ref.fp4_pack(codes), _rowwise_scale_inv=s)


def _codes(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (m, k), generator=g, dtype=torch.uint8)


def test_to_mxfp8_rowwise_is_always_lossless_and_keeps_the_scale_bytes(tmp_path):
    exps = torch.tensor([-127, 127, 0, -60]).repeat(64, 1)  # the E8M0 ends and a wide spread
    exps[1] = torch.tensor([126, -127, 5, 100])
    t = _mxfp4_from_blocks(exps, _codes(64, 128))
    rep, out = _convert(tmp_path, {"w.weight": t}, "mxfp8", "rowwise")
    assert rep["w.weight"].label == "lossless"
    o = out["w.weight"]
    assert isinstance(o.quantizer, ts.MXFP8Quantizer) and torch.equal(o._rowwise_scale_inv, t._rowwise_scale_inv)
    want = ref.fp8_encode(mx_ref.decode_rows(ref.fp4_unpack(t._rowwise_data), torch.zeros(64, 4, dtype=torch.uint8) + 127),
                          torch.float8_e4m3fn)
    assert torch.equal(o._rowwise_data, want)  # each code's E4M3 byte (values under scale 2^0)
    assert same_values(o.dequantize(torch.float32), mx_ref.ref_dequantize_mxfp4(t.buffers(), (64, 128)))


@pytest.mark.parametrize("spread,lossless", [(14, True), (15, False)])
def test_to_mxfp8_columnwise_is_exact_when_the_exponents_spread_by_at_most_14(tmp_path, spread, lossless):
    exps = torch.zeros(64, 4, dtype=torch.int64)
    exps[5, 2], exps[6, 2] = 3, 3 - spread  # one column block of rows 0..31 spans the spread
    codes = _codes(64, 128, 1)
    codes[6, 64:96] = 1  # the small block holds 0.5 · 2^(3 − spread): its smallest magnitude
    t = _mxfp4_from_blocks(exps, codes)
    rep, out = _convert(tmp_path, {"w.weight": t}, "mxfp8", "both")
    r = rep["w.weight"]
    assert r.label == ("lossless" if lossless else "lossy"), r
    want = mx_ref.ref_dequantize_mxfp4(t.buffers(), (64, 128))
    o = out["w.weight"]
    assert same_values(o.dequantize(torch.float32), want)  # the rowwise usage is always exact
    col = ts.MXFP8Quantizer(columnwise=True, rowwise=False)
    cv = col.dequantize_buffers({n: b for n, b in o.buffers().items() if "columnwise" in n}, (64, 128), torch.float32)
    assert same_values(cv, want) == lossless
    if not lossless:
        assert r.max_abs_err > 0 and "requantized" in r.note


@pytest.mark.parametrize("case,lossless", [("spread17", True), ("spread18", False), ("byte243", True),
                                            ("byte244", False), ("zero_block_far_away", True)])
def test_to_nvfp4_keeps_the_codes_when_the_rule_holds(tmp_path, case, lossless):
    exps = torch.zeros(32, 4, dtype=torch.int64)
    codes = _codes(32, 128, 2)
    codes[:, 0] = 7  # every block has a code of nonzero magnitude
    if case.startswith("spread"):
        exps[0, 0], exps[1, 1] = 10, 10 - int(case[6:])
    elif case.startswith("byte"):
        exps[:] = int(case[4:]) - 127 - 10  # a spread of 10 up to the largest byte
        exps[0, 0] = int(case[4:]) - 127
    else:  # ModelOpt's all-zero block: byte 0 with −0 codes must not count
        exps[3, 2] = -127
        codes[3, 64:96] = 8
    t = _mxfp4_from_blocks(exps, codes)
    rep, out = _convert(tmp_path, {"w.weight": t}, "nvfp4", "rowwise")
    r = rep["w.weight"]
    assert r.label == ("lossless" if lossless else "lossy"), r
    o = out["w.weight"]
    # byte 244: exact values would need 2688 · 2^117 in fp32 (TE's scale · amax), so no NVFP4 holds them
    assert same_values(o.dequantize(torch.float32), mx_ref.ref_dequantize_mxfp4(t.buffers(), (32, 128))) == lossless
    if lossless:
        assert torch.equal(o._rowwise_data, t._rowwise_data)  # codes verbatim
        want = ref.ref_dequantize("nvfp4", o.buffers(), (32, 128))  # TE's NVFP4 rule (oracle)
        assert same_values(want, mx_ref.ref_dequantize_mxfp4(t.buffers(), (32, 128)))
    else:
        assert r.max_abs_err > 0 and math_finite(r.snr_db)


def math_finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


def test_to_bf16_is_exact(tmp_path):
    exps = torch.tensor([-127, -126, 0, 127]).repeat(32, 1)
    codes = _codes(32, 128, 3)
    codes[:, 96:] &= 0x9  # ±0.5 and ±0 under 2^127: finite
    t = _mxfp4_from_blocks(exps, codes)
    ts.save_quantized({"w.weight": t}, tmp_path / "src")
    report = ts.convert(tmp_path / "src", tmp_path / "plain", recipe="bf16")
    assert report.tensors[0].label == "lossless"
    from safetensors.torch import load_file
    out = {}
    for f in sorted((tmp_path / "plain").glob("*.safetensors")):
        out.update(load_file(f))
    assert out["w.weight"].dtype == torch.bfloat16
    assert same_values(out["w.weight"].float(), mx_ref.ref_dequantize_mxfp4(t.buffers(), (32, 128)))


@pytest.mark.parametrize("via", ["mxfp8", "nvfp4"])
def test_back_to_mxfp4_is_lossless_when_each_block_is_representable(tmp_path, via):
    x = torch.randn(64, 128) * 3
    t = ts.MXFP4Quantizer()(x)
    rep, mid = _convert(tmp_path / "a", {"w.weight": t}, via, "rowwise")
    assert rep["w.weight"].label == "lossless"
    rep, back = _convert(tmp_path / "b", {"w.weight": mid["w.weight"]}, "mxfp4")
    assert rep["w.weight"].label == "lossless"
    assert same_values(back["w.weight"].dequantize(torch.float32), t.dequantize(torch.float32))
    # other values (a fresh quantization of x) are not MXFP4 values: requantized, lossy, with figures
    src = (ts.MXFP8Quantizer if via == "mxfp8" else ts.NVFP4Quantizer)(columnwise=False)(x)
    rep, back = _convert(tmp_path / "c", {"w.weight": src}, "mxfp4")
    r = rep["w.weight"]
    assert r.label == "lossy" and r.max_abs_err > 0 and "requantized" in r.note
    assert torch.equal(back["w.weight"]._rowwise_data, ts.MXFP4Quantizer()(src.dequantize(torch.float32))._rowwise_data)


def test_negative_zero_survives_the_round_trip(tmp_path):
    x = torch.zeros(32, 32)
    x[0, :4] = torch.tensor([6.0, -0.0, -1e-6, 1.0])
    src = ts.MXFP8Quantizer(columnwise=False)(x)  # −0.0 and the underflow are E4M3 −0 (0x80)
    rep, back = _convert(tmp_path, {"w.weight": src}, "mxfp4")
    assert rep["w.weight"].label == "lossless"
    v = back["w.weight"].dequantize(torch.float32)
    assert torch.signbit(v[0, 1:3]).all() and (v[0, 1:3] == 0).all()


def test_grouped_mxfp4_members_convert_exactly(tmp_path):
    members = [ts.MXFP4Quantizer()(torch.randn(64, 64) * (i + 1)) for i in range(3)]
    g = ts.formats.GroupedTensor.from_members(members)
    rep, out = _convert(tmp_path, {"model.layers.0.mlp.experts.down_proj": g}, "mxfp8", "rowwise")
    assert all(r.label == "lossless" for r in rep.values())


def test_a_mxfp4_tensor_without_a_te_class_cannot_go_to_te(tmp_path):
    t = ts.MXFP4Quantizer()(torch.randn(32, 64))
    with pytest.raises(tse.FormatError, match="mxfp4"):
        ts.to_te(t)


def test_the_mxfp8_table_holds_every_code_and_is_the_only_path_not_compared_by_values():
    """MXFP4 → MXFP8 of the same usage maps each code to an E4M3 byte of the same value (checked here on
    all 16 codes against the oracle's E2M1 table), under the same E8M0 byte: exact for any bytes, so it
    is the one path ``derives_by_table`` names; the columnwise reblocking and NVFP4 depend on the bytes."""
    from te_serial.formats.grouped import per_expert
    from te_serial.formats.mxfp4 import E2M1_TO_E4M3
    e4m3 = torch.tensor(E2M1_TO_E4M3, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3.view(torch.int32), mx_ref._LUT.float().view(torch.int32))   # ±0 kept apart too
    q, row_col = ts.MXFP4Quantizer(), ts.MXFP4Quantizer(columnwise=True)
    assert q.derives_by_table(ts.MXFP8Quantizer(), "rowwise")
    assert not q.derives_by_table(ts.MXFP8Quantizer(columnwise=True), "columnwise")   # reblocked from rowwise
    assert row_col.derives_by_table(ts.MXFP8Quantizer(columnwise=True), "columnwise")
    assert not q.derives_by_table(ts.MXFP8Quantizer(torch.float8_e5m2), "rowwise")
    assert not q.derives_by_table(ts.NVFP4Quantizer(), "rowwise")
    g4, g8 = per_expert(q, (4, 64, 96), transposed=True), per_expert(ts.MXFP8Quantizer(), (4, 64, 96), transposed=True)
    assert g4.derives_by_table(g8, "rowwise") and not g4.derives_by_table(ts.MXFP8Quantizer(), "rowwise")


@pytest.mark.parametrize("usages", [(True, False), (True, True)])
def test_a_stack_derived_in_one_call_equals_each_member_derived_alone(usages):
    """A grouped MXFP4 stack goes to MXFP8 in one derive over its members' rows joined; the bytes equal
    the members derived one by one (scales compact and zero-padded per member, as each has them)."""
    from te_serial.formats.grouped import per_expert
    row, col = usages
    q4 = ts.MXFP4Quantizer(rowwise=row, columnwise=col)
    g4 = per_expert(q4, (3, 96, 160))
    x = torch.randn(3, 96, 160) * torch.tensor([1e-3, 1.0, 1e3]).reshape(3, 1, 1)
    t = g4.quantize(x)
    q8 = ts.MXFP8Quantizer(rowwise=row, columnwise=col)
    g8 = per_expert(q8, (3, 96, 160))
    for usage in [u for u, on in (("rowwise", row), ("columnwise", col)) if on]:
        got = g4.derive(t.buffers(), t.shape, g8, usage)
        alone = [q4.derive(m.buffers(), tuple(m.shape), q8, usage) for m in t.members()]
        for gname, mname in g8._lay().member_name.items():
            if mname in alone[0]:
                assert torch.equal(got[gname], torch.cat([a[mname].reshape(-1) for a in alone])), (usage, gname)
