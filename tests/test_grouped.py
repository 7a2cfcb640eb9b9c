"""Grouped (MoE) tensors: TE's GroupedTensor packing, exact merge and split, checkpoints (format 1.3),
one-expert reads, Hugging Face expert names, TE's own classes (through tests/te_shim.py)."""

from __future__ import annotations

import json

import pytest
import torch

import te_serial as ts
from te_serial import formats as tsf
from te_serial.checkpoint import manifest as mf
from te_serial.checkpoint import tree as tree_mod
from te_serial.conversion.transforms import build_grouped, plan_grouped
from te_serial.errors import CheckpointError, FormatError, ShapeError
from te_serial.formats.grouped import GroupedQuantizer, merge_grouped, split_grouped
import te_shim
from helpers import E4M3, E5M2, INPUT_KINDS, assert_same_tensor, make_input, same_bits

G = tsf.GroupedTensor

#: every format TE groups (GroupedLinear's recipes), in both usages or one
MEMBER_QUANTIZERS = {
    "fp8_current": lambda: ts.Float8CurrentScalingQuantizer(E4M3),
    "fp8_current_col": lambda: ts.Float8CurrentScalingQuantizer(E5M2, rowwise=False),
    "mxfp8": lambda: ts.MXFP8Quantizer(E4M3),
    "mxfp8_2d_row": lambda: ts.MXFP8Quantizer(E5M2, columnwise=False, with_2d_quantization=True),
    "block_1d": lambda: ts.Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "block_2d_col": lambda: ts.Float8BlockQuantizer(E4M3, rowwise=False, block_scaling_dim=2),
    "nvfp4": lambda: ts.NVFP4Quantizer(),
    "nvfp4_2d_row": lambda: ts.NVFP4Quantizer(columnwise=False, with_2d_quantization=True),
    "mxfp4": lambda: ts.MXFP4Quantizer(columnwise=True),  # gpt-oss's experts (no TE class: te-serial's own)
    "mxfp4_row": lambda: ts.MXFP4Quantizer(),
    "bf16": lambda: None,
}
#: member shapes: equal (wrapper [n, M, K]), rows differ, columns differ, both differ ([1, total])
SHAPES = {
    "equal": [(64, 96)] * 3,
    "rows": [(96, 64), (32, 64), (64, 64)],
    "cols": [(32, 96), (32, 32)],
    "both": [(64, 32), (32, 96), (32, 32)],
}
#: TE's wrapper shape of each: [n, M, K]; [ΣM, K]; [M, ΣK]; [1, Σ elements]
WRAPPER_SHAPES = {"equal": (3, 64, 96), "rows": (192, 64), "cols": (32, 128), "both": (1, 64 * 32 + 32 * 96 + 32 * 32),
                  "odd": (48, 53)}
#: formats with no block-size rule also take shapes that are no multiple of anything
ODD_SHAPES = [(37, 53), (10, 53), (1, 53)]
CASES = [pytest.param(q, s, id=f"{q}-{s}") for q in MEMBER_QUANTIZERS for s in SHAPES] + [
    pytest.param(q, "odd", id=f"{q}-odd") for q in ("fp8_current", "block_1d", "bf16")]


def members_of(qname: str, shapes_name: str, seed: int = 0) -> list:
    """Adversarial members (random, zeros, tiny, outliers, inf/NaN …), one input kind each."""
    shapes = ODD_SHAPES if shapes_name == "odd" else SHAPES[shapes_name]
    q = MEMBER_QUANTIZERS[qname]()
    out = []
    for i, s in enumerate(shapes):
        x = make_input(INPUT_KINDS[(i + seed) % len(INPUT_KINDS)], s, torch.bfloat16, seed + i)
        out.append(x if q is None else q(x))
    return out


