"""Hugging Face models: built on meta, quantized, loaded from any checkpoint te-serial reads.

Real transformers classes (Llama, Qwen2) from small configs with random weights — no hub access.
The reference for every comparison is the same class in BF16 holding the loaded model's
dequantized weights: logits and ``generate`` must equal it bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import te_serial as ts
from helpers import seeded_hf_model
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.conversion import ConversionReport

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from accelerate import init_empty_weights  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

transformers.logging.set_verbosity_error()

RECIPES = ["fp8_delayed", "fp8_current", "mxfp8", "mxfp8_2d", "fp8_block_1d", "fp8_block", "nvfp4", "nvfp4_2d"]
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _config(arch="llama", tied=True, **kw):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(**{**SMALL, **kw}, tie_word_embeddings=tied)


def _hf_dir(root: Path, cfg, seed=0, **save_kw) -> Path:
    model = seeded_hf_model(cfg, seed)
    model.save_pretrained(root, **save_kw)
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama_tied": _hf_dir(root / "llama_tied", _config("llama", True)),
        "llama_untied": _hf_dir(root / "llama_untied", _config("llama", False), max_shard_size="60KB"),
        "qwen2_untied": _hf_dir(root / "qwen2_untied", _config("qwen2", False)),
        "qwen2_tied": _hf_dir(root / "qwen2_tied", _config("qwen2", True)),
    }


def _meta_model(cfg, how="meta"):
    if how == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _reference(model, cfg, cast=None):
    """The same class, on CPU, holding the loaded model's dequantized weights (in its dtypes), after
    the same ``cast`` (which also casts the rotary buffers)."""
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if cast is not None:
        cast(ref)
    sd = {k: v.dequantize() if isinstance(v, tsf.QuantizedTensor) else v for k, v in model.state_dict().items()}
    ref.load_state_dict(sd, strict=True)
    for k, v in model.state_dict().items():
        assert ref.state_dict()[k].dtype == v.dtype, k
    with torch.no_grad():  # the model's own rotary buffers too (a cast chain through fp16 rounds them)
        for k, v in model.named_buffers():
            assert ref.get_buffer(k).dtype == v.dtype, k
            ref.get_buffer(k).copy_(v)
    return ref.eval()


def _ids(seed=0, n=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (2, n), generator=g)


def _assert_same_outputs(model, ref, generate=True):
    ids = _ids()
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert a.dtype == b.dtype and torch.equal(a, b)
    if generate:
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids[:, :5]))
        assert torch.equal(model.generate(ids[:, :5], **kw), ref.generate(ids[:, :5], **kw))


def _no_meta(model):
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    assert not left, left


def _quantized_names(model):
    return sorted(n for n, p in model.named_parameters() if isinstance(p, tsf.QuantizedTensor))


# --- the path end to end ---------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_from_a_bf16_directory_equals_the_dequantized_bf16_model(dirs, recipe):
    cfg = _config("llama", True)
    model = _meta_model(cfg)
    ts.quantize_model(model, recipe, columnwise=False)
    out = ts.load_into(model, dirs["llama_tied"])
    assert out is model
    _no_meta(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied head stays tied
    names = _quantized_names(model)
    assert len(names) == 2 * 7 and all(n.startswith("model.layers.") for n in names)
    rep = model.te_serial_report
    assert rep.source_layout == "safetensors" and not rep.dropped
    for n in names:
        assert rep[n].method == "quantize" and rep[n].label == "lossy" and rep[n].snr_db > 10, rep[n]
    assert rep["model.embed_tokens.weight"].label == "lossless" and rep["lm_head.weight"].method == "tied"
    _assert_same_outputs(model, _reference(model, cfg))


@pytest.mark.parametrize("arch,tied,how", [("llama", False, "accelerate"), ("qwen2", False, "meta"),
                                           ("qwen2", True, "accelerate"), ("llama", True, "accelerate")])
def test_architectures_heads_and_meta_construction(dirs, arch, tied, how):
    cfg = _config(arch, tied)
    model = _meta_model(cfg, how)
    ts.quantize_model(model, "mxfp8", columnwise=False)
    ts.load_into(model, dirs[f"{arch}_{'tied' if tied else 'untied'}"])  # the untied Llama is sharded
    _no_meta(model)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert not isinstance(model.lm_head.weight, tsf.QuantizedTensor)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.device.type == "cpu"
    cpu_built = AutoModelForCausalLM.from_config(cfg)  # rotary buffers as the constructor computes them
    for n, b in cpu_built.named_buffers():
        assert torch.equal(model.get_buffer(n), b), n
    _assert_same_outputs(model, _reference(model, cfg))


def test_dims_not_multiple_of_32_stay_high_precision_with_a_note(tmp_path):
    cfg = _config("llama", True, intermediate_size=72)
    src = _hf_dir(tmp_path / "odd", cfg)
    model = _meta_model(cfg)
    with pytest.warns(UserWarning, match=r"mlp.up_proj.weight left unquantized: .*divisible by 32"):
        ts.quantize_model(model, "mxfp8", columnwise=False)
    ts.load_into(model, src)
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
    assert kinds["model.layers.0.mlp.gate_proj.weight"] == kinds["model.layers.1.mlp.down_proj.weight"] == "Parameter"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "MXFP8Tensor"
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    _assert_same_outputs(model, _reference(model, cfg), generate=False)
    model = _meta_model(cfg)  # 128x128 blocks take edge blocks: everything quantized
    ts.quantize_model(model, "fp8_block", columnwise=False)
    ts.load_into(model, src)
    assert isinstance(model.model.layers[0].mlp.down_proj.weight, tsf.QuantizedTensor)
    _assert_same_outputs(model, _reference(model, cfg), generate=False)


def test_report_is_the_one_convert_gives(dirs, tmp_path):
    model = _meta_model(_config("llama", False))
    ts.quantize_model(model, "nvfp4", columnwise=False)
    res = ts.load_into(model, dirs["llama_untied"], strict=False, report=tmp_path / "load.json")
    assert res.missing_keys == [] and res.unexpected_keys == [] and res.report is model.te_serial_report
    assert ConversionReport.load(tmp_path / "load.json").to_dict()["tensors"] == res.report.to_dict()["tensors"]
    conv = ts.convert(dirs["llama_untied"], tmp_path / "conv", recipe="nvfp4", usages="rowwise")
    assert [t.name for t in conv.tensors] == [t.name for t in res.report.tensors]
    for t in conv.tensors:
        mine = res.report[t.name]
        assert (mine.method, mine.label, mine.target, mine.source, mine.dst_bytes) == \
               (t.method, t.label, t.target, t.source, t.dst_bytes), t.name
        assert mine.max_abs_err == t.max_abs_err and mine.rel_rmse == t.rel_rmse, t.name
    loaded = ts.load_quantized(tmp_path / "conv")  # the bytes are convert's too
    for n in _quantized_names(model):
        for b, x in model.get_parameter(n).buffers().items():
            assert torch.equal(x.view(torch.uint8), getattr(loaded[n], b).view(torch.uint8)), (n, b)


# --- loading from the other layouts -----------------------------------------------------------------

def test_deepseek_and_compressed_tensors_sources(dirs, tmp_path):
    cfg = _config("llama", True)
    ts.convert(dirs["llama_tied"], tmp_path / "ds", recipe="deepseek_fp8")
    ts.convert(dirs["llama_tied"], tmp_path / "ct", recipe="compressed_tensors_fp8_tensor")
    # DeepSeek block FP8 into 128x128 blockwise prototypes: the exact bytes, no requantization
    model = _meta_model(cfg)
    ts.quantize_model(model, "fp8_block", columnwise=False)
    ts.load_into(model, tmp_path / "ds")
    rep = model.te_serial_report
    assert rep.source_layout == "deepseek_fp8" and rep.lossless
    _assert_same_outputs(model, _reference(model, cfg), generate=False)
    # compressed-tensors per-tensor FP8 into current-scaling FP8 (exact), and into MXFP8 (requantized)
    model = _meta_model(cfg)
    ts.quantize_model(model, "fp8_current", columnwise=False)
    ts.load_into(model, tmp_path / "ct")
    assert model.te_serial_report.source_layout == "compressed_tensors_fp8" and model.te_serial_report.lossless
    model = _meta_model(cfg)
    ts.quantize_model(model, "mxfp8", columnwise=False)
    ts.load_into(model, tmp_path / "ct")
    w = model.te_serial_report["model.layers.0.mlp.up_proj.weight"]
    assert w.method == "requantize" and w.label == "lossy"
    _assert_same_outputs(model, _reference(model, cfg), generate=False)


@pytest.mark.parametrize("layout,recipe", [("compressed_tensors_mxfp8", "mxfp8"), ("modelopt_nvfp4", "nvfp4")])
def test_serving_layouts_load_into_their_recipe_as_they_are(dirs, tmp_path, layout, recipe):
    cfg = _config("llama", True)
    ts.convert(dirs["llama_tied"], tmp_path / layout, recipe=layout)
    model = _meta_model(cfg)
    ts.quantize_model(model, recipe, columnwise=False)
    ts.load_into(model, tmp_path / layout)
    rep = model.te_serial_report
    assert rep.source_layout == layout and not rep.lossy
    assert rep["model.layers.1.mlp.down_proj.weight"].method == "keep"
    _assert_same_outputs(model, _reference(model, cfg), generate=False)


def test_te_serial_checkpoint_in_another_recipe_is_converted_and_same_recipe_read_in_place(dirs, tmp_path):
    cfg = _config("llama", True)
    model = _meta_model(cfg)
    ts.quantize_model(model, "fp8_block", columnwise=False)
    ts.load_into(model, dirs["llama_tied"])
    ts.save_quantized(model, tmp_path / "ck")
    same = _meta_model(cfg)
    ts.quantize_model(same, "fp8_block", columnwise=False)
    ts.load_into(same, tmp_path / "ck")
    assert {t.method for t in same.te_serial_report.tensors} == {"keep", "tied"}
    for n in _quantized_names(model):
        for b, x in model.get_parameter(n).buffers().items():
            assert torch.equal(x.view(torch.uint8), getattr(same.get_parameter(n), b).view(torch.uint8))
    other = _meta_model(cfg)
    ts.quantize_model(other, "fp8_block_1d", columnwise=False)  # 128x128 -> 1x128: exact relayout
    ts.load_into(other, tmp_path / "ck")
    assert other.te_serial_report["model.layers.0.mlp.up_proj.weight"].method == "relayout"
    assert other.te_serial_report.lossless
    _assert_same_outputs(other, _reference(other, cfg), generate=False)


def test_usage_mismatch_is_reported_and_derived_where_exact(dirs, tmp_path):
    cfg = _config("llama", True)
    for recipe in ("fp8_block", "mxfp8"):
        model = _meta_model(cfg)
        ts.quantize_model(model, recipe, columnwise=False)
        ts.load_into(model, dirs["llama_tied"])
        ts.save_quantized(model, tmp_path / recipe)  # rowwise only
    model = _meta_model(cfg)
    ts.quantize_model(model, "fp8_block", columnwise=True)
    with pytest.raises(ts.CheckpointError, match=r"usage mismatch.*holds rowwise.*also columnwise.*derive_usages=True"):
        ts.load_into(model, tmp_path / "fp8_block")
    with pytest.warns(UserWarning, match="usage mismatch"):
        ts.load_into(model, tmp_path / "fp8_block", strict=False)
    assert not model.model.layers[0].mlp.up_proj.weight.quantizer.columnwise  # taken as saved
    model = _meta_model(cfg)
    ts.quantize_model(model, "fp8_block", columnwise=True)
    ts.load_into(model, tmp_path / "fp8_block", derive_usages=True)  # 128x128 tiles: columnwise is exact
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.quantizer.rowwise and w.quantizer.columnwise and model.te_serial_report.lossless
    from te_serial.conversion.transforms import usage_view
    assert torch.equal(usage_view(w, "columnwise").dequantize(), usage_view(w, "rowwise").dequantize())
    model = _meta_model(cfg)
    ts.quantize_model(model, "mxfp8", columnwise=True)
    with pytest.raises(ts.CheckpointError, match="cannot be derived exactly"):
        ts.load_into(model, tmp_path / "mxfp8", derive_usages=True)


# --- what the model keeps: requires_grad, dtype casts, nothing on meta ------------------------------

def test_requires_grad_follows_the_prototype_and_the_model(dirs, tmp_path):
    cfg = _config("llama", False)
    model = _meta_model(cfg)
    model.model.norm.weight.requires_grad_(False)
    ts.quantize_model(model, "mxfp8", columnwise=True)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    ts.load_into(model, dirs["llama_untied"])
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    assert grads["model.embed_tokens.weight"] and grads["lm_head.weight"] and grads["model.layers.0.input_layernorm.weight"]
    assert not grads["model.norm.weight"] and not grads["model.layers.1.mlp.up_proj.weight"]
    assert grads["model.layers.0.mlp.up_proj.weight"]
    ts.save_quantized(model.state_dict(), tmp_path / "sd")  # a state dict saves requires_grad=False throughout
    again = _meta_model(cfg)
    ts.quantize_model(again, "mxfp8", columnwise=True)
    ts.load_into(again, tmp_path / "sd")
    assert all(p.requires_grad for p in again.parameters())


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_current"])
def test_dtype_casts_keep_the_bytes(dirs, recipe):
    cfg = _config("llama", True)
    model = _meta_model(cfg)
    ts.quantize_model(model, recipe, columnwise=False)
    ts.load_into(model, dirs["llama_tied"])
    w = model.model.layers[0].self_attn.q_proj.weight
    before = {n: b.clone() for n, b in w.buffers().items()}
    for cast, dtype in ((lambda m: m.float(), torch.float32), (lambda m: m.half(), torch.float16),
                        (lambda m: m.to(torch.float32), torch.float32), (lambda m: m.bfloat16(), torch.bfloat16)):
        cast(model)
        w = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(w, tsf.QuantizedTensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
        assert w.dtype == dtype and w.dequantize().dtype == dtype and model.dtype == dtype
        assert all(torch.equal(b.view(torch.uint8), before[n].view(torch.uint8)) for n, b in w.buffers().items())
        assert model.lm_head.weight is model.model.embed_tokens.weight
        _assert_same_outputs(model, _reference(model, cfg, cast), generate=False)


def test_what_is_left_on_meta_is_initialized_or_named():
    class Scaled(torch.nn.Module):  # no reset_parameters, not a Hugging Face model
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.register_buffer("scale", torch.full((64,), 2.0), persistent=False)

        def forward(self, x):
            return self.lin(x) * self.scale

    src = Scaled()
    with torch.device("meta"):
        model = Scaled()
    sd = {"lin.weight": src.lin.weight.detach(), "lin.bias": src.lin.bias.detach()}
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ts.save_quantized(sd, Path(d) / "ck")
        with pytest.raises(ts.CheckpointError, match=r"scale \(Scaled non-persistent buffer; tried: no initializer.*init_fn"):
            ts.load_into(model, Path(d) / "ck")
        assert model.scale.device.type == "meta"
        ts.load_into(model, Path(d) / "ck", init_fn=lambda m: m.scale.fill_(2.0) if isinstance(m, Scaled) else None)
    x = torch.randn(3, 64)
    assert torch.equal(model(x), src(x))
    # materialize follows the same rule: initialized values, never uninitialized memory
    cfg = _config("llama", True)
    model = _meta_model(cfg)
    ts.quantize_model(model, "nvfp4", columnwise=True)
    ts.materialize(model, "cpu")
    _no_meta(model)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, tsf.NVFP4Tensor) and torch.isfinite(w.dequantize()).all() and w.dequantize().std() > 0
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))  # _init_weights: ones
    assert torch.equal(model.model.rotary_emb.inv_freq, AutoModelForCausalLM.from_config(cfg).model.rotary_emb.inv_freq)


# --- back to Hugging Face ---------------------------------------------------------------------------

def test_back_to_hugging_face(dirs, tmp_path):
    cfg = _config("qwen2", True)
    model = _meta_model(cfg)
    ts.quantize_model(model, "mxfp8", columnwise=False)
    ts.load_into(model, dirs["qwen2_tied"])
    with pytest.raises(tse.UnsupportedOperationError, match="pickle"):
        model.save_pretrained(tmp_path / "nope", safe_serialization=False)
    manifest = ts.save_quantized(model, tmp_path / "ck")
    saved = json.loads(manifest.metadata["hf_config"])  # plain JSON text in the manifest's metadata
    assert saved["model_type"] == "qwen2" and saved["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((tmp_path / "ck" / "config.json").read_text()) == saved
    single = ts.save_quantized(model, tmp_path / "one.safetensors")
    assert json.loads(single.metadata["hf_config"]) == saved
    ts.convert(tmp_path / "ck", tmp_path / "bf16", recipe="bf16")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    _assert_same_outputs(model, back.eval(), generate=False)
    ts.convert(tmp_path / "ck", tmp_path / "ct", recipe="compressed_tensors_fp8")  # a serving layout
    ct_config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert ct_config["model_type"] == "qwen2" and ct_config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert isinstance(ts.load_into(_meta_model(cfg), tmp_path / "ct"), torch.nn.Module)  # and it loads back


# --- peak memory of quantize on load, in a child process -------------------------------------------

_CHILD = r"""
import json, sys, warnings
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
import torch, transformers
import te_serial as ts
from te_serial import formats as tsf
from transformers import AutoConfig, AutoModelForCausalLM
transformers.logging.set_verbosity_error()
def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) * 1024
def meta_model(path):
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return ts.quantize_model(model, "mxfp8", columnwise=False)
# warm-up on a tiny model of the same kind: the kernels' code pages and thread pools, counted once
ts.load_into(meta_model(sys.argv[2]), sys.argv[2])
cfg = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
ts.quantize_model(model, "mxfp8", columnwise=False)
qbytes = ts.plan(model).total_bytes
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
ts.load_into(model, sys.argv[1])
for p in model.parameters():  # every byte resident
    for b in (p.buffers().values() if isinstance(p, tsf.QuantizedTensor) else [p]):
        b.view(-1).max()
print(json.dumps({"base": base, "peak": status("VmHWM"), "qbytes": qbytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_rss_of_quantize_on_load_in_a_child(tmp_path):
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
                      max_position_embeddings=64)
    src = _hf_dir(tmp_path / "hf", cfg, max_shard_size="20MB")
    tiny = _hf_dir(tmp_path / "tiny", _config("llama", False))
    bf16 = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(tiny)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["base"]
    largest_fp32 = 1024 * 512 * 4
    # the quantized model plus one tensor's conversion (its source, its fp32 check), never the BF16 model
    assert grew <= r["qbytes"] * 1.1 + 4 * largest_fp32 + (8 << 20), (grew, r)
    assert grew - r["qbytes"] < 0.5 * bf16, (grew, bf16)  # far from also holding the BF16 weights
