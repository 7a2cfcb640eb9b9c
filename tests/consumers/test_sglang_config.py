"""te-serial's serving exports against SGLang's own quantization-config handling (CPU, no weights).

For each serving layout, a tiny Llama is exported with ``te_serial.conversion.convert`` and SGLang
(``sglang_harness``: SGLang's ``ModelConfig`` + model loader's ``_get_quantization_config`` +
each config's ``get_quant_method``) must detect the right method and give quantized methods to
exactly the quantized linears (fused ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``)
and unquantized ones to ``lm_head`` and ``model.embed_tokens`` (stored BF16).

The regression this guards: SGLang reads a flat ModelOpt ``config.json`` ``quantization_config``'s
exclusions from ``ignore`` only (``ModelOptFp8Config.from_config``: ``exclude_modules =
config.get("ignore")``); an export that wrote ``exclude_modules`` there had its BF16 ``lm_head``
loaded as FP8.

Layouts SGLang 0.5.23 cannot serve are pinned as such (``test_unsupported_by_sglang``): when
SGLang starts accepting them, that test fails and the layout moves to ``SUPPORTED``.
"""

from __future__ import annotations

import importlib.util
import os
import json
import shutil

import pytest

pytestmark = pytest.mark.consumers

# Not pytest.importorskip("sglang"): importing the package needs triton, which the harness stubs;
# an ImportError there would skip silently with SGLang installed.
if importlib.util.find_spec("sglang") is None and not os.environ.get("CI"):  # CI installs it: never skip there
    pytest.skip(
        "SGLang not installed: pip install --no-deps -c constraints.txt -r "
        "tests/consumers/requirements.txt",
        allow_module_level=True,
    )

import torch  # noqa: E402

from sglang_harness import (  # noqa: E402
    sglang_is_quantized,
    sglang_load_linear,
    sglang_layer_scheme,
    sglang_model_config,
    sglang_quant_config,
    sglang_quant_method,
)

LINEARS = (
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.0.mlp.down_proj",
)
HF_LINEARS = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
)

# layout -> (ModelConfig.quantization SGLang detects, quant config class, linear method class)
SUPPORTED = {
    "modelopt_fp8": ("modelopt_fp8", "ModelOptFp8Config", "ModelOptFp8LinearMethod"),
    "modelopt_nvfp4": ("modelopt_fp4", "ModelOptFp4Config", "ModelOptNvFp4A16LinearMethod"),
    "modelopt_mxfp8": ("mxfp8", "Fp8Config", "Fp8LinearMethod"),
    "sglang_mxfp8": ("mxfp8", "Fp8Config", "Fp8LinearMethod"),
    "compressed_tensors_fp8": ("compressed-tensors", "CompressedTensorsConfig", "CompressedTensorsLinearMethod"),
    "compressed_tensors_fp8_tensor": ("compressed-tensors", "CompressedTensorsConfig", "CompressedTensorsLinearMethod"),
    "compressed_tensors_fp8_block": ("compressed-tensors", "CompressedTensorsConfig", "CompressedTensorsLinearMethod"),
    "compressed_tensors_nvfp4": ("compressed-tensors", "CompressedTensorsConfig", "CompressedTensorsLinearMethod"),
}
# compressed-tensors: the scheme SGLang picks for the quantized linears (on an SM100 GPU)
CT_SCHEMES = {
    "compressed_tensors_fp8": "CompressedTensorsW8A16Fp8",  # weight-only, per channel
    "compressed_tensors_fp8_tensor": "CompressedTensorsW8A16Fp8",  # weight-only, per tensor
    "compressed_tensors_fp8_block": "CompressedTensorsW8A8Fp8",  # dynamic per-group activations
    "compressed_tensors_nvfp4": "CompressedTensorsW4A16Fp4",  # weight-only
}
# layout -> (exception type, text of SGLang's error)
UNSUPPORTED = {
    # top-level quant_algo other than FP8 / *FP4* / MXFP8 / MIXED_PRECISION → "modelopt" →
    # ModelOptFp8Config.from_config; FP8_PB_WO is only read per layer in MIXED_PRECISION
    "modelopt_fp8_pb_wo": (ValueError, "ModelOptFp8Config only supports regular FP8 quantization"),
    # "mxfp8-quantized" is no activation-quantization format of SGLang's compressed-tensors
    # and group-32 FP8 weights match no W8A16/W8A8 scheme
    "compressed_tensors_mxfp8": (NotImplementedError, "No compressed-tensors compatible scheme was found"),
}