def assert_same_members(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_tensor(g, w, f"member {i}")


#: TE's grouped buffer of each member buffer (grouped_tensor_storage.py, split_into_quantized_tensors)
TE_GROUPED_NAME = {"_data": "rowwise_data", "_transpose": "columnwise_data", "_scale_inv": "scale_inv",
                   "_rowwise_data": "rowwise_data", "_columnwise_data": "columnwise_data",
                   "_rowwise_scale_inv": "scale_inv", "_columnwise_scale_inv": "columnwise_scale_inv",
                   "_amax_rowwise": "amax", "_amax_columnwise": "columnwise_amax"}


def reference_pack(members: list) -> dict[str, bytes]:
    """TE's packing written out independently: per grouped buffer, the members' buffers' bytes one
    after another. Per-tensor FP8's one scale_inv is TE's columnwise_scale_inv when only the
    columnwise usage exists."""
    out: dict[str, bytes] = {}
    for m in members:
        plain = not isinstance(m, tsf.QuantizedTensorStorage)
        bufs = {"values": m} if plain else m.buffers()
        for name, b in bufs.items():
            grouped = "rowwise_data" if plain else TE_GROUPED_NAME[name]
            if name == "_scale_inv" and not m.quantizer.rowwise:
                grouped = "columnwise_scale_inv"
            out[grouped] = out.get(grouped, b"") + b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


# --- merge and split ------------------------------------------------------------------------------

@pytest.mark.parametrize("qname,shapes", CASES)
def test_from_members_packs_as_te_and_splits_back_exactly(qname, shapes):
    members = members_of(qname, shapes)
    g = G.from_members(members)
    q = g.quantizer
    assert isinstance(q, GroupedQuantizer) and q.num_tensors == len(members)
    assert q.member_shapes == tuple(tuple(m.shape) for m in members)
    assert tuple(g.shape) == WRAPPER_SHAPES[shapes]  # TE's GroupedTensor shape
    assert list(g.buffers()) == [n for n in tsf.grouped.GROUPED_BUFFERS if n in reference_pack(members)]
    for name, data in reference_pack(members).items():
        assert g.buffers()[name].dim() == 1
        assert g.buffers()[name].view(torch.uint8).numpy().tobytes() == data, name
    back = g.members()
    assert_same_members(back, members)
    for b in back:  # views of the packed buffers, no copy
        bufs = b.buffers() if isinstance(b, tsf.QuantizedTensorStorage) else {"d": b}
        assert all(t.untyped_storage().data_ptr() in {x.untyped_storage().data_ptr() for x in g.buffers().values()}
                   for t in bufs.values())
    # the group's values are the members' in TE's logical layout
    dq = [m.dequantize(torch.float32) if isinstance(m, tsf.QuantizedTensorStorage) else m.float() for m in members]
    assert same_bits(g.dequantize(torch.float32), q.join_values(dq))
    assert [same_bits(a, b) for a, b in zip(q.split_values(q.join_values(dq)), dq)] == [True] * len(dq)


@pytest.mark.parametrize("qname", ["fp8_current", "mxfp8", "nvfp4", "block_2d_col", "bf16"])
def test_quantize_of_the_group_is_its_members_quantized(qname):
    members = members_of(qname, "rows", seed=3)
    g = G.from_members(members)
    x = g.quantizer.join_values([make_input(INPUT_KINDS[(i + 3) % len(INPUT_KINDS)], m.shape, torch.bfloat16, 3 + i)
                                 for i, m in enumerate(members)])
    again = g.quantizer.quantize(x)
    assert_same_tensor(again, g)


def test_wrapper_shapes_follow_te():
    q = ts.MXFP8Quantizer()
    cases = {((64, 96),) * 2: (2, 64, 96), ((32, 64), (96, 64)): (128, 64), ((32, 64), (32, 96)): (32, 160),
             ((32, 64), (64, 96)): (1, 32 * 64 + 64 * 96)}
    for shapes, want in cases.items():
        assert GroupedQuantizer(member=q, member_shapes=shapes).group_shape == want
    assert GroupedQuantizer(member_shapes=[(8,)] * 3, dtype=torch.bfloat16).group_shape == (3, 8)


def test_from_members_refuses_what_te_does_not_group():
    mx = ts.MXFP8Quantizer()
    a, b = mx(torch.randn(32, 64)), ts.MXFP8Quantizer(columnwise=False)(torch.randn(32, 64))
    with pytest.raises(FormatError, match="member 1 differs"):
        G.from_members([a, b])
    with pytest.raises(FormatError, match="member 1 differs"):
        G.from_members([a, mx(torch.randn(32, 64, dtype=torch.bfloat16))])  # nominal dtype
    with pytest.raises(FormatError, match="plain tensor"):
        G.from_members([torch.randn(4, 4), a])
    with pytest.raises(FormatError, match="at least one"):
        G.from_members([])
    with pytest.raises(FormatError, match="delayed-scaling"):
        G.from_members([ts.Float8Quantizer(2.0, 1.0)(torch.randn(16, 16))] * 2)
    with pytest.raises(ShapeError, match="divisible by 32"):
        GroupedQuantizer(member=mx, member_shapes=[(32, 64), (48, 64)])
    with pytest.raises(ShapeError, match="must be 2-D"):
        GroupedQuantizer(member_shapes=[(8,), (16,)], dtype=torch.float32)
    with pytest.raises(FormatError, match="1 to 4096 members"):
        GroupedQuantizer(member=mx, member_shapes=[(32, 32)] * 4097)
    with pytest.raises(FormatError, match="format quantizer"):
        GroupedQuantizer(member=GroupedQuantizer(member=mx, member_shapes=[(32, 32)]), member_shapes=[(32, 32)])


def test_grouped_tensor_moves_copies_and_reprs():
    g = G.from_members(members_of("nvfp4", "both"))
    assert "3 members" in repr(g) and "rowwise_data=uint8" in repr(g)
    c = g.clone()
    assert_same_tensor(c, g)
    assert all(c.buffers()[n].data_ptr() != b.data_ptr() for n, b in g.buffers().items())
    d = g.to("meta")
    assert type(d) is G and d.device.type == "meta" and d.quantizer == g.quantizer
    empty = torch.empty_like(g)
    empty.copy_(g)
    assert_same_tensor(empty, g)
    assert torch.equal(g.float(), g.dequantize(torch.float32))  # other ops see the values


# --- checkpoints ------------------------------------------------------------------------------------

def _bytes_read(ckpt) -> int:
    return sum(f.bytes_read for f in ckpt._files.values())


@pytest.mark.parametrize("qname,shapes", CASES)
def test_save_load_byte_identical_and_one_expert_reads_only_its_bytes(tmp_path, qname, shapes):
    members = members_of(qname, shapes, seed=1)
    g = G.from_members(members)
    state = {"model.layers.0.mlp.experts.linear_fc1.weight": g, "other": torch.randn(5)}
    path = tmp_path / "ck.safetensors"
    ts.save_quantized(state, path)
    back = ts.load_quantized(path, verify=True)
    assert_same_tensor(back["model.layers.0.mlp.experts.linear_fc1.weight"], g)
    name = "model.layers.0.mlp.experts.linear_fc1.weight"
    with ts.open(path) as ckpt:
        assert ckpt.manifest.version >= (1, 3)  # grouped tensors: format 1.3 on
        assert ckpt.protos[name].quantizer == g.quantizer
        for i, m in enumerate(members):
            before = _bytes_read(ckpt)
            got = ckpt.get(name, member=i)
            nbytes = m.quantized_nbytes() if isinstance(m, tsf.QuantizedTensorStorage) else m.numel() * m.element_size()
            assert _bytes_read(ckpt) - before == nbytes, i
            assert_same_tensor(got, m, f"member {i}")
        assert_same_tensor(ckpt.get(name, member=1, verify=True), members[1])


def test_directory_checkpoint_many_shards_and_meta(tmp_path):
    g = G.from_members(members_of("mxfp8", "rows"))
    p = G.from_members(members_of("bf16", "equal"))
    ts.save_quantized({"a.experts.w.weight": g, "b.experts.w.bias": p}, tmp_path / "d", max_shard_size="20KB")
    with ts.open(tmp_path / "d") as ckpt:
        assert len(ckpt.manifest.files) >= 2
        assert_same_tensor(ckpt.get("a.experts.w.weight"), g)
        assert_same_tensor(ckpt.get("a.experts.w.weight", member=2), g.members()[2])
        assert_same_tensor(ckpt.get("b.experts.w.bias", member=0), p.members()[0])
        meta = ckpt.protos["a.experts.w.weight"].create_tensor(device="meta")
        assert type(meta) is G and meta.shape == g.shape and meta.quantizer == g.quantizer
        with pytest.raises(CheckpointError, match="out of range"):
            ckpt.get("a.experts.w.weight", member=3)
        with pytest.raises(CheckpointError, match="not rows= / cols="):
            ckpt.get("a.experts.w.weight", rows=(0, 32))
    ts.save_quantized({"x": ts.MXFP8Quantizer()(torch.randn(32, 32))}, tmp_path / "plain.safetensors")
    with ts.open(tmp_path / "plain.safetensors") as ckpt, pytest.raises(CheckpointError, match="member="):
        ckpt.get("x", member=0)


def test_a_pre_1_3_reader_refuses_a_grouped_manifest(tmp_path):
    """A 1.2 reader validates with the 1.2 schema: the grouped quantizer's nested ``member`` and the
    TE buffer names break it, so the checkpoint is refused, never read as something else."""
    ts.save_quantized({"e.experts.w.weight": G.from_members(members_of("mxfp8", "equal"))},
                      tmp_path / "g.safetensors")
    with ts.open(tmp_path / "g.safetensors") as ckpt:
        doc = tree_mod.unpack(ckpt.manifest.to_bytes())
    old = json.loads(json.dumps(mf.schema()))  # the 1.2 schema: what 1.3 added, taken out again
    qprops = old["properties"]["quantizers"]["items"]["properties"]
    del qprops["member"], qprops["member_shapes"]
    old["properties"]["protos"]["items"]["properties"]["buffers"]["items"]["properties"]["name"]["pattern"] = \
        "^(data|_[a-z_]{1,63})$"
    import jsonschema_rs
    doc.pop(mf.MANIFEST_CHECKSUM)
    errors = [e.message for e in jsonschema_rs.validator_for(old).iter_errors(doc)]
    assert any('"kind":"mxfp8"' in m and "is not of type" in m for m in errors), errors  # the nested member
    assert any('"rowwise_data" does not match' in m for m in errors), errors
    assert jsonschema_rs.validator_for(mf.schema()).is_valid(doc)


# --- Hugging Face expert names: split and merge ----------------------------------------------------

def test_split_and_merge_with_hugging_face_names_are_exact():
    fc1 = G.from_members(members_of("mxfp8", "equal"))
    fc2 = G.from_members(members_of("nvfp4", "rows"))
    bias = G.from_members(members_of("bf16", "equal"))
    state = {"model.layers.0.mlp.experts.gate_up_proj.weight": fc1, "model.layers.0.mlp.router.weight": torch.ones(3),
             "model.layers.0.mlp.experts.down_proj.weight": fc2, "model.layers.0.mlp.experts.down_proj.bias": bias}
    split = split_grouped(state)
    assert list(split) == [*(f"model.layers.0.mlp.experts.{i}.gate_up_proj.weight" for i in range(3)),
                           "model.layers.0.mlp.router.weight",
                           *(f"model.layers.0.mlp.experts.{i}.down_proj.weight" for i in range(3)),
                           *(f"model.layers.0.mlp.experts.{i}.down_proj.bias" for i in range(3))]
    assert_same_members([split[f"model.layers.0.mlp.experts.{i}.down_proj.weight"] for i in range(3)], fc2.members())
    merged = merge_grouped(split)
    assert list(merged) == list(state)
    for k, v in state.items():
        assert_same_tensor(merged[k], v, k)
    with pytest.raises(FormatError, match="experts"):
        split_grouped({"weight": fc1})
    # an incomplete set of experts (0 and 2) is left as it is
    part = {k: v for k, v in split.items() if ".1.gate_up_proj" not in k}
    assert set(merge_grouped(part)) >= {"model.layers.0.mlp.experts.0.gate_up_proj.weight"}


def test_conversion_hook_splits_reading_one_expert_at_a_time_and_merges_back(tmp_path):
    fc1 = G.from_members(members_of("fp8_current", "cols"))
    ts.save_quantized({"m.experts.fc1.weight": fc1, "m.norm": torch.ones(4)}, tmp_path / "g.safetensors")
    with ts.open(tmp_path / "g.safetensors") as ckpt:
        plan = plan_grouped("split", ckpt.protos)
        assert list(plan) == ["m.experts.0.fc1.weight", "m.experts.1.fc1.weight", "m.norm"]
        out = {}
        for name, (srcs, merged) in plan.items():
            before = _bytes_read(ckpt)
            out[name] = build_grouped(srcs, merged, lambda n, i: ckpt.get(n, member=i) if i is not None else ckpt.get(n))
            if name != "m.norm":
                assert _bytes_read(ckpt) - before == out[name].quantized_nbytes()
    assert_same_members([out["m.experts.0.fc1.weight"], out["m.experts.1.fc1.weight"]], fc1.members())
    ts.save_quantized(out, tmp_path / "split.safetensors")
    with ts.open(tmp_path / "split.safetensors") as ckpt:
        plan = plan_grouped("merge", ckpt.protos)
        assert plan == {"m.experts.fc1.weight": ([("m.experts.0.fc1.weight", None), ("m.experts.1.fc1.weight", None)], True),
                        "m.norm": ([("m.norm", None)], False)}
        back = {n: build_grouped(s, m, lambda n, i: ckpt.get(n)) for n, (s, m) in plan.items()}
    assert_same_tensor(back["m.experts.fc1.weight"], fc1)
    assert list(plan_grouped("keep", {"a": None})) == ["a"]
    with pytest.raises(Exception, match="grouped must be one of"):
        plan_grouped("explode", {})


# --- Transformer Engine's GroupedTensor (CPU shim) ------------------------------------------------

te = te_shim.install()
needs_te = pytest.mark.skipif(te is None, reason="transformer-engine wheel not installed")


@needs_te
@pytest.mark.parametrize("qname,shapes", [c for c in CASES if "odd" not in c.id and "mxfp4" not in c.id])
def test_te_grouped_tensor_round_trip_is_byte_identical(tmp_path, qname, shapes):  # MXFP4: no TE class
    members = members_of(qname, shapes, seed=2)
    ours = G.from_members(members)
    theirs = ts.to_te(ours)
    assert type(theirs) is te.GroupedTensor and tuple(theirs.shape) == tuple(ours.shape)
    assert theirs.num_tensors == len(members) and [tuple(s) for s in theirs.tensor_shapes] == list(ours.member_shapes)
    # TE's own split of the packed buffers gives each member's bytes (TE's offsets = ours)
    for i, (tm, m) in enumerate(zip(theirs.split_into_quantized_tensors(), members)):
        if isinstance(m, tsf.QuantizedTensorStorage):
            tb = te_shim.te_buffers(tm)
            for n, b in m.buffers().items():
                assert same_bits(tb[n].reshape(b.shape).view(b.dtype), b), (i, n)
        else:
            assert same_bits(tm, m), i
    back = ts.from_te(theirs)
    assert_same_tensor(back, ours)
    ts.save_quantized({"w": theirs}, tmp_path / "te.safetensors")  # TE's tensor saved directly
    loaded = ts.load_quantized(tmp_path / "te.safetensors", as_te=True)["w"]
    assert type(loaded) is te.GroupedTensor
    assert_same_tensor(ts.from_te(loaded), ours)
    for n in tsf.grouped.GROUPED_BUFFERS:
        a, b = getattr(theirs, n), getattr(loaded, n)
        assert (a is None) == (b is None) and (a is None or same_bits(a, b)), n


@needs_te
def test_te_swizzled_member_scales_are_unswizzled():
    """TE grouped weights quantized for GEMM (optimize_for_gemm) hold swizzled scales per member."""
    members = members_of("mxfp8", "rows")
    theirs = ts.to_te(G.from_members(members))
    for tm, m in zip(theirs.split_into_quantized_tensors(), members):  # write TE's swizzled layout in place
        for n in ("_rowwise_scale_inv", "_columnwise_scale_inv"):
            getattr(tm, n).copy_(tsf.swizzle_scales(m.buffers()[n], columnwise=n.startswith("_col")))
    theirs.quantizer.optimize_for_gemm = True
    theirs.quantized_tensors = None
    assert not same_bits(theirs.scale_inv, G.from_members(members).scale_inv)
    assert_same_tensor(ts.from_te(theirs), G.from_members(members))


# --- convert(grouped=...) ---------------------------------------------------------------------------

def _moe_checkpoint(path, qname: str, shapes: str = "rows") -> dict:
    sd = {"model.layers.0.mlp.experts.down_proj.weight": G.from_members(members_of(qname, shapes)),
          "model.layers.0.mlp.gate.weight": torch.randn(4, 64, dtype=torch.bfloat16)}
    ts.save_quantized(sd, path)
    return sd


@pytest.mark.parametrize("qname", ["mxfp8", "nvfp4", "mxfp4", "bf16"])
def test_convert_splits_and_merges_grouped_weights_exactly(tmp_path, qname):
    sd = _moe_checkpoint(tmp_path / "src", qname)
    name = "model.layers.0.mlp.experts.down_proj.weight"
    rep = ts.convert(tmp_path / "src", tmp_path / "split", grouped="split")
    split = ts.load_quantized(tmp_path / "split")
    experts = [f"model.layers.0.mlp.experts.{i}.down_proj.weight" for i in range(3)]
    assert [n for n in split if "experts" in n] == experts and rep.lossless
    assert_same_members([split[n] for n in experts], sd[name].members())
    ts.convert(tmp_path / "split", tmp_path / "merged", grouped="merge")
    merged = ts.load_quantized(tmp_path / "merged")
    assert list(merged) == list(sd)
    assert_same_tensor(merged[name], sd[name], name)


def test_a_recipe_quantizes_each_member_of_a_grouped_weight(tmp_path):
    sd = _moe_checkpoint(tmp_path / "src", "bf16")
    name = "model.layers.0.mlp.experts.down_proj.weight"
    rep = ts.convert(tmp_path / "src", tmp_path / "out", recipe="mxfp8")       # te-serial output: kept grouped
    out = ts.load_quantized(tmp_path / "out")[name]
    assert isinstance(out, tsf.GroupedTensorStorage) and rep[name].label == "lossy"
    q = ts.MXFP8Quantizer(E4M3)
    assert_same_members(out.members(), [q(m) for m in sd[name].members()])


def test_a_hugging_face_export_splits_grouped_weights_by_default(tmp_path):
    sd = _moe_checkpoint(tmp_path / "src", "mxfp8")
    name = "model.layers.0.mlp.experts.down_proj.weight"
    ts.convert(tmp_path / "src", tmp_path / "hf", recipe="bf16")
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for i, m in enumerate(sd[name].members()):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{i}.down_proj.weight"], m.dequantize(torch.bfloat16))
    with pytest.raises(ts.errors.ConversionError, match="grouped must be one of"):
        ts.convert(tmp_path / "src", tmp_path / "x", grouped="explode")


def test_verified_member_reads_check_each_stored_buffer_once_per_open(tmp_path, monkeypatch):
    """Reading a grouped tensor's experts one by one with ``verify`` checks each stored buffer once per
    open checkpoint (not once per expert: that was quadratic in the experts), and a corrupted buffer is
    still refused at its first read, by a fresh open too."""
    import te_serial.checkpoint.reader as reader
    from te_serial.errors import ChecksumError
    g = G.from_members(members_of("mxfp8", "rows"))
    path = tmp_path / "ck.safetensors"
    ts.save_quantized({"e.experts.w.weight": g}, path)
    calls = []
    real = reader.checksum
    monkeypatch.setattr(reader, "checksum", lambda t: calls.append(t.numel()) or real(t))
    with ts.open(path) as ckpt:
        for i, m in enumerate(g.members()):
            assert_same_tensor(ckpt.get("e.experts.w.weight", member=i, verify=True), m, f"member {i}")
        stored = len(ckpt.manifest.locations("e.experts.w.weight"))
    assert len(calls) == stored
    with ts.open(path) as ckpt:   # another open checks again
        ckpt.get("e.experts.w.weight", member=0, verify=True)
    assert len(calls) == 2 * stored
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF   # a byte of the last stored buffer
    path.write_bytes(bytes(data))
    with ts.open(path) as ckpt, pytest.raises(ChecksumError):
        for i in range(g.quantizer.num_tensors):
            ckpt.get("e.experts.w.weight", member=i, verify=True)


def test_streamed_members_are_views_of_their_bytes_and_checked_once_written(tmp_path):
    """``Checkpoint.stream(members=)``: a range of a grouped tensor's experts (of a plain 3-D stack, its
    first-dim entries), equal to ``get(members=)``; the check it returns covers each stored buffer once
    per open and refuses a corrupted one; ranges outside the group, and members of a tensor that is not
    grouped, are refused with the reader's own error."""
    from te_serial.errors import CheckpointError, ChecksumError
    g = G.from_members(members_of("mxfp8", "rows"))
    stack = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    path = tmp_path / "ck.safetensors"
    ts.save_quantized({"e.experts.w.weight": g, "e.experts.plain": stack}, path)
    n = g.quantizer.num_tensors
    with ts.open(path) as ckpt:
        got, check = ckpt.stream("e.experts.w.weight", members=(1, n))
        want = ckpt.get("e.experts.w.weight", members=(1, n), verify=True)
        for i, (a, b) in enumerate(zip(got.members(), want.members())):
            assert_same_tensor(a, b, f"member {i + 1}")
        check()   # already verified by the get above: nothing to redo, nothing raised
        plain, check = ckpt.stream("e.experts.plain", members=(1, 3))
        assert torch.equal(plain, stack[1:3]) and torch.equal(ckpt.get("e.experts.plain", members=(1, 3)), stack[1:3])
        check()
        for bad in [(0, n + 1), (2, 2), (-1, 1)]:
            with pytest.raises(CheckpointError, match="members="):
                ckpt.stream("e.experts.w.weight", members=bad)
        with pytest.raises(CheckpointError, match="members="):
            ckpt.get("e.experts.plain", members=(3, 5))
    from te_serial.recipes import recipe_quantizer
    q = recipe_quantizer("mxfp8")
    ts.save_quantized({"w": q.quantize(torch.randn(64, 64))}, tmp_path / "dense.safetensors")
    with ts.open(tmp_path / "dense.safetensors") as ckpt, pytest.raises(CheckpointError, match="not grouped"):
        ckpt.stream("w", members=(0, 1))
    data = bytearray(path.read_bytes())
    with ts.open(path) as ckpt:
        _, file, key = ckpt.manifest.locations("e.experts.w.weight")[0][:3]
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + json.loads(data[8:header])[key]["data_offsets"][0] + 1] ^= 0x40
    path.write_bytes(bytes(data))
    with ts.open(path) as ckpt:
        _, check = ckpt.stream("e.experts.w.weight", members=(0, 1))
        with pytest.raises(ChecksumError):
            check()


