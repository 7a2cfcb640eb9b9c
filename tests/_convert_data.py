"""Checkpoints laid out exactly as the real formats are, built without te-serial, and independent
reference dequantizers — shared by test_convert.py, test_importers.py and test_cli.py.

DeepSeek-V3 (``deepseek-ai/DeepSeek-V3``): ``config.json`` ``quantization_config`` =
``{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size":
[128, 128]}``; linear weights ``<module>.weight`` F8_E4M3 ``[out, in]`` with
``<module>.weight_scale_inv`` F32 ``[ceil(out/128), ceil(in/128)]`` (value = fp8 · scale_inv);
embeddings, norms, ``mlp.gate`` (router), ``lm_head`` in BF16; ``e_score_correction_bias`` F32;
shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

compressed-tensors ``float-quantized`` (llm-compressor's FP8_DYNAMIC / FP8 schemes):
``<module>.weight`` F8_E4M3 + ``<module>.weight_scale`` in the weight's original dtype (BF16)
with shape ``[out, 1]`` (strategy ``channel``) or ``[1]`` (strategy ``tensor``); scale =
amax / 448 computed in that dtype; static schemes add ``<module>.input_scale``; symmetric, so no
zero points are saved; ``lm_head`` is in ``ignore`` and stays BF16.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

E4M3 = torch.float8_e4m3fn

DEEPSEEK_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}


def ct_qc(strategy: str, static_input: bool = False) -> dict:
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
               "observer": "minmax", "observer_kwargs": {}, "strategy": strategy, "symmetric": True,
               "type": "float"}
    if static_input:
        act = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
               "observer": "minmax", "observer_kwargs": {}, "strategy": "tensor", "symmetric": True,
               "type": "float"}
    else:
        act = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
               "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}
    return {"config_groups": {"group_0": {"input_activations": act, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "float-quantized", "global_compression_ratio": 1.2, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "version": "0.10.2"}


def randn(shape, seed, scale=0.02, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# --- independent quantizers (as the producers of these formats do it) -----------------------

def deepseek_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 block FP8 as DeepSeek-V3 stores it: s = amax/448 per block, q = e4m3(x / s)."""
    m, k = w.shape
    mb, kb = math.ceil(m / 128), math.ceil(k / 128)
    x = torch.zeros(mb * 128, kb * 128)
    x[:m, :k] = w.float()
    blocks = x.reshape(mb, 128, kb, 128)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).reshape(mb * 128, kb * 128)[:m, :k].to(E4M3)
    return q.contiguous(), s.float().contiguous()


def deepseek_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    full = s.repeat_interleave(128, dim=0)[:m].repeat_interleave(128, dim=1)[:, :k]
    return q.float() * full


def ct_quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors FP8: scale = amax / 448 in the weight's dtype, q = e4m3(clamp(x / scale))."""
    if strategy == "tensor":
        amax = w.abs().amax().reshape(1)
    else:
        amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).to(w.dtype)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    q = (w / scale).clamp(-448, 448).to(E4M3)
    return q.contiguous(), scale.contiguous()


