"""``te-serial demo``: quantize a few tensors with every recipe; print sizes, errors and a proof
that each tensor rebuilds from its data-free prototype."""

from __future__ import annotations

import math
import sys
from typing import TextIO

import torch

from .proto import to_tensor_proto
from .recipes import RECIPES, recipe_quantizer


def _demo_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).mul_(0.02).to(torch.bfloat16)
    outliers = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    outliers[3, 7], outliers[90, 200] = 300.0, -1e4
    return {"linear.weight [256x512]": w, "outliers [128x256]": outliers,
            "stack [4x32x256]": torch.randn(4, 32, 256, generator=g).to(torch.bfloat16)}


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
    return 0