@pytest.mark.parametrize("qname", [q for q in MEMBER_QUANTIZERS if q != "bf16"])
@pytest.mark.parametrize("rows", [128, 64, 32])
def test_rows_joined_is_join_rows_of_the_members_and_views_where_the_packing_is_the_join(qname, rows):
    """``GroupedTensorStorage.rows_joined``: the members stacked by rows as one tensor of the member
    format, equal to ``join_rows`` of the members (the reference); where every buffer runs along the
    rows unpadded (``stacks_flat``), its buffers are the packed grouped buffers themselves (views), and
    otherwise (padded scale grids, columnwise copies, a per-tensor scale) the general join, or the
    format's refusal when rows would mix (a tensor-wide value differing between members)."""
    from te_serial.formats.slicing import join_rows, stacks_flat
    q = MEMBER_QUANTIZERS[qname]()
    torch.manual_seed(rows)
    members = [q(make_input(INPUT_KINDS[i % len(INPUT_KINDS)], (rows, 256), torch.bfloat16, i) * (i + 1))
               for i in range(4)]
    g = G.from_members(members)
    try:
        want_shape, want = join_rows(q, [(m.logical_shape, m.buffers()) for m in members])
    except (FormatError, ShapeError) as e:
        with pytest.raises(type(e)):
            g.rows_joined()
        return
    got = g.rows_joined()
    assert tuple(got.logical_shape) == want_shape and got.quantizer == q
    for n, t in want.items():
        assert same_bits(got.buffers()[n], t), n
    flat = stacks_flat(q, (rows, 256), 4)
    packed = {t.untyped_storage().data_ptr() for t in g.buffers().values()}
    assert all(t.untyped_storage().data_ptr() in packed for t in got.buffers().values()) == flat
    if qname == "mxfp8":   # 128 rows: scale grids unpadded, packed = joined; 64: rowwise grids padded to 128
        assert flat == (rows == 128)
