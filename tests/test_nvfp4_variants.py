"""Row-scaled and 4over6 NVFP4 (TE 2.20's ``row_scaled_nvfp4``, ``nvfp4_use_4over6``,
``nvfp4_e4m3_max``, ``nvfp4_4over6_err_mode``).

* bytes of every buffer equal the kernel-formula oracle (tests/reference/te_reference.py
  ``ref_nvfp4_variant``) on every input kind, and TE's ``NVFP4QuantizerRef`` on the finite ones
  (it propagates NaN through its amax and drops the sign of -0.0, where the kernels do not);
* dequantized values equal the oracle's ``dequantize_nvfp4.cuh`` rule;
* from_te -> save_quantized -> load_quantized -> to_te keeps every byte (TE classes via the CPU shim);
* TE's validation rules are ``te_serial.errors`` classes;
* slicing (a per-row amax goes with its rows), exact conversion paths, serving-layout refusals.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.conversion.layouts.compressed_tensors import CompressedTensors
from te_serial.conversion.layouts.modelopt import ModelOpt
from te_serial.conversion.targets import describe_quantizer
from te_serial.recipes import recipe_quantizer
from helpers import INPUT_KINDS, assert_same_buffers, make_input, same_bits, same_values
from reference.te_reference import ref_dequantize_nvfp4_variant, ref_nvfp4_variant
import te_shim

te = te_shim.install()

FOUR = dict(nvfp4_use_4over6=True)
#: (id, quantizer fields): 4over6 over both error modes x both E4M3 bounds x both tiles, with both
#: usages; row-scaled (rowwise only) plain and with 4over6
VARIANTS = [
    (f"4over6-{mode.lower()}-{e}-{'16x16' if two_d else '1x16'}",
     dict(FOUR, nvfp4_4over6_err_mode=mode, nvfp4_e4m3_max=e, with_2d_quantization=two_d))
    for mode in ("MAE", "MSE") for e in (448, 256) for two_d in (False, True)
] + [
    ("row_scaled", dict(row_scaled_nvfp4=True, columnwise=False)),
    ("row_scaled-4over6-mae-256", dict(FOUR, row_scaled_nvfp4=True, columnwise=False, nvfp4_e4m3_max=256)),
    ("row_scaled-4over6-mse-448", dict(FOUR, row_scaled_nvfp4=True, columnwise=False, nvfp4_4over6_err_mode="MSE")),
]
IDS = [v[0] for v in VARIANTS]
FIELDS = [v[1] for v in VARIANTS]
#: (shape, dtype, input kinds): several 16-blocks each way; the 3-D shape takes the columnwise
#: spec (S[-1], *S[:-1]) path
SHAPES = [((48, 64), torch.bfloat16, INPUT_KINDS), ((2, 32, 48), torch.float32, ("random", "specials"))]


def _q(fields: dict, **usage) -> ts.NVFP4Quantizer:
    return ts.NVFP4Quantizer(**{**fields, **usage})


@pytest.mark.parametrize("fields", FIELDS, ids=IDS)
def test_bytes_and_values_equal_the_kernel_oracle(fields):
    q = _q(fields)
    for shape, dtype, kinds in SHAPES:
        for kind in kinds:
            x = make_input(kind, shape, dtype, seed=len(shape))
            t = q(x)
            want = ref_nvfp4_variant(x, **fields)
            assert_same_buffers(t.buffers(), want, f"{kind} {shape}")
            got = t.dequantize(torch.float32)
            assert same_values(got, ref_dequantize_nvfp4_variant(want, shape, nvfp4_e4m3_max=q.nvfp4_e4m3_max)), kind
        if q.rowwise and q.columnwise:  # one usage alone: the same bytes as that half of both
            for usage in ((True, False), (False, True)):
                one = _q(fields, rowwise=usage[0], columnwise=usage[1])(x)
                assert_same_buffers(one.buffers(), {n: b for n, b in t.buffers().items() if n in one.buffers()},
                                    f"usage {usage}")
                if usage[0]:
                    assert same_values(one.dequantize(torch.float32), got)


#: compiled: one variant per code path of the candidates' casts (each costs graphs of its own): 1×16
#: blocks (MSE), 16×16 tiles (MAE, both usages), a per-row amax (the C loop declines: torch's rule)
FUSED_IDS = ["4over6-mse-448-1x16", "4over6-mae-256-16x16", "row_scaled-4over6-mae-256"]


@pytest.mark.parametrize("fields", [FIELDS[IDS.index(i)] for i in FUSED_IDS], ids=FUSED_IDS)
def test_compiled_bytes_equal_eager(fields):
    """The compiled path (on CPU the C loop casting each candidate and summing its block errors)
    gives the eager bytes, on every finite input kind and with NaN (run eager) among them."""
    from te_serial.formats import fused
    q = _q(fields)
    for kind in INPUT_KINDS:
        x = make_input(kind, (64, 96), torch.bfloat16, seed=21)
        with fused.policy("fused"):
            got = q(x)
        assert_same_buffers(got.buffers(), q.quantize(x, eager=True).buffers(), f"{kind} compiled")
    assert not fused.failures()


@pytest.mark.skipif(te is None or te.reference_nvfp4 is None, reason="TE wheel without custom_recipes")
@pytest.mark.parametrize("fields", FIELDS, ids=IDS)
def test_bytes_equal_te_reference_quantizer(fields):
    q = _q(fields)
    ref = te.reference_nvfp4.NVFP4QuantizerRef(
        dtype=None, rowwise=True, columnwise=q.columnwise,
        quant_tile_shape=(16, 16) if q.with_2d_quantization else (1, 16), row_scaled_nvfp4=q.row_scaled_nvfp4,
        nvfp4_use_4over6=q.nvfp4_use_4over6, nvfp4_e4m3_max=q.nvfp4_e4m3_max,
        nvfp4_4over6_err_mode=q.nvfp4_4over6_err_mode)
    m, k = 48, 96
    for kind in ("random", "zeros", "tiny", "outliers"):
        x = make_input(kind, (m, k), torch.bfloat16, seed=11)
        qx, sx, qx_t, sx_t, amax_r, amax_c = ref._quantize(x)
        t = q(x)
        assert same_bits(t._rowwise_data, qx), kind
        assert same_bits(t._rowwise_scale_inv[:m, : k // 16], sx.view(torch.uint8)), kind
        assert same_bits(t._amax_rowwise, amax_r.reshape(-1)), kind
        if q.columnwise:
            assert same_bits(t._columnwise_data, qx_t), kind
            assert same_bits(t._columnwise_scale_inv[:k, : m // 16], sx_t.view(torch.uint8)), kind
            assert same_bits(t._amax_columnwise, amax_c.reshape(-1)), kind


def test_4over6_picks_map_to_4_on_some_blocks_and_lowers_the_error():
    x = make_input("random", (64, 128), torch.float32, seed=5)
    for mode in ("MAE", "MSE"):
        plain = ts.NVFP4Quantizer(columnwise=False)(x)
        four = ts.NVFP4Quantizer(columnwise=False, nvfp4_use_4over6=True, nvfp4_4over6_err_mode=mode)(x)
        s6, s = plain._rowwise_scale_inv[:64, :8], four._rowwise_scale_inv[:64, :8]
        assert (s != s6).any() and (s == s6).any()  # both candidates chosen somewhere
        err = lambda t: ((t.dequantize() - x).abs() if mode == "MAE" else (t.dequantize() - x) ** 2).sum()  # noqa: E731
        assert err(four) < err(plain)


def test_buffer_shapes_equal_te_inner_tensor_specs():
    if te is None:
        pytest.skip("transformer-engine wheel not installed")
    for fields in FIELDS:
        q = _q(fields)
        tq = te.NVFP4Quantizer(rowwise=q.rowwise, columnwise=q.columnwise, with_2d_quantization=q.with_2d_quantization,
                               row_scaled_nvfp4=q.row_scaled_nvfp4, nvfp4_use_4over6=q.nvfp4_use_4over6,
                               nvfp4_e4m3_max=q.nvfp4_e4m3_max, nvfp4_4over6_err_mode=q.nvfp4_4over6_err_mode)
        for shape in ((32, 48), (2, 32, 64)):
            theirs = {n: (tuple(s), d) for n, (s, d) in tq.inner_tensor_specs(shape).items()}
            ours = {n: (spec.shape, spec.dtype) for n, spec in q.describe_buffers(shape).items()}
            assert list(ours.items()) == list(theirs.items()), (fields, shape)


@pytest.mark.parametrize("fields", FIELDS, ids=IDS)
def test_te_round_trip_through_a_checkpoint_keeps_every_byte(fields, tmp_path):
    if te is None:
        pytest.skip("transformer-engine wheel not installed")
    q = _q(fields)
    ours = q(make_input("outliers", (2, 32, 48), torch.bfloat16, seed=7))
    b = ours.buffers()
    theirs = te_shim.make_te_nvfp4(*(b.get(n) for n in tsf.NVFP4TensorStorage.BUFFERS), (2, 32, 48),
                                   torch.bfloat16, with_2d_quantization=q.with_2d_quantization,
                                   row_scaled_nvfp4=q.row_scaled_nvfp4, nvfp4_use_4over6=q.nvfp4_use_4over6,
                                   nvfp4_e4m3_max=q.nvfp4_e4m3_max, nvfp4_4over6_err_mode=q.nvfp4_4over6_err_mode)
    got = ts.from_te(theirs)
    assert got.quantizer == q
    ts.save_quantized({"w": theirs}, tmp_path / "ck.safetensors")
    back = ts.load_quantized(tmp_path / "ck.safetensors")["w"]
    assert back.quantizer == q and back.quantizer.to_dict() == q.to_dict()
    again = ts.to_te(back)
    assert type(again).__name__ == "NVFP4Tensor"
    assert (again._row_scaled_nvfp4, again._nvfp4_use_4over6, again._nvfp4_e4m3_max) == (
        q.row_scaled_nvfp4, q.nvfp4_use_4over6, q.nvfp4_e4m3_max)
    assert again._quantizer.nvfp4_4over6_err_mode == q.nvfp4_4over6_err_mode
    assert set(te_shim.te_buffers(again)) == set(b)
    for n, v in te_shim.te_buffers(again).items():
        assert same_bits(v, b[n]), n
    as_te = ts.load_quantized(tmp_path / "ck.safetensors", as_te=True)["w"]
    assert all(same_bits(v, b[n]) for n, v in te_shim.te_buffers(as_te).items())


def test_te_row_scaled_tensor_with_a_columnwise_copy_is_refused():
    if te is None:
        pytest.skip("transformer-engine wheel not installed")
    x = make_input("random", (32, 64), torch.bfloat16)
    r = ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)(x)
    c = ts.NVFP4Quantizer(rowwise=False)(x)
    theirs = te_shim.make_te_nvfp4(r._rowwise_data, r._rowwise_scale_inv, c._columnwise_data, c._columnwise_scale_inv,
                                   r._amax_rowwise, torch.ones(64), (32, 64), torch.bfloat16, row_scaled_nvfp4=True)
    with pytest.raises(tse.FormatError, match="row-scaled.*columnwise"):
        ts.from_te(theirs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(row_scaled_nvfp4=True), "rowwise only"),                       # columnwise requested
    (dict(row_scaled_nvfp4=True, rowwise=False), "rowwise only"),
    (dict(row_scaled_nvfp4=True, columnwise=False, with_2d_quantization=True), "1x16"),
    (dict(row_scaled_nvfp4=True, columnwise=False, with_rht=True, with_post_rht_amax=True), "with_rht"),
    (dict(row_scaled_nvfp4=True, columnwise=False, stochastic_rounding=True), "stochastic_rounding"),
    (dict(nvfp4_use_4over6=True, with_rht=True, with_post_rht_amax=True), "with_rht"),  # 4over6's tiles: no RHT
    (dict(nvfp4_use_4over6=True, stochastic_rounding=True), "stochastic_rounding"),
    (dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=300), "448 or 256"),
    (dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=True), "448 or 256"),
    (dict(nvfp4_e4m3_max=256), "needs nvfp4_use_4over6"),
    (dict(nvfp4_use_4over6=True, nvfp4_4over6_err_mode="MAX"), "'MAE' or 'MSE'"),
    (dict(nvfp4_4over6_err_mode=3), "'MAE' or 'MSE'"),
])
def test_invalid_variants_are_refused(kwargs, match):
    with pytest.raises(tse.FormatError, match=match):
        ts.NVFP4Quantizer(**kwargs)


def test_fields_round_trip_through_to_dict_and_bad_files_are_refused():
    for fields in FIELDS:
        q = _q(fields)
        assert tsf.Quantizer.from_dict(q.to_dict()) == q
    q = ts.NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_4over6_err_mode="mse", nvfp4_e4m3_max=256.0)
    assert q.nvfp4_4over6_err_mode == "MSE" and type(q.nvfp4_e4m3_max) is int  # TE upper-cases the mode
    d = q.to_dict()
    for bad in ({"nvfp4_e4m3_max": 256.0}, {"nvfp4_e4m3_max": 512}, {"nvfp4_4over6_err_mode": "L1"},
                {"nvfp4_use_4over6": False}, {"row_scaled_nvfp4": True}):
        with pytest.raises(tse.FormatError):
            tsf.Quantizer.from_dict({**d, **bad})
    assert tsf.Quantizer.from_dict({"kind": "nvfp4"}).nvfp4_e4m3_max == 448  # defaults: today's NVFP4


def test_row_slices_of_a_row_scaled_tensor_equal_the_rows_quantized_alone(tmp_path):
    x = make_input("outliers", (3, 32, 64), torch.bfloat16, seed=2)
    x2 = x.reshape(96, 64)
    for fields in (FIELDS[-3], FIELDS[-2]):
        q = _q(fields)
        t = q(x)
        assert q.slice_alignment() == (16, 16)
        for rows in ((0, 96), (16, 48), (80, 96)):
            s = ts.slice_quantized(t, rows=rows)
            assert_same_buffers(s.buffers(), q(x2[rows[0]:rows[1]].contiguous()).buffers(), f"rows={rows}")
        for rows, cols in (((16, 64), (16, 48)), (None, (48, 64))):
            s = ts.slice_quantized(t, rows=rows, cols=cols)
            r0, r1 = rows or (0, 96)
            assert same_bits(s._amax_rowwise, t._amax_rowwise[r0:r1])  # the rows' amax, whole along K
            want = t.dequantize(torch.float32).reshape(96, 64)[r0:r1, cols[0]:cols[1]]
            assert same_values(s.dequantize(torch.float32).reshape(want.shape), want)
        with pytest.raises(tse.ShapeError):
            ts.slice_quantized(t, rows=(8, 40))
        path = tmp_path / f"{q.layout_name()}.safetensors"  # a sliced read takes the same rule
        ts.save_quantized({"w": t}, path)
        with ts.open(path) as ckpt:
            got = ckpt.get("w", rows=(16, 64), cols=(16, 48), verify=True)
        assert_same_buffers(got.buffers(), ts.slice_quantized(t, rows=(16, 64), cols=(16, 48)).buffers(), "read")


def test_row_scaled_through_dcp_on_one_process(tmp_path):
    """DCP treats a per-row amax as a row-sharded buffer (not a tensor-wide scalar)."""
    import te_serial.dcp as tdcp

    q = ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    t = q(make_input("outliers", (64, 64), torch.bfloat16, seed=1))
    tdcp.save({"w": t}, tmp_path / "ck")
    fresh = {"w": ts.TensorProto((64, 64), torch.bfloat16, q).create_tensor()}
    tdcp.load(fresh, tmp_path / "ck")
    assert_same_buffers(fresh["w"].buffers(), t.buffers(), "dcp.load")
    assert_same_buffers(ts.load_quantized(tmp_path / "ck")["w"].buffers(), t.buffers(), "load_quantized")


def test_4over6_slices_keep_the_parent_amax_and_bytes():
    q = _q(FIELDS[3])  # MAE, 256, 16x16, both usages
    x = make_input("random", (64, 48), torch.bfloat16, seed=4)
    t = q(x)
    s = ts.slice_quantized(t, rows=(16, 48), cols=(16, 48))
    assert same_bits(s._amax_rowwise, t._amax_rowwise) and same_bits(s._amax_columnwise, t._amax_columnwise)
    want = t.dequantize(torch.float32)[16:48, 16:48]
    assert same_values(s.dequantize(torch.float32), want)
    assert same_bits(s._columnwise_data, t._columnwise_data.reshape(48, 32)[16:48, 8:24].contiguous())


#: a 16x16 tile (integers times 0x1.2ba67cp-2) whose map-to-4 and map-to-6 MAE sums tie when its
#: rows are summed first (rowwise: map-to-6) but not when its columns are (columnwise: map-to-4)
_NEAR_TIE = """
39 -22 -13 -2 -18 3 18 25 14 -14 -7 -11 -4 -7 7 -39 / -26 15 -26 27 -15 -32 36 -9 2 -30 31 27 -39 32 -24 -29
11 -31 26 21 -30 -3 30 32 -34 3 -19 14 -9 33 37 -33 / 37 -22 22 -36 2 9 18 25 27 -30 -31 19 37 31 26 4
-11 6 7 26 7 -25 -18 11 -16 -38 2 3 -18 -8 -9 -6 / -39 32 13 -6 -3 -22 18 18 -6 -17 -35 32 -31 -14 -15 8
12 -8 -9 29 -4 -24 7 6 -24 -5 35 1 -12 20 28 -38 / -9 9 17 12 -7 -15 23 -18 -4 -8 13 4 6 22 38 -38
1 22 31 -12 -5 33 -17 38 -37 -19 -10 -11 -31 -5 -2 2 / -13 14 -12 -26 -30 20 6 -22 14 -22 32 -5 36 23 -25 -39
27 13 9 11 21 -25 -27 -16 -16 -31 -22 31 10 -7 28 -3 / -3 -37 14 -9 10 32 5 32 -7 -22 14 17 -13 38 33 -14
-10 1 12 26 27 -34 -17 -17 36 26 -3 -30 26 2 1 -11 / -13 -36 -26 9 1 -2 -5 -33 1 -25 34 31 -37 36 -37 -38
-8 -1 33 18 15 3 -28 -20 11 -32 -12 -26 -17 35 -17 -8 / 22 -7 -10 -33 3 23 -12 -10 -21 16 -38 -11 -25 -33 18 4
"""


def test_16x16_4over6_usages_are_not_transposes_of_each_other():
    """Why no exact path derives one usage of a 16x16 4over6 tensor from the other: the kernel sums
    a tile's errors row by row for the rowwise copy and column by column for the columnwise one."""
    k = torch.tensor([int(v) for v in _NEAR_TIE.replace("/", " ").split()], dtype=torch.float32).reshape(16, 16)
    x = torch.zeros(32, 16)
    x[:16] = k * float.fromhex("0x1.2ba67cp-2")
    x[16, 0] = float.fromhex("0x1.37fd8ap+5")  # the tensor amax
    q = ts.NVFP4Quantizer(nvfp4_use_4over6=True, with_2d_quantization=True)
    t = q(x)
    assert_same_buffers(t.buffers(), ref_nvfp4_variant(x, nvfp4_use_4over6=True, with_2d_quantization=True), "oracle")
    b = t.buffers()
    row = q.block_scales(b, (32, 16), tsf.ROWWISE)[0, 0].view(torch.float8_e4m3fn).float()
    col = q.block_scales(b, (32, 16), tsf.COLUMNWISE)[0, 0].view(torch.float8_e4m3fn).float()
    assert (float(row), float(col)) == (128.0, 192.0)  # map-to-6 rowwise, map-to-4 (x1.5) columnwise
    assert not torch.equal(q.codes(b, (32, 16), tsf.ROWWISE), q.codes(b, (32, 16), tsf.COLUMNWISE))
    assert not q.set_usage(columnwise=False).derivable(q, tsf.COLUMNWISE)
    if te is not None and te.reference_nvfp4 is not None:  # TE's reference sums in the same orders
        qx, sx, qx_t, sx_t, _, _ = te.reference_nvfp4.NVFP4QuantizerRef(
            dtype=None, quant_tile_shape=(16, 16), nvfp4_use_4over6=True)._quantize(x)
        assert same_bits(t._rowwise_data, qx) and same_bits(t._columnwise_data, qx_t)
        assert same_bits(t._columnwise_scale_inv[:16, :2], sx_t.view(torch.uint8))