def ct_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact value of a compressed-tensors FP8 weight: fp8 × scale, formed in fp32 (as vLLM's
    kernels do; compressed-tensors' own dequantize rounds this product to the scale's dtype)."""
    return q.float() * scale.float()


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     modelopt: bool) -> torch.Tensor:
    """An NVFP4 weight as its layout's reader forms it, in fp32: ModelOpt
    ``e2m1 · (float(weight_scale) · weight_scale_2)``, compressed-tensors
    ``e2m1 · (float(weight_scale) / weight_global_scale)`` (element 2i in the low nibble)."""
    n, kh = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, kh * 2).long()
    g = global_scale.float().reshape(())
    s = scale.float() * g if modelopt else scale.float() / g
    return (E2M1[codes].reshape(n, -1, 16) * s[..., None]).reshape(n, kh * 2)


def mxfp4_dequantize(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """MXFP4: e2m1 · 2^(e - 127) per 32 elements along a row (element 2i in the low nibble)."""
    n, kh = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, kh * 2).long()
    return (E2M1[codes].reshape(n, -1, 32) * torch.exp2(exponents.float() - 127)[..., None]).reshape(n, kh * 2)


def mxfp8_dequantize(q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """MXFP8: fp8 · 2^(e - 127) per 32 elements along a row (E8M0 exponents as U8)."""
    n, k = q.shape
    s = torch.exp2(exponents.float() - 127)
    return (q.float().reshape(n, k // 32, 32) * s[..., None]).reshape(n, k)


# --- checkpoints -----------------------------------------------------------------------------

def _write_hf(root: Path, tensors: dict[str, torch.Tensor], config: dict | None, shards: int = 2) -> None:
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}, indent=2))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config, indent=2))


def deepseek_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A two-layer DeepSeek-V3-style checkpoint (layer 0 dense, layer 1 MoE) with shapes that are
    and are not multiples of 128. Returns name → reference fp32 values."""
    h = 256
    linear = {  # name → shape [out, in]
        "model.layers.0.self_attn.q_a_proj.weight": (192, h),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (72, h),   # 576 in V3: not a multiple of 128
        "model.layers.0.self_attn.o_proj.weight": (h, 200),
        "model.layers.0.mlp.gate_proj.weight": (384, h),
        "model.layers.0.mlp.down_proj.weight": (h, 384),
        "model.layers.1.mlp.experts.0.up_proj.weight": (128, h),
        "model.layers.1.mlp.shared_experts.down_proj.weight": (h, 128),
    }
    plain = {
        "model.embed_tokens.weight": randn((100, h), 1),
        "model.layers.0.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "model.layers.0.self_attn.kv_a_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.1.mlp.gate.weight": randn((8, h), 2),
        "model.layers.1.mlp.gate.e_score_correction_bias": torch.zeros(8, dtype=torch.float32),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": randn((100, h), 3),
    }
    tensors: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(linear.items()):
        q, s = deepseek_quantize(randn(shape, 10 + i))
        tensors[name], tensors[name + "_scale_inv"] = q, s
        ref[name] = deepseek_dequantize(q, s)
    for name, t in plain.items():
        tensors[name] = t
        ref[name] = t.float()
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": h,
              "num_hidden_layers": 2, "torch_dtype": "bfloat16", "quantization_config": dict(DEEPSEEK_QC)}
    _write_hf(root, dict(sorted(tensors.items())), config, shards=2)
    return ref


def ct_checkpoint(root: Path, strategy: str, static_input: bool = False) -> dict[str, torch.Tensor]:
    """A Llama-style compressed-tensors FP8 checkpoint. Returns name → reference fp32 values."""
    h = 256
    linear = {"model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (128, h),
              "model.layers.0.mlp.up_proj.weight": (384, h), "model.layers.0.mlp.down_proj.weight": (h, 384)}
    plain = {"model.embed_tokens.weight": randn((100, h), 1), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
             "model.layers.0.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             "lm_head.weight": randn((100, h), 3)}
    tensors: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(linear.items()):
        q, scale = ct_quantize(randn(shape, 20 + i), strategy)
        prefix = name[: -len("weight")]
        tensors[name], tensors[prefix + "weight_scale"] = q, scale
        if static_input:
            tensors[prefix + "input_scale"] = torch.tensor([0.01], dtype=torch.bfloat16)
        ref[name] = ct_dequantize(q, scale)
    for name, t in plain.items():
        tensors[name] = t
        ref[name] = t.float()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "torch_dtype": "bfloat16", "quantization_config": ct_qc(strategy, static_input)}
    _write_hf(root, dict(sorted(tensors.items())), config, shards=2)
    return ref


def plain_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small Llama-like BF16 state dict: quantizable 2-D weights (one of ragged shape), norms,
    an embedding, the head, an int64 buffer."""
    return {
        "model.embed_tokens.weight": randn((64, 256), seed + 1),
        "model.layers.0.self_attn.q_proj.weight": randn((256, 256), seed + 2),
        "model.layers.0.mlp.up_proj.weight": randn((384, 256), seed + 3, scale=1.0),
        "model.layers.0.mlp.down_proj.weight": randn((200, 300), seed + 4),  # ragged: blockwise/per-tensor only
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        "model.layers.0.rotary.inv_freq": torch.arange(16, dtype=torch.float32),
        "model.position_ids": torch.arange(8, dtype=torch.int64),
        "lm_head.weight": randn((64, 256), seed + 5),
    }
