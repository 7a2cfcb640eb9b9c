"""MXFP4 checkpoints of every layout in ``mxfp4.md`` (gpt-oss, compressed-tensors
``mxfp4-pack-quantized``, ModelOpt ``mxfp4`` / ``W4A8_MXFP4_FP8``, DeepSeek-V4 FP4 experts): detected,
read as te-serial MXFP4 tensors holding the files' bytes (checked against an independent decoder
written from the document), written back byte for byte, and read by the consumers' own code
(transformers' ``Mxfp4`` quantizer with ``dequantize=True``, compressed-tensors' decompressor)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

import te_serial as ts
from te_serial.errors import ConversionError, UnknownLayoutError
from te_serial.formats import MXFP4Quantizer
from te_serial.formats.grouped import GroupedTensor

import _mxfp4_data as D

tc = importlib.import_module("te_serial.conversion")
ROW = MXFP4Quantizer(rowwise=True, columnwise=False)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                              b.reshape(-1).contiguous().view(torch.uint8))


def _rowwise(t) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K/2], scale bytes [N, K/32]) a te-serial MXFP4 tensor holds, through the format's protocol."""
    q, b = t.quantizer, t.buffers()
    lay = q.usage_layout("rowwise")
    return b[lay.data], q.block_scales(b, tuple(t.logical_shape), "rowwise").contiguous().view(torch.uint8)


def _same_files(a_dir, b_dir) -> list[str]:
    """Keys whose tensors differ (bytes, shape or presence) between two checkpoints' safetensors."""
    a, b = load_file(str(a_dir / "model.safetensors")), {}
    for p in b_dir.glob("*.safetensors"):
        b.update(load_file(str(p)))
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not _bits(a[k], b[k])]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return D.gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "src")


# --- import ---------------------------------------------------------------------------------------

def test_gpt_oss_experts_read_as_grouped_transposed_mxfp4_holding_the_files_bytes(gpt_oss):
    root, written = gpt_oss
    assert tc.detect_layout(root) == "gpt_oss_mxfp4"
    with tc.open_source(root) as src:
        assert not any(k.endswith(("_blocks", "_scales")) for k in src.tensors)
        for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            blocks, scales = written[name + "_blocks"], written[name + "_scales"]
            e, n, kb, _ = blocks.shape
            t = src.load(name)
            assert isinstance(t, GroupedTensor) and tuple(t.shape) == (e, kb * 32, n)   # transformers' [E, in, out]
            g = t.quantizer
            assert g.transposed and g.member == ROW and g.member_shapes[0] == (n, kb * 32)
            for i, m in enumerate(t.members()):
                codes, sb = _rowwise(m)
                assert _bits(codes, blocks[i].reshape(n, -1)) and _bits(sb, scales[i]), (name, i)
            want = D.decode(blocks.reshape(e, n, -1), scales).transpose(1, 2)
            assert torch.equal(t.dequantize(torch.float32).view(torch.int32), want.contiguous().view(torch.int32))
        bias = src.load("model.layers.0.mlp.experts.gate_up_proj_bias")
        assert bias.dtype == torch.bfloat16 and torch.equal(bias, written["model.layers.0.mlp.experts.gate_up_proj_bias"])


@pytest.mark.parametrize("kind", ["ct", "modelopt_mxfp4", "modelopt_w4a8", "deepseek_v4"])
def test_linear_layouts_detected_and_read_byte_for_byte(kind, tmp_path):
    root, ref = {"ct": lambda p: D.ct_checkpoint(p), "modelopt_mxfp4": lambda p: D.modelopt_checkpoint(p, "mxfp4"),
                 "modelopt_w4a8": lambda p: D.modelopt_checkpoint(p, "W4A8_MXFP4_FP8"),
                 "deepseek_v4": lambda p: D.deepseek_v4_checkpoint(p)}[kind](tmp_path / kind)
    layout = {"ct": "compressed_tensors_mxfp4", "deepseek_v4": "block_fp8_mixed"}.get(kind, "modelopt_mxfp4")
    assert tc.detect_layout(root) == layout
    with tc.open_source(root) as src:
        for module, (codes, scales) in ref.items():
            t = src.load(module + ".weight")
            if codes.dtype != torch.uint8:   # DeepSeek-V4's FP8 attention: 128x128 blocks, power-of-two scales
                assert t.quantizer.force_pow_2_scales
                continue
            assert t.quantizer == ROW and src.tensors[module + ".weight"].fmt.endswith(("mxfp4", "fp4"))
            got_codes, got_scales = _rowwise(t)
            assert _bits(got_codes, codes) and _bits(got_scales, scales), module
            want = D.decode(codes, scales)   # scale bytes 0, 1 and 254, -0 blocks: every value exact in fp32
            assert torch.equal(t.dequantize(torch.float32).view(torch.int32), want.view(torch.int32)), module
        if kind == "modelopt_w4a8":   # FP8 per-tensor input scales: kept as each layer's activation amax
            assert set(src.activation_amax) == {m for m in ref}
            assert all(n.endswith(".input_scale") for n in src.dropped)