def test_exact_paths_never_cross_the_amax_or_divisor():
    plain, plain_2d = ts.NVFP4Quantizer(), ts.NVFP4Quantizer(with_2d_quantization=True)
    rep = ts.NVFP4Quantizer(columnwise=False)  # what the serving layouts hold
    row = ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    f448 = ts.NVFP4Quantizer(nvfp4_use_4over6=True, with_2d_quantization=True)
    f256 = recipe_quantizer("nvfp4_4over6")
    for a, b in ((row, rep), (rep, row), (f256, rep), (f256, plain), (plain, f256), (f448, f256)):
        assert a.exact_output(b) is None, (a.layout_name(), b.layout_name())
    assert row.exact_output(row) == row and f256.exact_output(f256) == f256
    out = f448.exact_output(rep)  # 4over6 with the 448 bound: plain NVFP4 bytes
    assert out == rep and f448.derivable(out, tsf.ROWWISE)
    # a 16x16 4over6 tensor's usages are not each other's transpose (near ties may differ)
    assert not f448.set_usage(columnwise=False).derivable(f448, tsf.COLUMNWISE)
    assert not f448.set_usage(rowwise=False).derivable(f448, tsf.ROWWISE)
    assert plain_2d.set_usage(columnwise=False).derivable(plain_2d, tsf.COLUMNWISE)
    # a plain 16x16 tensor's bytes become a 4over6 (448) tensor's; RHT sources keep the rowwise bytes
    assert plain_2d.exact_output(f448) == f448
    rht = ts.NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    four_row = ts.NVFP4Quantizer(nvfp4_use_4over6=True, columnwise=False)
    assert rht.exact_output(four_row) == four_row and rht.derivable(four_row, tsf.ROWWISE)
    assert f448.global_scale_divisor() == 6 * 448 and f256.global_scale_divisor() == 6 * 256
    assert len({q.layout_key() for q in (plain, plain_2d, row, f256)}) == 4
    assert f448.layout_key() == plain_2d.layout_key()  # 4over6 only chose the scales


