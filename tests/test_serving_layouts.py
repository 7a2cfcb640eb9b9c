"""Serving layouts (ModelOpt, compressed-tensors, DeepSeek) written and read back, checked with the
real clients where they install without CUDA: compressed-tensors' own decompressors and its
ModelOpt → compressed-tensors NVFP4 converter, transformers' ``from_pretrained``, torch's
``QuantizedHuggingFaceStorageReader``. (No serving engine runs on this CPU-only machine.)

NVFP4: the codes and block scales are TE's bytes; a reader applies the global scale with its
own formula (ModelOpt ``s · weight_scale_2``, compressed-tensors ``s / weight_global_scale``), so
values can land a few fp32 ulp from TE's ``(s · amax) · (1 / 2688)``. The tests measure that per
element and hold it to the bound the report states ("exact codes")."""

from __future__ import annotations

import importlib
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

import te_serial as ts
from te_serial.errors import ConversionError, UnknownLayoutError
from te_serial.recipes import recipe_quantizer

from _convert_data import E4M3, deepseek_checkpoint, mxfp8_dequantize, nvfp4_dequantize, randn

tc = importlib.import_module("te_serial.conversion")

SERVING = ["modelopt_nvfp4", "compressed_tensors_nvfp4", "modelopt_mxfp8", "compressed_tensors_mxfp8",
           "modelopt_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8", "compressed_tensors_fp8_tensor",
           "deepseek_fp8", "sglang_mxfp8"]
#: TE recipe → serving layouts whose path keeps its bytes (from the formats' definitions)
EXACT = {"nvfp4": {"modelopt_nvfp4", "compressed_tensors_nvfp4"},
         "nvfp4_2d": {"modelopt_nvfp4", "compressed_tensors_nvfp4"},
         "mxfp8": {"modelopt_mxfp8", "compressed_tensors_mxfp8", "sglang_mxfp8"},
         "mxfp8_2d": {"modelopt_mxfp8", "compressed_tensors_mxfp8", "sglang_mxfp8"},
         "fp8_current": {"modelopt_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8", "compressed_tensors_fp8_tensor",
                         "deepseek_fp8"},
         "fp8_delayed": {"modelopt_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8",
                         "compressed_tensors_fp8_tensor", "deepseek_fp8"},
         "fp8_block": {"modelopt_fp8_pb_wo", "deepseek_fp8"}}
NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(x):
        i = x.float().contiguous().view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