def test_deepseek_v4_scale_bytes_are_reinterpreted_never_cast(tmp_path):
    root, ref = D.deepseek_v4_checkpoint(tmp_path / "ds")
    raw = load_file(str(root / "model.safetensors"))
    key = "layers.0.ffn.experts.0.w1"
    assert raw[key + ".scale"].dtype == torch.float8_e8m0fnu and raw[key + ".weight"].dtype == torch.int8
    with tc.open_source(root) as src:
        _, scales = _rowwise(src.load(key + ".weight"))
    # a numeric cast of E8M0 2^-7 (byte 120) to an integer would give 0: the bytes are the file's
    assert _bits(scales, raw[key + ".scale"].view(torch.uint8)) and int(scales.max()) > 1


def test_compressed_tensors_moe_experts_fuse_into_transformers_3d_experts(tmp_path):
    root, ref = D.ct_checkpoint(tmp_path / "ct")
    wanted = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    with tc.open_source(root) as src:
        view = tc.sources.FusedExpertsView(src, wanted)
        assert view.changes
        gu, down = view.load(wanted[0]), view.load(wanted[1])
    assert tuple(gu.shape) == (2, 64, 128) and tuple(down.shape) == (2, 128, 32)
    p = "model.layers.1.mlp.experts"
    for e in range(2):
        want = torch.cat([D.decode(*ref[f"{p}.{e}.gate_proj"]), D.decode(*ref[f"{p}.{e}.up_proj"])])
        assert torch.equal(gu.members()[e].dequantize(torch.float32).view(torch.int32), want.view(torch.int32))
        assert torch.equal(down.members()[e].dequantize(torch.float32), D.decode(*ref[f"{p}.{e}.down_proj"]))


# --- export: back to each layout, byte for byte ------------------------------------------------

@pytest.mark.parametrize("kind,layout", [("gpt_oss", "gpt_oss_mxfp4"), ("ct", "compressed_tensors_mxfp4"),
                                         ("modelopt_mxfp4", "modelopt_mxfp4"), ("modelopt_w4a8", "modelopt_mxfp4")])
def test_import_then_export_to_its_own_layout_gives_the_same_bytes(kind, layout, tmp_path):
    make = {"gpt_oss": lambda p: D.gpt_oss_checkpoint(p), "ct": lambda p: D.ct_checkpoint(p),
            "modelopt_mxfp4": lambda p: D.modelopt_checkpoint(p, "mxfp4"),
            "modelopt_w4a8": lambda p: D.modelopt_checkpoint(p, "W4A8_MXFP4_FP8")}[kind]
    root, _ = make(tmp_path / "src")
    direct = tc.convert(root, tmp_path / "direct", recipe=layout)        # layout → layout
    assert _same_files(root, tmp_path / "direct") == []
    assert all(t.label in ("lossless", "dropped") for t in direct.tensors)
    tc.convert(root, tmp_path / "te", recipe=None)                       # → te-serial → layout
    tc.convert(tmp_path / "te", tmp_path / "back", recipe=layout)
    assert _same_files(root, tmp_path / "back") == []
    assert tc.detect_layout(tmp_path / "back") == layout
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    if kind == "gpt_oss":
        assert cfg["quant_method"] == "mxfp4" and set(cfg) == {"quant_method", "modules_to_not_convert"}
        assert "model.layers.0.mlp.router" in cfg["modules_to_not_convert"]
    elif kind.startswith("modelopt"):
        hfq = json.loads((tmp_path / "back" / "hf_quant_config.json").read_text())["quantization"]
        assert hfq["quant_algo"] == ("mxfp4" if kind == "modelopt_mxfp4" else "W4A8_MXFP4_FP8")
        assert ("group_size" in hfq) == (kind == "modelopt_w4a8")
    else:
        assert cfg["format"] == "mxfp4-pack-quantized"


