"""What the serving layouts promise their consumers, checked against the producers' own conventions
(ModelOpt 0.47's flat config.json and FP8_PB_WO, llm-compressor's FP8_BLOCK) and the consumers'
code that runs here (compressed-tensors, transformers): names, shapes, config keys, scale bits
that survive a round trip, and an honest word where a consumer route rounds the scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import te_serial as ts
from te_serial.conversion import convert
from te_serial.formats import QuantizedTensorStorage
from te_serial.recipes import recipe_quantizer

transformers = pytest.importorskip("transformers")
E4M3 = torch.float8_e4m3fn
LAYER = "model.layers.0.self_attn.q_proj"
LINEARS = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + [f"model.layers.0.mlp.{p}_proj"
                                                                  for p in ("gate", "up", "down")]


def _llama(path, hidden=256, inter=384):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(path)
    return m


def _te(path, recipe, hidden=256, inter=384):
    m = _llama(path / "hf", hidden, inter)
    q = recipe_quantizer(recipe, columnwise=False)
    sd = {n: (q(p.detach()) if n.endswith("proj.weight") else p.detach()) for n, p in m.state_dict().items()}
    ts.save_quantized(sd, path / "te")
    (path / "te" / "config.json").write_text(json.dumps(m.config.to_dict()))
    return sd


def _weights(d):
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def _values(d):
    """te-serial's fp32 values of every quantized weight of the checkpoint at ``d`` (re-imported)."""
    convert(d, d.parent / (d.name + "_back"), overwrite=True)
    return {n: t.dequantize(torch.float32) for n, t in ts.load_quantized(d.parent / (d.name + "_back")).items()
            if isinstance(t, QuantizedTensorStorage)}


# --- ModelOpt: config.json in ModelOpt's flat form, FP8_PB_WO as ModelOpt writes it ---------------

@pytest.mark.parametrize("layout,algo,groups", [("modelopt_nvfp4", "W4A16_NVFP4", True), ("modelopt_fp8", "FP8", True),
                                                ("modelopt_mxfp8", "MXFP8", False),
                                                ("modelopt_fp8_pb_wo", "fp8_pb_wo", False)])
def test_modelopt_config_json_is_the_flat_form_sglang_and_vllm_read(layout, algo, groups, tmp_path):
    """ModelOpt's convert_hf_quant_config_format: ``ignore`` (SGLang reads the exclusions from this
    key alone in config.json), config_groups where ModelOpt writes them, no nested-only keys;
    hf_quant_config.json keeps ``exclude_modules``."""
    _llama(tmp_path / "hf")
    amax = {m: 4.0 for m in LINEARS} if layout == "modelopt_fp8" else None
    convert(tmp_path / "hf", tmp_path / "out", recipe=layout, activation_amax=amax)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == algo
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]
    assert not {"exclude_modules", "kv_cache_quant_algo", "group_size"} & set(qc)
    assert ("config_groups" in qc) == groups
    if groups:
        g = qc["config_groups"]["group_0"]
        assert g["targets"] == ["Linear"] and g["weights"]["type"] == "float"
        assert g["weights"]["num_bits"] == (4 if "NVFP4" in algo else 8)
        assert ("input_activations" in g) == (algo == "FP8")
    nested = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert nested["quant_algo"] == algo and nested["exclude_modules"] == qc["ignore"]