def _te_checkpoint(path, recipe: str, *, rowwise=True, columnwise=True, extra=None):
    q = recipe_quantizer(recipe, rowwise=rowwise, columnwise=columnwise)
    sd = {NAMES[0]: q(randn((256, 512), 1, scale=0.7)), NAMES[1]: q(randn((512, 256), 2, scale=3.0)),
          "model.embed_tokens.weight": randn((64, 256), 3), "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
    sd.update(extra or {})
    ts.save_quantized(sd, path)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return ts.load_quantized(path)


def _read(d) -> dict[str, torch.Tensor]:
    out = {}
    for p in d.glob("*.safetensors"):
        out.update(load_file(str(p)))
    return out


# --- every TE format × every serving layout -------------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(EXACT))
def test_te_formats_into_serving_layouts_and_back(recipe, tmp_path):
    """Exact where the bytes allow: NVFP4's codes and block scales byte-identical with a measured
    ulp bound, everything else lossless; importing the export gives the source's rowwise bytes."""
    src = _te_checkpoint(tmp_path / "te", recipe)
    amax = {n[: -len(".weight")]: 5.0 for n in NAMES}
    for layout in SERVING:
        out = tmp_path / layout
        rep = tc.convert(tmp_path / "te", out, recipe=layout, activation_amax=amax)
        exact = layout in EXACT[recipe]
        for name in NAMES:
            t = rep[name]
            assert (t.label in ("lossless", "exact codes")) == exact, (recipe, layout, t.label, t.note)
            assert (t.label == "exact codes") <= ("nvfp4" in layout), (recipe, layout)
        files = {p.name for p in out.iterdir()}
        assert {"model.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
                "te_serial_export.json"} <= files
        if not exact:
            continue
        raw = _read(out)
        for name in NAMES:
            p, t, s = name[: -len("weight")], src[name], rep[name]
            b = t.buffers()
            if "nvfp4" in layout:
                data = raw[p + ("weight" if layout.startswith("modelopt") else "weight_packed")]
                scale = raw[p + "weight_scale"]
                assert torch.equal(data, b["_rowwise_data"]) and scale.dtype == E4M3
                assert torch.equal(scale.view(torch.uint8), b["_rowwise_scale_inv"][:t.shape[0], :t.shape[1] // 16])
                glob = raw[p + ("weight_scale_2" if layout.startswith("modelopt") else "weight_global_scale")]
                got = nvfp4_dequantize(data, scale, glob, layout.startswith("modelopt"))
                d = _ulps(tc.values(t), got)
                assert int(d.max()) <= s.ulp_max and int((d > 0).sum()) <= s.ulp_elements, (name, s.ulp_max)
                if s.label == "lossless":
                    assert int(d.max()) == 0
            elif "mxfp8" in layout:
                assert torch.equal(raw[name].view(torch.uint8), b["_rowwise_data"])
                scale = raw[name + "_scale_inv"] if layout == "sglang_mxfp8" else raw[p + "weight_scale"]
                assert scale.dtype == torch.uint8
                assert torch.equal(mxfp8_dequantize(raw[name], scale), tc.values(t))
        back = tc.convert(out, tmp_path / f"{layout}-back")
        assert back.source_layout.startswith(layout.split("_fp8")[0].split("_nvfp4")[0].split("_mxfp8")[0])
        again = ts.load_quantized(tmp_path / f"{layout}-back")
        for name in NAMES:
            t, u = src[name], again[name]
            assert u.quantizer.rowwise and not u.quantizer.columnwise
            if recipe.startswith("fp8_") and recipe != "fp8_block" and layout in (
                    "deepseek_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8"):
                # per-tensor FP8 spread over blocks / channels: the values come back, in that format
                assert torch.equal(tc.values(u).view(torch.int32), tc.values(t, "rowwise").view(torch.int32))
                continue
            want = t.quantizer.set_usage(rowwise=True, columnwise=False)
            assert u.quantizer.layout_key() == want.layout_key(), (layout, u.quantizer, want)
            for k, v in u.buffers().items():
                assert torch.equal(v.view(torch.uint8), t.buffers()[k].view(torch.uint8)), (layout, name, k)


def test_nvfp4_2d_exported_by_repeating_tile_scales_and_derived_back(tmp_path):
    """16×16 NVFP4 (columnwise-only too: its rowwise usage is a nibble transpose) goes out as 1×16
    scales repeated over the tile's 16 rows, and comes back as nvfp4_2d with both usages derivable."""
    x = randn((256, 512), 5, scale=2.0)
    full = recipe_quantizer("nvfp4_2d")(x)
    ts.save_quantized({"a.weight": recipe_quantizer("nvfp4_2d", rowwise=False)(x)}, tmp_path / "te")
    rep = tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4")
    assert rep["a.weight"].method == "relayout" and rep["a.weight"].label in ("lossless", "exact codes")
    scale = load_file(str(tmp_path / "mo" / "model.safetensors"))["a.weight_scale"].view(torch.uint8)
    assert torch.equal(scale.reshape(16, 16, 32)[:, :1].expand(16, 16, 32).reshape(256, 32), scale)
    assert torch.equal(scale, full.buffers()["_rowwise_scale_inv"][:, :32])
    tc.convert(tmp_path / "mo", tmp_path / "te2", recipe="nvfp4_2d", usages="both")
    back = ts.load_quantized(tmp_path / "te2")["a.weight"]
    for k, v in full.buffers().items():
        assert torch.equal(back.buffers()[k], v), k


def test_rht_columnwise_is_not_served_and_rowwise_is(tmp_path):
    """RHT-transformed columnwise data cannot be served: a rowwise copy goes out exactly; a
    columnwise-only RHT tensor is requantized from its values, and the report says why."""
    x = randn((256, 256), 6)
    q = ts.NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    ts.save_quantized({"a.weight": q(x), "b.weight": q.set_usage(rowwise=False)(x)}, tmp_path / "te")
    rep = tc.convert(tmp_path / "te", tmp_path / "ct", recipe="compressed_tensors_nvfp4")
    assert rep["a.weight"].label in ("lossless", "exact codes") and rep["a.weight"].method == "copy"
    b = rep["b.weight"]
    assert b.label == "lossy" and b.method == "requantize" and "rowwise usage is not derivable" in b.note


def test_nvfp4_import_without_sidecar_keeps_codes_and_states_the_bound(tmp_path):
    """A ModelOpt / compressed-tensors NVFP4 checkpoint te-serial did not write: codes and scales as
    stored, an amax whose layout-formula global scale is the stored one, "exact codes" reported."""
    _te_checkpoint(tmp_path / "te", "nvfp4", columnwise=False)
    for layout, glob in (("modelopt_nvfp4", "weight_scale_2"), ("compressed_tensors_nvfp4", "weight_global_scale")):
        out = tmp_path / layout
        tc.convert(tmp_path / "te", out, recipe=layout)
        (out / "te_serial_export.json").unlink()
        raw = _read(out)
        rep = tc.convert(out, tmp_path / f"{layout}-te")
        again = tc.convert(tmp_path / f"{layout}-te", tmp_path / f"{layout}-2", recipe=layout)
        back = _read(tmp_path / f"{layout}-2")
        for name in NAMES:
            assert rep[name].label in ("lossless", "exact codes")
            assert again[name].label in ("lossless", "exact codes")
            p = name[: -len("weight")]
            for k in [v for v in raw if v.startswith(p)]:
                assert torch.equal(back[k].reshape(-1).view(torch.uint8), raw[k].reshape(-1).view(torch.uint8)), k  # incl. global
            assert glob in "".join(back)


# --- the real clients ----------------------------------------------------------------------------

def test_compressed_tensors_decompresses_nvfp4_and_mxfp8_exports(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    for recipe, layout in (("nvfp4", "compressed_tensors_nvfp4"), ("mxfp8", "compressed_tensors_mxfp8")):
        src = _te_checkpoint(tmp_path / recipe, recipe)
        out = tmp_path / layout
        rep = tc.convert(tmp_path / recipe, out, recipe=layout)
        deq = CompressedTensorsDequantizer(str(out), dtype=torch.float32)  # validates config.json with pydantic
        got = deq.process(_read(out))
        for name in NAMES:
            te_bf16 = src[name].dequantize(torch.bfloat16)
            if recipe == "mxfp8":  # bf16(q · 2^e) both ways: equal
                assert torch.equal(got[name].to(torch.bfloat16), te_bf16), name
            else:  # compressed-tensors rounds q · (s / gs) to bf16: within the report's fp32 bound, then rounded
                d = _ulps(got[name], te_bf16.float())
                assert int((d > 0).sum()) <= rep[name].ulp_elements
                assert float((got[name] - te_bf16.float()).abs().max()) <= 2 * float(te_bf16.abs().max()) / 128


def test_compressed_tensors_modelopt_converter_gives_our_ct_export(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import ModelOptNvfp4Converter
    _te_checkpoint(tmp_path / "te", "nvfp4")
    amax = {n[: -len(".weight")]: 7.25 for n in NAMES}  # W4A4: input scales convert too
    tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4", activation_amax=amax)
    tc.convert(tmp_path / "te", tmp_path / "ct", recipe="compressed_tensors_nvfp4", activation_amax=amax)
    hfq = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert hfq["quant_algo"] == "NVFP4" and hfq["group_size"] == 16 and "kv_cache_quant_algo" in hfq
    convert_checkpoint(str(tmp_path / "mo"), str(tmp_path / "mo2ct"),
                       ModelOptNvfp4Converter(ignore=hfq["exclude_modules"], targets=["Linear"]), device="cpu",
                       max_workers=1)
    theirs, ours = _read(tmp_path / "mo2ct"), _read(tmp_path / "ct")
    assert set(theirs) == set(ours)
    for k, v in ours.items():  # the converter keeps ModelOpt's 0-d scalars where llm-compressor writes [1]
        assert theirs[k].dtype == v.dtype and theirs[k].numel() == v.numel(), k
        if k.endswith("input_global_scale"):
            # the converter takes 1 / input_scale (two fp32 roundings); te-serial writes 2688 / amax
            # rounded once, which every fp32 value is of some amax: so a producer's input scale
            # survives import and re-export bit for bit (test_serving_contracts)
            assert int(_ulps(theirs[k].reshape(-1), v.reshape(-1)).max()) <= 1, k
            continue
        assert torch.equal(theirs[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def _tiny_llama(path, tied: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return transformers


def test_transformers_loads_tied_head_fp8_export_with_finite_logits(tmp_path):
    """A tied output head is absent from the weights; it must be in ``ignore``, or transformers
    gives it an FP8 scheme with an uninitialized scale (NaN logits)."""
    transformers = _tiny_llama(tmp_path / "hf")
    pytest.importorskip("compressed_tensors")
    rep = tc.convert(tmp_path / "hf", tmp_path / "ct", recipe="compressed_tensors_fp8")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"]
    assert (tmp_path / "ct" / "generation_config.json").exists()
    ids = torch.tensor([[1, 5, 9, 2]])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct")
    logits = model(ids).logits
    assert torch.isfinite(logits).all()
    # the dequantizing route equals te-serial's own model: its dequantized weights in a plain copy
    deq = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ct", quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    tc.convert(tmp_path / "ct", tmp_path / "bf16", recipe="bf16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    with torch.no_grad():
        a, b = deq(ids).logits, ref(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)
    assert rep.lossy  # from BF16: requantized, and said so


@pytest.mark.parametrize("shard", ["5GB", "100KB"])
def test_quantized_hf_storage_reader_reads_deepseek_export(shard, tmp_path):
    from torch.distributed.checkpoint import QuantizedHuggingFaceStorageReader, load
    ref = deepseek_checkpoint(tmp_path / "ds")
    tc.convert(tmp_path / "ds", tmp_path / "out", recipe="deepseek_fp8", max_shard_size=shard)
    shards = list((tmp_path / "out").glob("*.safetensors"))
    assert (len(shards) == 1) == (shard == "5GB") and (tmp_path / "out" / "model.safetensors.index.json").exists()
    sd = {n: torch.empty(v.shape) for n, v in ref.items()}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(sd, storage_reader=QuantizedHuggingFaceStorageReader(str(tmp_path / "out"), target_dtype=torch.float32),
             no_dist=True)
    for n, v in ref.items():
        assert torch.equal(sd[n], v), n


# --- activation schemes --------------------------------------------------------------------------

def test_activation_choice_is_printed_recorded_and_weight_only_without_amax(tmp_path):
    _te_checkpoint(tmp_path / "te", "fp8_current")
    rep = tc.convert(tmp_path / "te", tmp_path / "wo", recipe="compressed_tensors_fp8")
    assert any("W8A16" in n and "no activation amax" in n for n in rep.notes) and "W8A16" in rep.table()
    assert json.loads((tmp_path / "wo" / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"]["input_activations"] is None
    with pytest.raises(ConversionError, match="static activation scales"):
        tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_fp8")
    with pytest.raises(ConversionError, match="every quantized layer"):
        tc.convert(tmp_path / "te", tmp_path / "st", recipe="compressed_tensors_fp8", activations="static")
    with pytest.raises(ConversionError, match="no weight_only"):
        tc.convert(tmp_path / "te", tmp_path / "mx", recipe="modelopt_mxfp8", activations="weight_only")
    amax = tmp_path / "amax.json"
    amax.write_text(json.dumps({n[: -len(".weight")]: 2.5 for n in NAMES}))
    rep = tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_fp8", activation_amax=amax)
    assert any("FP8 (static" in n for n in rep.notes)
    raw = _read(tmp_path / "mo")
    for n in NAMES:
        s = raw[n[: -len("weight")] + "input_scale"]
        assert s.shape == () and torch.equal(s, torch.tensor(2.5) / 448)
    cfg = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "FP8"


def test_delayed_scaling_amax_history_gives_static_scales(tmp_path):
    """TE's delayed-scaling state (amax history of each GEMM's input) is a calibration: W8A8 / W4A4."""
    te_shim = pytest.importorskip("te_shim")
    if te_shim.install() is None:
        pytest.skip("transformer-engine wheel not installed")
    import transformer_engine.common.recipe as recipe
    hist = torch.zeros(8, 3)
    hist[:, 0] = torch.tensor([1.0, 3.5, 2.0, 0.5, 0, 0, 0, 0])
    state = {"recipe": recipe.DelayedScaling(amax_history_len=8), "scale_fwd": torch.ones(3),
             "amax_history_fwd": hist, "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(8, 2),
             "extra_fp8_variables": {"num_gemms": 1}}
    payload = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    extra = {n[: -len("weight")] + "_extra_state": payload for n in NAMES}
    _te_checkpoint(tmp_path / "te", "nvfp4", extra=extra)
    rep = tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4")
    assert any("NVFP4 (static" in n for n in rep.notes)
    assert {t.name for t in rep.dropped} >= {n[: -len("weight")] + "_extra_state.amax_history_fwd" for n in NAMES}
    raw = _read(tmp_path / "mo")
    assert not any("_extra_state" in k for k in raw)
    for n in NAMES:
        assert torch.equal(raw[n[: -len("weight")] + "input_scale"], torch.tensor(3.5) / 2688)  # max over history
    assert json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"


def test_calibration_pass_records_activation_amax(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with tc.ActivationAmax(model) as cal:
        model(torch.full((2, 8), -3.0))
        model(torch.ones(2, 8))
    assert cal.amax["0"] == 3.0 and set(cal.amax) == {"0", "2"}
    cal.save(tmp_path / "a.json")
    assert json.loads((tmp_path / "a.json").read_text())["0"] == 3.0


# --- importers --------------------------------------------------------------------------------------

def test_modelopt_and_ct_importers_detected_and_exact(tmp_path):
    for recipe, layout in (("mxfp8", "modelopt_mxfp8"), ("mxfp8", "compressed_tensors_mxfp8"),
                           ("fp8_current", "modelopt_fp8"), ("fp8_block", "modelopt_fp8_pb_wo"),
                           ("nvfp4", "modelopt_nvfp4"), ("nvfp4", "compressed_tensors_nvfp4")):
        src = _te_checkpoint(tmp_path / f"{recipe}-{layout}", recipe)
        out = tmp_path / f"out-{recipe}-{layout}"
        tc.convert(tmp_path / f"{recipe}-{layout}", out, recipe=layout,
                   activation_amax={n[: -len(".weight")]: 1.0 for n in NAMES})
        assert tc.detect_layout(out) == layout
        acts = {k for k in _read(out) if k.endswith(("input_scale", "input_global_scale"))}
        assert bool(acts) == (layout in ("modelopt_fp8", "modelopt_nvfp4", "compressed_tensors_nvfp4")), layout
        with tc.open_source(out) as s:
            assert set(s.dropped) == acts  # static activation scales: not weights, kept as activation amax
            for name in NAMES:
                t = s.load(name)
                want = tc.values(src[name], "rowwise")
                assert torch.equal(tc.values(t).view(torch.int32), want.view(torch.int32)), (layout, name)
            # the exact amax rides in te-serial's sidecar even where the layout has no static scales
            assert s.activation_amax == {n[: -len(".weight")]: 1.0 for n in NAMES}


def test_modelopt_refuses_what_it_does_not_read(tmp_path):
    (tmp_path / "m").mkdir()
    save_file({"x.weight": torch.zeros(16, 8, dtype=torch.uint8)}, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(UnknownLayoutError, match="W4A8_AWQ"):
        tc.detect_layout(tmp_path / "m")


# --- item 3: what the layouts' global-scale formula can state, measured per variant ---------------

@pytest.mark.parametrize("e4m3_max", [448.0, 256.0])
def test_global_scale_formula_measured_per_variant(e4m3_max):
    """For NVFP4 variants whose global scale TE forms as amax / (6 · e4m3_max) (448; 256 in
    4over6), how far each layout's formula lands from TE's ``(s · amax) · fl(1 / D)``, over every
    (block scale, code) and many amaxes: the 448 variant, and 4over6's 256 (exported as amax / 1536,
    as ModelOpt writes it); row-scaled NVFP4 has no global scale and is refused."""
    d = torch.tensor(6.0 * e4m3_max)
    inv = torch.tensor(1.0) / d
    g = torch.Generator().manual_seed(0)
    amaxes = torch.exp(torch.randn(2000, generator=g) * 3)
    s = torch.arange(1, 127, dtype=torch.uint8).view(E4M3).float()[:, None]     # finite positive scales
    codes = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[None, :]
    worst = {"modelopt": 0, "compressed_tensors": 0}
    for a in amaxes:
        te = codes * ((s * a) * inv)
        ws2 = a / d
        worst["modelopt"] = max(worst["modelopt"], int(_ulps(te, codes * (s * ws2)).max()))
        worst["compressed_tensors"] = max(worst["compressed_tensors"], int(_ulps(te, codes * (s / (1 / ws2))).max()))
    print(f"e4m3_max={e4m3_max}: worst fp32 ulp over 2000 amaxes x every (scale, code): {worst}")
    assert worst == {448.0: {"modelopt": 2, "compressed_tensors": 4},
                     256.0: {"modelopt": 2, "compressed_tensors": 3}}[e4m3_max], worst


def test_layout_to_layout_and_overwrite_leave_no_stale_config(tmp_path):
    """ModelOpt → compressed-tensors (the exact path between two serving layouts), and an overwrite
    of a ModelOpt export by a compressed-tensors one: no hf_quant_config.json is carried along."""
    _te_checkpoint(tmp_path / "te", "nvfp4")
    tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4")
    rep = tc.convert(tmp_path / "mo", tmp_path / "ct", recipe="compressed_tensors_nvfp4")
    assert all(rep[n].label in ("lossless", "exact codes") and rep[n].method == "copy" for n in NAMES)
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()
    assert tc.detect_layout(tmp_path / "ct") == "compressed_tensors_nvfp4"
    tc.convert(tmp_path / "te", tmp_path / "mo", recipe="compressed_tensors_nvfp4", overwrite=True)
    assert not (tmp_path / "mo" / "hf_quant_config.json").exists()
    assert tc.detect_layout(tmp_path / "mo") == "compressed_tensors_nvfp4"


def test_a_corrupt_source_fails_the_streamed_export_before_its_commit(tmp_path):
    """A byte relayout writes straight from the source's pages and checks their checksums once
    written: a flipped code byte fails the export, and the previous export stays as it was."""
    _te_checkpoint(tmp_path / "te", "nvfp4", columnwise=False)
    tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4")
    before = {p.name: p.read_bytes() for p in (tmp_path / "mo").iterdir()}
    ckpt = ts.Checkpoint(tmp_path / "te")
    _, file, key, *_ = ckpt.manifest.locations(NAMES[1])[0]  # the second weight's rowwise codes
    ckpt.close()
    shard = tmp_path / "te" / file
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8:header])[key]["data_offsets"]
    data[header + start + 5] ^= 0x22
    shard.write_bytes(bytes(data))
    with pytest.raises(ts.errors.ChecksumError, match="does not match its checksum") as e:
        tc.convert(tmp_path / "te", tmp_path / "mo", recipe="modelopt_nvfp4", overwrite=True)
    assert e.value.tensor == NAMES[1]
    assert {p.name: p.read_bytes() for p in (tmp_path / "mo").iterdir()} == before


# --- several weight schemes in one export ---------------------------------------------------------

@pytest.mark.parametrize("family", ["modelopt", "compressed_tensors"])
def test_a_mixed_export_writes_each_weight_in_its_own_scheme(tmp_path, family):
    """NVFP4 and MXFP8 weights in one export, the rules naming a layout per weight: ModelOpt's
    MIXED_PRECISION with each layer's quant_algo, or one compressed-tensors config group per scheme
    targeting its modules. Each weight keeps its bytes, and comes back as it was."""
    q4, q8 = recipe_quantizer("nvfp4", columnwise=False), recipe_quantizer("mxfp8", columnwise=False)
    sd = {NAMES[0]: q4(randn((256, 512), 1, scale=0.7)), NAMES[1]: q8(randn((512, 256), 2, scale=3.0)),
          "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
    ts.save_quantized(sd, tmp_path / "te")
    rep = tc.convert(tmp_path / "te", tmp_path / "out",
                     rules={NAMES[0]: f"{family}_nvfp4", NAMES[1]: f"{family}_mxfp8"})
    assert rep.target_layout == f"{family}_mixed"
    assert rep[NAMES[0]].label in ("lossless", "exact codes") and rep[NAMES[1]].label == "lossless"
    assert rep[NAMES[0]].target.endswith("nvfp4") and rep[NAMES[1]].target.endswith("mxfp8")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    m0, m1 = (n[: -len(".weight")] for n in NAMES)
    raw = _read(tmp_path / "out")
    if family == "modelopt":
        assert qc["quant_algo"] == "MIXED_PRECISION" and qc["quant_method"] == "modelopt"
        assert qc["quantized_layers"] == {m0: {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                                          m1: {"quant_algo": "MXFP8", "group_size": 32}}
        hfq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
        assert hfq["quantized_layers"] == qc["quantized_layers"] and "model.norm" not in hfq["quantized_layers"]
        assert raw[NAMES[0]].dtype == torch.uint8 and raw[m0 + ".weight_scale_2"].shape == ()
        assert raw[NAMES[1]].dtype == E4M3 and raw[m1 + ".weight_scale"].dtype == torch.uint8
    else:
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
        assert qc["format"] == "mixed-precision"
        assert {(tuple(g["targets"]), g["format"]) for g in qc["config_groups"].values()} == {
            ((m0,), "nvfp4-pack-quantized"), ((m1,), "mxfp8-quantized")}
        got = CompressedTensorsDequantizer(str(tmp_path / "out"), dtype=torch.float32).process(raw)
        assert torch.equal(got[NAMES[1]].to(torch.bfloat16), sd[NAMES[1]].dequantize(torch.bfloat16))
        d = _ulps(got[NAMES[0]], sd[NAMES[0]].dequantize(torch.bfloat16).float())
        assert int((d > 0).sum()) <= rep[NAMES[0]].ulp_elements
    tc.convert(tmp_path / "out", tmp_path / "back")  # each weight back in its own TE format
    back = ts.load_quantized(tmp_path / "back")
    for n in NAMES:
        assert back[n].quantizer.layout_key() == sd[n].quantizer.layout_key(), n
        for k, v in sd[n].buffers().items():
            assert torch.equal(back[n].buffers()[k].view(torch.uint8), v.view(torch.uint8)), (n, k)



def test_a_mixed_modelopt_config_with_an_unread_layer_algo_is_refused_naming_it(tmp_path):
    q4, q8 = recipe_quantizer("nvfp4", columnwise=False), recipe_quantizer("mxfp8", columnwise=False)
    ts.save_quantized({NAMES[0]: q4(randn((256, 512), 1)), NAMES[1]: q8(randn((512, 256), 2))}, tmp_path / "te")
    tc.convert(tmp_path / "te", tmp_path / "mo", rules={NAMES[0]: "modelopt_nvfp4", NAMES[1]: "modelopt_mxfp8"})
    for name in ("hf_quant_config.json", "config.json"):
        doc = json.loads((tmp_path / "mo" / name).read_text())
        body = doc["quantization"] if name == "hf_quant_config.json" else doc["quantization_config"]
        body["quantized_layers"][NAMES[1][: -len(".weight")]]["quant_algo"] = "W4A8_AWQ"
        (tmp_path / "mo" / name).write_text(json.dumps(doc))
    with pytest.raises(UnknownLayoutError, match="W4A8_AWQ") as e:
        tc.convert(tmp_path / "mo", tmp_path / "back")
    assert "mlp.up_proj" in str(e.value)
