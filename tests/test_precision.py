"""One rule for what stays high precision: quantize_model and convert's default rules agree."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import te_serial as ts
from te_serial import formats as tsf
from te_serial.precision import stays_high_precision


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(d, d, bias=False), "o_proj": nn.Linear(d, d)})
        self.mlp = nn.ModuleDict({
            "gate": nn.Linear(d, 32, bias=False),      # MoE router (DeepSeek / Mixtral naming)
            "up_proj": nn.Linear(d, 2 * d, bias=False),
            "down_proj": nn.Linear(2 * d, d, bias=False),
            "gate_proj": nn.Linear(d, 2 * d, bias=False),  # not a router: quantized
        })
        self.router = nn.Linear(d, 32, bias=False)   # another router naming


class Model(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d), Layer(d)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_quantize_model_and_convert_keep_the_same_tensors(recipe, tmp_path):
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    rep = ts.convert(tmp_path / "model.safetensors", tmp_path / "out", recipe=recipe)
    by_convert = sorted(t.name for t in rep.tensors if t.method == "quantize")
    ts.quantize_model(model, recipe, columnwise=False)
    by_model = sorted(n for n, p in model.named_parameters() if isinstance(p, tsf.QuantizedTensor))
    assert by_model == by_convert
    expected = sorted(f"layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_proj"))
    assert by_model == expected


@pytest.mark.parametrize("name,shape,keep", [
    ("model.embed_tokens.weight", (8, 8), True), ("transformer.wte.weight", (8, 8), True),
    ("lm_head.weight", (8, 8), True), ("model.mtp.shared_head.head.weight", (8, 8), True),
    ("output.weight", (8, 8), True), ("layers.0.input_layernorm.weight", (8,), True),
    ("layers.0.mlp.gate.weight", (8, 8), True), ("layers.0.block_sparse_moe.router.weight", (8, 8), True),
    ("layers.0.mlp.gate_proj.weight", (8, 8), False), ("layers.0.attn.q_proj.weight", (8, 8), False),
    ("weight", (8, 8), False), ("layers.0.attn.q_proj.bias", (8,), True),
    ("layers.0.experts.w", (2, 8, 8), False), ("layers.0.experts.weight", (2, 8, 8), False),
    ("layers.0.experts.w_bias", (2, 1, 8), True), ("layers.0.not_experts.w", (2, 8, 8), True),
])
def test_the_rule(name, shape, keep):
    assert stays_high_precision(name, shape) is keep
