"""The one rule for what stays in high precision when a model or checkpoint is quantized by default.

Both :func:`te_serial.quantize_model` and :func:`te_serial.convert`'s default rules use it, so a
model quantized in memory and the same model converted on disk agree tensor for tensor: only 2-D
``*.weight`` tensors are quantized, and of those not embeddings, output heads, norms or MoE
routers (as TE and the FP8 checkpoints in the wild do: DeepSeek-V3 keeps exactly these in BF16,
its MTP layer's ``shared_head.head`` included).
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

#: glob patterns on tensor names (``<module path>.weight``) kept in high precision
HIGH_PRECISION_PATTERNS = (
    "*embed*", "*wte.*", "*wpe.*",                                           # embeddings
    "*lm_head*", "head.weight", "*.head.weight", "output.weight", "*.output.weight",  # output heads
    "*norm*",                                                                # norms
    "gate.weight", "*.gate.weight", "*router*",                              # MoE routers
)


def stays_high_precision(name: str, shape: Sequence[int]) -> bool:
    """True unless ``name`` is a 2-D ``*.weight`` outside :data:`HIGH_PRECISION_PATTERNS`."""
    if len(shape) != 2 or not (name == "weight" or name.endswith(".weight")):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in HIGH_PRECISION_PATTERNS)