def _tiny_llama(tmp_path, tie_word_embeddings=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie_word_embeddings,
        dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    return src


def _export(tmp_path, layout, tie_word_embeddings=False):
    from te_serial.conversion import convert

    src = _tiny_llama(tmp_path, tie_word_embeddings)
    kwargs = {}
    if layout == "modelopt_fp8":
        kwargs["activation_amax"] = {name: 4.0 for name in HF_LINEARS}
    dst = tmp_path / layout
    convert(src, dst, recipe=layout, **kwargs)
    return dst


def _assert_exactly_linears_quantized(qc, layout):
    for prefix in LINEARS:
        assert sglang_is_quantized(qc, prefix), f"{layout}: SGLang loads {prefix} unquantized"
    assert not sglang_is_quantized(qc, "lm_head"), (
        f"{layout}: SGLang loads lm_head (stored BF16) with "
        f"{type(sglang_quant_method(qc, 'lm_head')).__name__}"
    )
    assert not sglang_is_quantized(qc, "model.embed_tokens", is_linear=False), (
        f"{layout}: SGLang loads model.embed_tokens quantized"
    )


@pytest.mark.parametrize("layout", sorted(SUPPORTED))
def test_sglang_reads_export(tmp_path, layout):
    method, config_cls, linear_cls = SUPPORTED[layout]
    dst = _export(tmp_path, layout)
    mc = sglang_model_config(dst)
    assert mc.quantization == method
    qc = sglang_quant_config(dst, mc)
    assert type(qc).__name__ == config_cls
    _assert_exactly_linears_quantized(qc, layout)
    for prefix in LINEARS:
        assert type(sglang_quant_method(qc, prefix)).__name__ == linear_cls, prefix
    if layout in CT_SCHEMES:
        for prefix in LINEARS:
            assert type(sglang_layer_scheme(qc, prefix)).__name__ == CT_SCHEMES[layout], prefix
    if layout == "modelopt_fp8":
        # static activation scales: the per-tensor W8A8 path (kv cache unquantized)
        assert qc.is_checkpoint_fp8_serialized and qc.kv_cache_quant_algo is None
    if layout == "modelopt_nvfp4":
        assert qc.is_checkpoint_nvfp4_serialized and qc.is_w4a16 and qc.group_size == 16
    if layout in ("modelopt_mxfp8", "sglang_mxfp8"):
        assert qc.use_mxfp8 and qc.is_checkpoint_fp8_serialized
        assert qc.weight_block_size == [1, 32] and qc.activation_scheme == "dynamic"
        assert qc.scale_fmt == "ue8m0"  # SGLang sets it for ModelOpt MXFP8 too


@pytest.mark.parametrize("layout", sorted(UNSUPPORTED))
def test_unsupported_by_sglang(tmp_path, layout):
    exc, text = UNSUPPORTED[layout]
    dst = _export(tmp_path, layout)
    with pytest.raises(exc, match=text):
        qc = sglang_quant_config(dst)
        for prefix in LINEARS:
            sglang_is_quantized(qc, prefix)


@pytest.mark.parametrize("layout", ["modelopt_fp8", "modelopt_nvfp4", "compressed_tensors_fp8"])
def test_tied_embeddings(tmp_path, layout):
    """Tied head: no lm_head tensor; te-serial still lists lm_head as excluded."""
    dst = _export(tmp_path, layout, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())
    assert "lm_head" in json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
    qc = sglang_quant_config(dst)
    assert type(qc).__name__ == SUPPORTED[layout][1]
    _assert_exactly_linears_quantized(qc, layout)


# Whether SGLang quantizes lm_head when a flat config.json names the exclusions
# ``exclude_modules`` instead of ``ignore`` (the pre-fix te-serial form): FP8 reads ``ignore``
# only; FP4 falls back to modules_to_not_convert / exclude_modules; MXFP8 reads both.
PRE_FIX_FORM_QUANTIZES_LM_HEAD = {"modelopt_fp8": True, "modelopt_nvfp4": False, "modelopt_mxfp8": False}


@pytest.mark.parametrize("layout", sorted(PRE_FIX_FORM_QUANTIZES_LM_HEAD))
def test_modelopt_exclusions_both_forms(tmp_path, layout):
    """SGLang reads config.json's flat form when present, else hf_quant_config.json's nested one:
    both must exclude lm_head. And the harness sees the old bug: for FP8, ``exclude_modules`` in
    the flat form is not read, so lm_head would be quantized."""
    dst = _export(tmp_path, layout)
    cfg = json.loads((dst / "config.json").read_text())
    flat = cfg["quantization_config"]
    assert flat["quant_method"] == "modelopt" and "lm_head" in flat["ignore"]
    nested = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert "lm_head" in nested["exclude_modules"]

    # nested form only (config.json without quantization_config, as older ModelOpt exports)
    only_nested = tmp_path / "only_nested"
    shutil.copytree(dst, only_nested)
    del cfg["quantization_config"]
    (only_nested / "config.json").write_text(json.dumps(cfg))
    qc = sglang_quant_config(only_nested)
    assert sglang_model_config(only_nested).quantization == SUPPORTED[layout][0]
    _assert_exactly_linears_quantized(qc, layout + " (hf_quant_config.json only)")

    # the pre-fix flat form: exclusions under exclude_modules → SGLang quantizes lm_head
    buggy = tmp_path / "buggy"
    shutil.copytree(dst, buggy)
    cfg["quantization_config"] = {k: v for k, v in flat.items() if k != "ignore"}
    cfg["quantization_config"]["exclude_modules"] = flat["ignore"]
    (buggy / "config.json").write_text(json.dumps(cfg))
    assert sglang_is_quantized(sglang_quant_config(buggy), "lm_head") is PRE_FIX_FORM_QUANTIZES_LM_HEAD[layout]


def test_sglang_holds_mxfp8_values(tmp_path):
    """SGLang's native MXFP8 method (``Fp8Config(use_mxfp8)``) loads te-serial's ``sglang_mxfp8``
    export into its own parameters (``weight`` E4M3, ``weight_scale_inv`` uint8 E8M0) and, after its
    post-load processing, holds exactly the values of the te-serial MXFP8 checkpoint it came from
    (E4M3 value times 2^(e - 127) per 1x32 block, written here from the OCP MX definition)."""
    import te_serial as ts
    from safetensors.torch import load_file
    from te_serial.conversion import convert

    src = _tiny_llama(tmp_path)
    convert(src, tmp_path / "te", recipe="mxfp8")
    convert(tmp_path / "te", tmp_path / "sg", recipe="sglang_mxfp8")
    want = ts.load_quantized(tmp_path / "te")
    raw = load_file(tmp_path / "sg" / "model.safetensors")
    qc = sglang_quant_config(tmp_path / "sg")
    checked = 0
    for name in HF_LINEARS:
        w = name + ".weight"
        if tuple(raw[w].shape) != (256, 256):  # the harness builds 256x256 layers
            continue
        layer = sglang_load_linear(qc, name, {"weight": raw[w], "weight_scale_inv": raw[w + "_scale_inv"]})
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.uint8
        e = layer.weight_scale_inv.data.to(torch.int32) - 127
        held = layer.weight.data.float() * torch.exp2(e.float()).repeat_interleave(32, dim=1)
        assert torch.equal(held, want[w].dequantize().float()), name
        checked += 1
    assert checked == 2  # q_proj and o_proj are 256x256