@pytest.mark.parametrize("layout", [ModelOpt(), CompressedTensors()], ids=["modelopt", "compressed_tensors"])
def test_serving_layouts_refuse_a_global_scale_they_cannot_state(layout):
    """A per-row amax has no global scale; 4over6's E4M3 bound of 256 is stated as it is, amax /
    (6 · 256), as ModelOpt writes 4over6 weights."""
    x = make_input("random", (32, 64), torch.bfloat16)
    row = ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    with pytest.raises(tse.ConversionError, match="nvfp4_row_scaled.*'layers.0.w.weight'"):
        layout.export("layers.0.w.weight", row(x), "nvfp4")
    for e4m3_max in (448, 256):  # the 448 bound: plain NVFP4 bytes
        t = ts.NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=e4m3_max, columnwise=False)(x)
        out = layout.export("layers.0.w.weight", t, "nvfp4")
        glob = next(v for k, v in out.items() if k.endswith(("weight_scale_2", "weight_global_scale")))
        ws2 = t.buffers()["_amax_rowwise"].reshape(()) / torch.tensor(6.0 * e4m3_max)
        want = ws2 if isinstance(layout, ModelOpt) else 1 / ws2
        assert torch.equal(glob.reshape(()), want), e4m3_max


def test_recipes():
    row = recipe_quantizer("nvfp4_row_scaled")  # rowwise only whatever is asked
    assert row.row_scaled_nvfp4 and row.usages_on() == (tsf.ROWWISE,)
    four = recipe_quantizer("nvfp4_4over6", columnwise=False)
    assert (four.nvfp4_use_4over6, four.nvfp4_e4m3_max, four.nvfp4_4over6_err_mode, four.with_2d_quantization) == (
        True, 256, "MAE", True)
    assert describe_quantizer(row) == "nvfp4_row_scaled" and describe_quantizer(four) == "nvfp4_4over6"
    assert math.prod(row(torch.randn(32, 64)).buffers()["_amax_rowwise"].shape) == 32