def test_modelopt_fp8_pb_wo_scale_is_4d_and_both_forms_read_back(tmp_path):
    sd = _te(tmp_path, "fp8_block", hidden=256, inter=320)   # 320: a partial last block
    rep = convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_fp8_pb_wo")
    assert all(t.label == "lossless" for t in rep.tensors if t.name.endswith("proj.weight"))
    w = _weights(tmp_path / "mo")
    assert w[f"{LAYER}.weight_scale"].shape == (2, 1, 2, 1)
    assert w["model.layers.0.mlp.gate_proj.weight_scale"].shape == (3, 1, 2, 1)
    first = _values(tmp_path / "mo")
    # the variants in the wild: a 2-D scale, the name in upper case
    for k in [k for k in w if k.endswith("weight_scale")]:
        w[k] = w[k].reshape(w[k].shape[0], w[k].shape[2])
    save_file(w, str(tmp_path / "mo" / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "hf_quant_config.json"):
        p = tmp_path / "mo" / name
        p.write_text(p.read_text().replace('"fp8_pb_wo"', '"FP8_PB_WO"'))
    second = _values(tmp_path / "mo")
    for n, t in sd.items():
        if isinstance(t, QuantizedTensorStorage):
            want = t.dequantize(torch.float32)
            assert torch.equal(first[n], want) and torch.equal(second[n], want), n


# --- compressed-tensors FP8_BLOCK -------------------------------------------------------------------

def test_te_blockwise_fp8_is_llm_compressors_fp8_block_both_ways(tmp_path):
    """TE's 128x128 blockwise FP8 is compressed-tensors strategy 'block' exactly: the export is
    lossless, carries FP8_BLOCK's arguments, decompresses with compressed-tensors' own code and
    loads through transformers to te-serial's values, and imports back to the same bytes."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    sd = _te(tmp_path, "fp8_block")
    rep = convert(tmp_path / "te", tmp_path / "ct", recipe="compressed_tensors_fp8_block")
    assert all(t.label == "lossless" and not t.routes for t in rep.tensors if t.name.endswith("proj.weight"))
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    g = qc["config_groups"]["group_0"]
    assert g["weights"]["strategy"] == "block" and g["weights"]["block_structure"] == [128, 128]
    assert g["input_activations"]["strategy"] == "group" and g["input_activations"]["dynamic"] is True
    w = _weights(tmp_path / "ct")
    assert w[f"{LAYER}.weight_scale"].shape == (2, 2) and w[f"{LAYER}.weight"].dtype == E4M3
    # compressed-tensors' own dequantizer (validates config.json with its pydantic models)
    got = CompressedTensorsDequantizer(str(tmp_path / "ct"), dtype=torch.float32).process(w)
    for m in LINEARS:
        assert torch.equal(got[f"{m}.weight"], sd[f"{m}.weight"].dequantize(torch.float32)), m
    # transformers' compressed-tensors route, dequantizing
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ct", quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert torch.equal(model.get_submodule(LAYER).weight.float(), sd[f"{LAYER}.weight"].dequantize(torch.float32))
    back = _values(tmp_path / "ct")
    assert all(torch.equal(back[n], t.dequantize(torch.float32)) for n, t in sd.items() if isinstance(t, QuantizedTensorStorage))


# --- scales that survive the consumers --------------------------------------------------------------

def test_bf16_rounding_route_is_labelled_with_the_error_transformers_gives(tmp_path):
    """transformers' default compressed-tensors route holds weight_scale in BF16: an fp32 scale that
    BF16 cannot hold moves the values there. The report says so per tensor with the largest change,
    which is what transformers' loaded module then holds."""
    _llama(tmp_path / "hf")
    rep = convert(tmp_path / "hf", tmp_path / "ct", recipe="compressed_tensors_fp8")
    hit = [t for t in rep.tensors if t.routes]
    assert hit and any(n.startswith("NOT lossless through transformers' default") for n in rep.notes)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct")
    ours = _values(tmp_path / "ct")
    for t in hit:
        mod = model.get_submodule(t.name[: -len(".weight")])
        assert mod.weight_scale.dtype == torch.bfloat16   # the route's own dtype
        held = mod.weight.float() * mod.weight_scale.float()
        err = float((held.detach() - ours[t.name]).abs().max())
        assert err > 0 and err == pytest.approx(next(iter(t.routes.values())), rel=1e-6), t.name
    # TE's blockwise FP8 (power-of-two scales, exact in BF16): no such route
    _te(tmp_path / "b", "fp8_block")
    rep = convert(tmp_path / "b" / "te", tmp_path / "b" / "ct", recipe="compressed_tensors_fp8_block")
    assert not any(t.routes for t in rep.tensors) and not any("NOT lossless" in n for n in rep.notes)


@pytest.mark.parametrize("layout,key", [("compressed_tensors_nvfp4", "input_global_scale"),
                                        ("modelopt_nvfp4", "input_scale"), ("modelopt_fp8", "input_scale"),
                                        ("compressed_tensors_fp8_tensor", "input_scale")])
def test_static_input_scales_keep_their_bits_through_import_and_reexport(layout, key, tmp_path):
    """A producer's input scale (e.g. llm-compressor's input_global_scale 1152.0) comes back bit
    for bit: the import records the fp32 amax whose scale is exactly the stored one."""
    _llama(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "a", recipe=layout, activation_amax={m: 4.0 for m in LINEARS})
    w = _weights(tmp_path / "a")
    g = torch.Generator().manual_seed(7)
    for i, m in enumerate(LINEARS):   # awkward values, one per fused group (engines share them)
        v = 1152.0 if key == "input_global_scale" and i < 3 else float(torch.rand((), generator=g) * 3 + 0.01)
        w[f"{m}.{key}"] = torch.full_like(w[f"{m}.{key}"], v)
    for group in (LINEARS[:3], LINEARS[4:6]):
        for m in group[1:]:
            w[f"{m}.{key}"] = w[f"{group[0]}.{key}"].clone()
    save_file(w, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    convert(tmp_path / "a", tmp_path / "te")
    convert(tmp_path / "te", tmp_path / "b", recipe=layout)
    again = _weights(tmp_path / "b")
    for m in LINEARS:
        assert torch.equal(again[f"{m}.{key}"].view(torch.int32), w[f"{m}.{key}"].view(torch.int32)), m
