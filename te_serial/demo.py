"""``te-serial demo``: quantize a few tensors with every recipe (sizes, errors, rebuilt from their
data-free prototypes), then the whole model path per recipe: quantize a small transformer-shaped
model, save it, build a copy on the meta device, load the checkpoint straight into it, and compare."""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from .proto import to_tensor_proto
from .recipes import RECIPES, recipe_quantizer


def _demo_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).mul_(0.02).to(torch.bfloat16)
    outliers = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    outliers[3, 7], outliers[90, 200] = 300.0, -1e4
    return {"linear.weight [256x512]": w, "outliers [128x256]": outliers,
            "stack [4x32x256]": torch.randn(4, 32, 256, generator=g).to(torch.bfloat16)}


class DemoBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class DemoModel(nn.Module):
    """A small transformer-shaped model: embedding, blocks, final norm, tied output head."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DemoBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def run_model_demo(out: TextIO) -> bool:
    from .checkpoint import save_quantized
    from .model import load_into, plan, quantize_model
    torch.manual_seed(0)
    reference = DemoModel().to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        ref_logits = reference(ids).float()
    bf16_bytes = plan(reference).total_bytes
    out.write(f"\nModel path: quantize -> save -> build on meta -> load_into -> forward "
              f"(bf16 model: {bf16_bytes:,} bytes)\n")
    out.write(f"{'recipe':<17}{'checkpoint':>12}{'vs bf16':>9}{'planned':>12}{'logits rel err':>16}  loaded\n")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in RECIPES:
            model = quantize_model(copy.deepcopy(reference), name, columnwise=False)
            path = Path(tmp) / name
            manifest = save_quantized(model, path)
            with torch.device("meta"):
                fresh = DemoModel().to(torch.bfloat16)
            planned = plan(quantize_model(fresh, name, columnwise=False)).total_bytes
            load_into(fresh, path, device="cpu")
            with torch.no_grad():
                logits = fresh(ids).float()
                same = torch.equal(logits, model(ids).float())
            rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            ok &= same and planned == manifest.nbytes()
            out.write(f"{name:<17}{manifest.nbytes():>12,}{manifest.nbytes() / bf16_bytes:>9.3f}{planned:>12,}"
                      f"{rel:>16.4f}  {'exact' if same else 'MISMATCH'}\n")
    return ok


def run_demo(out: TextIO = sys.stdout) -> int:
    tensors = _demo_tensors()
    out.write("Weights quantized rowwise (the inference layout); bytes include scales.\n")
    out.write(f"{'recipe':<17}{'tensor':<24}{'bytes':>9}{'vs bf16':>9}{'max abs err':>13}"
              f"{'rel rmse':>10}  rebuilt\n")
    for name in RECIPES:
        for tname, x in tensors.items():
            q = recipe_quantizer(name, columnwise=False)
            try:
                t = q.quantize(x)
            except Exception as e:  # a shape this recipe cannot hold
                out.write(f"{name:<17}{tname:<24}  skipped: {e}\n")
                continue
            proto = to_tensor_proto(t)
            rebuilt = proto.assemble(t.buffers())
            same = torch.equal(rebuilt.dequantize(torch.float32), t.dequantize(torch.float32))
            err = t.dequantize(torch.float32) - x.float()
            rel = err.pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt()
            bf16 = x.numel() * 2
            out.write(f"{name:<17}{tname:<24}{proto.nbytes:>9}{proto.nbytes / bf16:>9.3f}"
                      f"{err.abs().max().item():>13.4g}{rel.item():>10.4f}  {'ok' if same else 'MISMATCH'}\n")
    return 0 if run_model_demo(out) else 1