@pytest.mark.parametrize("name", ["nvfp4_row_scaled", "nvfp4_4over6"])
def test_golden_values_follow_the_kernel_dequantize_rule(name):
    """The format 1.3 goldens' recorded values are the oracle's dequantize of their bytes (so the
    records pin schema/README.md §7.4's rule for a per-row amax and the 6 · 256 divisor)."""
    import json
    from pathlib import Path

    import xxhash

    golden = Path(__file__).resolve().parents[1] / "schema" / "golden"
    rec = json.loads((golden / f"{name}.expected.json").read_text())
    loaded = ts.load_quantized(golden / f"{name}.safetensors", verify=True)
    flat = {}

    def walk(obj, prefix=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{prefix}{i}.")
        else:
            flat[prefix[:-1]] = obj

    walk(loaded)
    assert set(flat) == set(rec["tensors"])
    variants = set()
    for tname, want in rec["tensors"].items():
        t, q = flat[tname], tsf.Quantizer.from_dict(want["quantizer"])
        assert t.quantizer == q
        variants.add((q.row_scaled_nvfp4, q.nvfp4_use_4over6, q.nvfp4_e4m3_max))
        values = ref_dequantize_nvfp4_variant(t.buffers(), want["shape"], nvfp4_e4m3_max=q.nvfp4_e4m3_max)
        digest = "xxh3_64:" + xxhash.xxh3_64(values.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        assert digest == want["dequantized_float32_xxh3_64"], tname
    assert variants == ({(True, False, 448), (True, True, 256)} if name == "nvfp4_row_scaled"
                        else {(False, True, 256), (False, True, 448)})



def _compiled_path_gives_the_eager_bytes(i: int) -> None:
    import warnings

    from te_serial.formats import fused

    q = _q(FIELDS[i])
    for shape in ((64, 128), (2, 48, 96)):
        for kind in INPUT_KINDS:
            x = make_input(kind, shape, torch.bfloat16, seed=1)
            eager = q.quantize(x, eager=True)
            with fused.policy("fused"), warnings.catch_warnings():
                warnings.filterwarnings("error", message="te_serial: compiled", category=RuntimeWarning)
                got = q.quantize(x)
                values = got.dequantize(torch.float32)
            assert_same_buffers(got.buffers(), eager.buffers(), f"{kind} {shape}")
            assert same_values(values, eager.dequantize(torch.float32, eager=True)), kind
    assert not fused.failures(), fused.failures()


# The compiled (formats/fused.py) path costs about a minute of inductor + C++ compile per variant on
# 2 cores: collected only with TE_SERIAL_FUSED_FULL=1, as test_fused.py's full set.
if os.environ.get("TE_SERIAL_FUSED_FULL", "") not in ("", "0"):
    @pytest.mark.slow
    @pytest.mark.parametrize("i", range(len(VARIANTS)), ids=IDS)
    def test_compiled_path_gives_the_eager_bytes(i):
        _compiled_path_gives_the_eager_bytes(i)


def test_fields_of_format_1_3_are_written_only_off_their_defaults():
    """A plain NVFP4 quantizer is written as format 1.2 wrote it (a 1.2 reader reads it); a variant
    names just the fields it changes, and both read back equal."""
    new = {"row_scaled_nvfp4", "nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode"}
    plain = ts.NVFP4Quantizer(with_2d_quantization=True)
    assert not new & set(plain.to_dict()) and "with_2d_quantization" in plain.to_dict()
    v = ts.NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)
    assert new & set(v.to_dict()) == {"nvfp4_use_4over6", "nvfp4_e4m3_max"}
    for q in (plain, v):
        assert tsf.Quantizer.from_dict(q.to_dict()) == q