def test_gpt_oss_layout_quantizes_experts_only_and_refuses_other_3d_layouts(gpt_oss, tmp_path):
    root, _ = gpt_oss
    rep = tc.convert(root, tmp_path / "te", recipe=None)
    rep = tc.convert(tmp_path / "te", tmp_path / "out", recipe="gpt_oss_mxfp4")
    attn = rep["model.layers.0.self_attn.q_proj.weight"]
    assert attn.target == "bf16" and "experts only" in attn.note
    with pytest.raises(ConversionError, match="gpt_oss_mxfp4"):   # 3-D experts into a per-expert layout
        tc.convert(tmp_path / "te", tmp_path / "ct", recipe="compressed_tensors_mxfp4")
    with pytest.raises(ConversionError, match="rule target"):
        tc.convert(tmp_path / "te", tmp_path / "r", rules={"*q_proj.weight": "gpt_oss_mxfp4"})


def test_gpt_oss_export_of_a_model_quantized_whole_writes_the_rest_as_its_values_in_bf16(tmp_path):
    """A gpt-oss quantized whole (attention too, ``quantize_model(model, "mxfp4")``): the gpt-oss layout holds
    only the experts in MXFP4, so the quantized attention weights are written dequantized to BF16 (MXFP4
    values are exact there) under their own names, not kept as MXFP4 under names the layout cannot write."""
    from test_moe import build
    model = ts.quantize_model(build("gpt_oss"), "mxfp4", columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    rep = tc.convert(tmp_path / "te", tmp_path / "out", recipe="gpt_oss_mxfp4")
    raw = {}
    for p in (tmp_path / "out").glob("*.safetensors"):
        raw.update(load_file(str(p)))
    ours = dict(model.named_parameters())
    attn = [n for n in ours if ".self_attn." in n and n.endswith(".weight")]
    assert attn and all(isinstance(ours[n], MXFP4Quantizer.tensor_class) for n in attn)
    for n in attn:
        assert raw[n].dtype == torch.bfloat16 and torch.equal(raw[n], ours[n].dequantize(torch.bfloat16)), n
        assert rep[n].target == "bf16" and "experts only" in rep[n].note and rep[n].label == "lossless", rep[n]
    for n in [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, out = ours[n].shape
        for i, m in enumerate(ours[n].members()):
            codes, sb = _rowwise(m)
            assert _bits(codes, raw[n + "_blocks"][i].reshape(out, k // 2)) and _bits(sb, raw[n + "_scales"][i]), (n, i)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "mxfp4" and set(attn) <= {m + ".weight" for m in cfg["modules_to_not_convert"]}


def test_layouts_refuse_what_they_do_not_hold(tmp_path):
    root, written = D.gpt_oss_checkpoint(tmp_path / "g")
    from safetensors.torch import save_file
    t = dict(written)
    del t["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(t, str(root / "model.safetensors"))
    with pytest.raises(UnknownLayoutError, match="down_proj_blocks"):
        tc.open_source(root)
    root, ref = D.ct_checkpoint(tmp_path / "ct")
    raw = load_file(str(root / "model.safetensors"))
    raw["model.layers.0.mlp.gate_proj.weight_scale"] = raw["model.layers.0.mlp.gate_proj.weight_scale"][:, :2].clone()
    save_file(raw, str(root / "model.safetensors"))
    with pytest.raises(UnknownLayoutError, match=r"MXFP4 weight_packed.*gate_proj"):
        tc.open_source(root)


# --- the consumers' own readers ---------------------------------------------------------------------

def _te_mxfp4_gpt_oss(tmp_path):
    """A tiny gpt-oss whose experts te-serial quantized (quantize_model, recipe mxfp4), saved and exported."""
    transformers = pytest.importorskip("transformers")
    cfg = D.gpt_oss_config()
    conf = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(conf).to(torch.bfloat16)
    ts.quantize_model(model, "mxfp4", columnwise=False, include=["*experts*"])
    ts.save_quantized(model, tmp_path / "te")
    tc.convert(tmp_path / "te", tmp_path / "gpt_oss", recipe="gpt_oss_mxfp4")
    return model


def test_transformers_mxfp4_quantizer_dequantizes_the_export_to_te_serials_values(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _te_mxfp4_gpt_oss(tmp_path)
    got = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "gpt_oss", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    n = 0
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mine = p.dequantize(torch.bfloat16)   # exact: E2M1 x 2^e fits BF16
            assert torch.equal(got.get_parameter(name).data.view(torch.int16), mine.view(torch.int16)), name
            n += 1
    assert n == 4


def test_compressed_tensors_decompressor_reads_the_mxfp4_export(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    root, ref = D.ct_checkpoint(tmp_path / "ct", seed=5)
    tc.convert(root, tmp_path / "te", recipe=None)
    tc.convert(tmp_path / "te", tmp_path / "out", recipe="compressed_tensors_mxfp4")
    raw = {}
    for p in (tmp_path / "out").glob("*.safetensors"):
        raw.update(load_file(str(p)))
    deq = CompressedTensorsDequantizer(str(tmp_path / "out"), dtype=torch.float32)   # validates config.json
    got = deq.process(raw)
    with ts.open(tmp_path / "te") as ck:
        for module in ref:
            mine = ck.get(module + ".weight").dequantize(torch.bfloat16)
            # compressed-tensors decompresses in BF16 (2^(b-127) as bf16): exact where BF16 holds the value
            assert torch.equal(got[module + ".weight"].to(torch.bfloat16), mine), module


# --- models ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [None, "mxfp4", "mxfp8"])
def test_load_into_gives_transformers_dequantized_gpt_oss_logits(recipe, tmp_path):
    """``load_into`` of a gpt-oss MXFP4 directory (as it is, or converted to a te-serial recipe, experts only)
    holds quantized experts (no BF16 copy) and gives the logits of transformers' own dequantized gpt-oss."""
    transformers = pytest.importorskip("transformers")
    root, _ = D.gpt_oss_checkpoint(tmp_path / "g", lo=118, hi=124, adversarial=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        root, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    path = root
    if recipe is not None:
        rep = tc.convert(root, tmp_path / recipe, rules={"*.experts.gate_up_proj": recipe, "*.experts.down_proj": recipe})
        assert all(t.label == "lossless" or "bit-identical" in t.note for t in rep.tensors)   # MXFP4 → MXFP8: exact
        path = tmp_path / recipe
    cfg = D.gpt_oss_config()
    conf = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM._from_config(conf, dtype=torch.bfloat16)
    ts.load_into(model, path)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, GroupedTensor) and isinstance(experts.down_proj, GroupedTensor)
    assert experts.gate_up_proj.quantizer.member.kind == (recipe or "mxfp4")
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 2, 40]])
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.parametrize("recipe", [None, "mxfp4", "mxfp8"])
def test_from_pretrained_of_a_gpt_oss_mxfp4_directory_with_te_serial_config(recipe, tmp_path, monkeypatch):
    """``from_pretrained(gpt_oss_dir, quantization_config=TeSerialConfig(recipe=...))`` (transformers would
    give the directory its own Mxfp4 quantizer): te-serial reads the experts' blocks and scales itself into
    grouped quantized experts (the file's MXFP4 bytes, or MXFP8 exactly), no BF16 copy of them; logits equal
    transformers' own dequantized gpt-oss, and save_pretrained writes a te-serial directory that loads back."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("te_serial.hf")
    root, _ = D.gpt_oss_checkpoint(tmp_path / "g", lo=118, hi=124, adversarial=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        root, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    from test_moe import _bytes_but_quantized_data, _spy_materialized
    seen = _spy_materialized(monkeypatch)
    config = hf.TeSerialConfig(recipe=recipe, usages=["rowwise"], exclude=["*.self_attn.*"])  # the experts only
    model = transformers.AutoModelForCausalLM.from_pretrained(root, quantization_config=config, dtype=torch.bfloat16)
    assert sum(seen) <= _bytes_but_quantized_data(root)   # transformers read none of the experts' blocks
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, GroupedTensor) and isinstance(experts.down_proj, GroupedTensor)
    assert experts.gate_up_proj.quantizer.member.kind == (recipe or "mxfp4")
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 2, 40]])
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.isfinite(want).all() and torch.equal(model(ids).logits, want)
    model.save_pretrained(tmp_path / "te")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "te")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
