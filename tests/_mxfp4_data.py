"""MXFP4 checkpoints laid out as their producers write them (``../shared/docs/mxfp4.md``), and an
independent decoder written from that document: gpt-oss (``quant_method: "mxfp4"``),
compressed-tensors ``mxfp4-pack-quantized`` (through compressed-tensors' own
``MXFP4PackedCompressor``), ModelOpt ``mxfp4`` / ``W4A8_MXFP4_FP8`` and DeepSeek-V4 FP4 experts.

Codes and scales are adversarial: scale bytes 0 (2^-127) and 254 (2^127, with codes small enough
for fp32), all-zero blocks of ModelOpt's -0 codes (0x8) under byte 0, +0 blocks, mixed magnitudes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

#: E2M1 code -> value (mxfp4.md §0: sign in bit 3)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
U8 = torch.uint8


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[.., K] nibble codes -> [.., K/2] bytes, element 2j in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(U8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values LUT[code] * 2^(byte - 127) of packed codes [.., N, K/2] with E8M0 bytes [.., N, K/32]
    (computed in float64, each value exact there, then rounded once: exact wherever fp32 holds it)."""
    vals = torch.tensor(E2M1, dtype=torch.float64)[unpack(packed)]
    exp = torch.pow(2.0, scales.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return (vals * exp).to(torch.float32)


def codes_and_scales(n: int, k: int, seed: int, lo: int = 112, hi: int = 136, adversarial: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes [n, k/2] and E8M0 bytes [n, k/32]: random codes, scale bytes in [lo, hi), and (where the
    shape has room) byte 0 under a +0.5 block, byte 254 under codes of magnitude <= 1.5, an all -0 block
    (ModelOpt's zeros) under byte 0, an all +0 block, byte 1; ``adversarial=False``: the random ones only."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
    scales = torch.randint(lo, hi, (n, k // 32), generator=g, dtype=torch.int64)
    if n >= 4 and adversarial:
        scales[0, 0] = 0
        codes[0, :32] = torch.tensor([1, 9] * 16)
        scales[1, -1] = 254
        codes[1, -32:] = torch.randint(0, 4, (32,), generator=g) | (torch.randint(0, 2, (32,), generator=g) << 3)
        codes[2, :32], scales[2, 0] = 8, 0
        codes[3, :32] = 0
        scales[3, -1] = 1
    return pack(codes), scales.to(U8)


def _write(root: Path, tensors: dict[str, torch.Tensor], config: dict, extra: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=1))
    for name, doc in (extra or {}).items():
        (root / name).write_text(json.dumps(doc, indent=1))
    return root


# --- gpt-oss ----------------------------------------------------------------------------------------

def gpt_oss_config(hidden: int = 64, inter: int = 64, experts: int = 4, layers: int = 2) -> dict:
    """A tiny GptOss config.json (transformers 5.25's GptOssConfig fields) with gpt-oss's quantization_config."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": experts, "num_experts_per_tok": 2,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1),
            "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def gpt_oss_checkpoint(root: Path, *, seed: int = 0, lo: int = 112, hi: int = 136, adversarial: bool = True,
                       config: dict | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A gpt-oss MXFP4 directory: the BF16 tensors of a tiny GptOss model with random weights, its experts
    as ``_blocks`` / ``_scales`` of adversarial codes (``adversarial=False``, ``lo`` / ``hi``: values a forward
    pass keeps finite), BF16 biases. Returns (root, the tensors written)."""
    import transformers
    cfg = config or gpt_oss_config()
    conf = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(conf).to(torch.bfloat16)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = t.shape                      # transformers' [E, in, out]
            packed, scales = codes_and_scales(e * n, k, seed + len(tensors), lo, hi, adversarial)
            tensors[name + "_blocks"] = packed.reshape(e, n, k // 32, 16)
            tensors[name + "_scales"] = scales.reshape(e, n, k // 32)
        else:
            tensors[name] = t.detach().clone()
    return _write(root, tensors, cfg), tensors


# --- compressed-tensors mxfp4-pack-quantized ----------------------------------------------------------

def _ct_config(ignore: list[str]) -> dict:
    w = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group", "dynamic": False,
         "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
         "zp_dtype": "torch.uint8"}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                          "output_activations": None, "format": "mxfp4-pack-quantized"}},
            "format": "mxfp4-pack-quantized", "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def ct_compress(values: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight_packed`` / ``weight_scale`` of one Linear from compressed-tensors' own MXFP4 compressor, given
    values that are codes times their block's power-of-two scale (so it picks those codes)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    scale = torch.pow(2.0, scales.to(torch.float32) - 127)
    out = MXFP4PackedCompressor.compress({"weight": values, "weight_scale": scale}, scheme)
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"]}


#: (module, out, in) of the compressed-tensors fixture: a dense MLP and a two-expert Qwen3-MoE layer
CT_LINEARS = [("model.layers.0.mlp.gate_proj", 64, 128), ("model.layers.0.mlp.up_proj", 64, 128),
              ("model.layers.0.mlp.down_proj", 128, 64)] + [
    (f"model.layers.1.mlp.experts.{e}.{p}", n, k) for e in range(2)
    for p, n, k in (("gate_proj", 32, 128), ("up_proj", 32, 128), ("down_proj", 128, 32))]


def ct_checkpoint(root: Path, *, seed: int = 0) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A compressed-tensors ``mxfp4-pack-quantized`` directory written by compressed-tensors' compressor
    (moderate scales: its compressor quantizes values, so byte 254 cannot pass it), then adversarial rows
    written in place as bytes (scale bytes 0 and 254, -0 blocks). Returns (root, module -> (packed, scale))."""
    tensors, ref = {}, {}
    for i, (m, n, k) in enumerate(CT_LINEARS):
        packed, scales = codes_and_scales(n, k, seed + i, 120, 130)
        got = ct_compress(decode(packed, scales), scales)
        assert torch.equal(got["weight_scale"], scales)
        adv_p, adv_s = codes_and_scales(n, k, seed + 100 + i)
        got["weight_packed"][:4], got["weight_scale"][:4] = adv_p[:4], adv_s[:4]
        tensors[m + ".weight_packed"], tensors[m + ".weight_scale"] = got["weight_packed"], got["weight_scale"]
        ref[m] = (got["weight_packed"].clone(), got["weight_scale"].clone())
    tensors["model.layers.1.mlp.gate.weight"] = torch.randn(2, 128).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": _ct_config(["model.layers.1.mlp.gate"])}
    return _write(root, tensors, cfg), ref


# --- ModelOpt ---------------------------------------------------------------------------------------

MODELOPT_LINEARS = [("model.layers.0.self_attn.q_proj", 64, 128), ("model.layers.0.mlp.down_proj", 128, 64)]


def modelopt_checkpoint(root: Path, algo: str, *, seed: int = 0) -> tuple[Path, dict[str, tuple]]:
    """A ModelOpt MXFP4 export (``quant_algo`` ``mxfp4`` or ``W4A8_MXFP4_FP8`` with F32 ``input_scale``):
    U8 weight, U8 weight_scale, ModelOpt's -0 blocks under byte 0."""
    tensors, ref = {}, {}
    for i, (m, n, k) in enumerate(MODELOPT_LINEARS):
        packed, scales = codes_and_scales(n, k, seed + i)
        tensors[m + ".weight"], tensors[m + ".weight_scale"] = packed, scales
        ref[m] = (packed, scales)
        if algo == "W4A8_MXFP4_FP8":
            tensors[m + ".input_scale"] = torch.tensor(0.0123 * (i + 1), dtype=torch.float32)
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    if algo != "mxfp4":
        quant["group_size"] = 32
    hfq = {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}
    return _write(root, tensors, {"architectures": ["LlamaForCausalLM"]}, {"hf_quant_config.json": hfq}), ref


# --- DeepSeek-V4 ------------------------------------------------------------------------------------

def deepseek_v4_checkpoint(root: Path, *, seed: int = 0) -> tuple[Path, dict[str, tuple]]:
    """DeepSeek-V4's layout: routed experts ``layers.0.ffn.experts.{e}.w1|w2|w3.weight`` I8 [out, in/2] with
    F8_E8M0 ``.scale`` [out, in/32]; attention F8_E4M3 with an F8_E8M0 ``.scale`` per 128x128 block."""
    tensors, ref = {}, {}
    for e in range(2):
        for j, (w, n, k) in enumerate((("w1", 64, 128), ("w2", 128, 64), ("w3", 64, 128))):
            m = f"layers.0.ffn.experts.{e}.{w}"
            packed, scales = codes_and_scales(n, k, seed + 10 * e + j)
            tensors[m + ".weight"] = packed.view(torch.int8)
            tensors[m + ".scale"] = scales.view(torch.float8_e8m0fnu)
            ref[m] = (packed, scales)
    g = torch.Generator().manual_seed(seed)
    fp8 = (torch.randn(256, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    tensors["layers.0.attn.wq.weight"] = fp8
    tensors["layers.0.attn.wq.scale"] = torch.tensor([[120], [131]], dtype=U8).view(torch.float8_e8m0fnu)
    ref["layers.0.attn.wq"] = (fp8, torch.tensor([[120], [131]], dtype=U8))
    tensors["layers.0.ffn.gate.weight"] = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "expert_dtype": "fp4",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                   "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}
    return _write(root, tensors, cfg), ref
