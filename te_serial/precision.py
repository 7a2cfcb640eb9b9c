"""The one rule for what stays in high precision when a model or checkpoint is quantized by default.

:func:`te_serial.quantize_model`, quantize on load (``load_into``, ``te_serial.hf``) and
:func:`te_serial.convert`'s default rules all use it, so a model quantized in memory and the same
model converted on disk agree tensor for tensor. Quantized are:

* 2-D ``*.weight`` tensors (linear layers), and
* 3-D expert weights: a MoE layer's experts held as one parameter ``[experts, out, in]`` under an
  ``experts`` module (transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``), each expert
  quantized on its own as TE's ``GroupedLinear`` quantizes its members;

and of those not embeddings, output heads, norms or MoE routers (as TE and the FP8 checkpoints in
the wild do: DeepSeek-V3 keeps exactly these in BF16, its MTP layer's ``shared_head.head``
included). Biases, 1-D tensors and everything else stay as they are.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Sequence

#: (glob patterns on tensor names, why they stay high precision), first match wins
HIGH_PRECISION_RULES = (
    (("*embed*", "*wte.*", "*wpe.*"), "an embedding"),
    (("*lm_head*", "head.weight", "*.head.weight", "output.weight", "*.output.weight"), "an output head"),
    (("*norm*",), "a norm"),
    (("gate.weight", "*.gate.weight", "*router*", "*shared_expert_gate*"),
     "a MoE router or shared-expert gate (engines keep them unquantized)"),
)
#: every pattern of :data:`HIGH_PRECISION_RULES`
HIGH_PRECISION_PATTERNS = tuple(p for patterns, _ in HIGH_PRECISION_RULES for p in patterns)
#: each rule's patterns as one expression (a name is matched once per rule, not once per pattern)
_RULES = tuple((re.compile("|".join(fnmatch.translate(p) for p in patterns)), why)
               for patterns, why in HIGH_PRECISION_RULES)


def is_expert_weight(name: str, shape: Sequence[int]) -> bool:
    """A 3-D stack of a MoE layer's expert weights (``<p>.experts.<proj>``, not a bias or a scale):
    quantized one expert at a time, as TE's grouped weights are."""
    parts = name.split(".")
    leaf = parts[-1]
    return (len(shape) == 3 and "experts" in parts[:-1] and "bias" not in leaf and "scale" not in leaf
            and not leaf.startswith("_"))


def high_precision_reason(name: str, shape: Sequence[int]) -> str | None:
    """Why ``name`` (of ``shape``) stays high precision, or None when the default rule quantizes it."""
    if len(shape) == 3:
        if not is_expert_weight(name, shape):
            return "3-D, not a stack of expert weights under an 'experts' module"
    elif len(shape) != 2 or not (name == "weight" or name.endswith(".weight")):
        return "not a 2-D '*.weight' (a linear layer's) or a 3-D expert stack"
    for rule, why in _RULES:
        if rule.match(name):
            return why
    return None


def stays_high_precision(name: str, shape: Sequence[int]) -> bool:
    """True unless ``name`` is a 2-D ``*.weight`` or a 3-D expert stack outside
    :data:`HIGH_PRECISION_PATTERNS` (see :func:`high_precision_reason`)."""
    return high_precision_reason(name, shape) is not None
