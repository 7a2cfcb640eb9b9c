"""The one table of how MoE checkpoints name a layer's experts, and how they map onto transformers 5's
3-D expert parameters.

Checkpoints (what ``save_pretrained`` writes, what vLLM's and SGLang's loaders read) keep one key
per expert and projection:

* Qwen2/Qwen3-MoE, DeepSeek-V2/V3, OLMoE and their kin: ``<p>.experts.<i>.gate_proj.weight``,
  ``up_proj``, ``down_proj``;
* Mixtral: ``<q>.block_sparse_moe.experts.<i>.w1.weight`` (gate), ``w3`` (up), ``w2`` (down);
  transformers 5 names the module ``mlp`` (its router too: ``block_sparse_moe.gate`` →
  ``mlp.gate``).

transformers 5 holds them as ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows,
then its up rows) and ``<p>.experts.down_proj`` ``[E, H, I]`` (its conversion mapping's
``MergeModulelist`` + ``Concatenate``). Which bytes that takes for a quantized expert is the
format's rule (``formats.slicing.join_rows``); this module only names.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

#: per-expert projection names: (gate, up, down), as each family writes them
PROJECTION_STYLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: module names a checkpoint uses → transformers 5's (Mixtral's ``block_sparse_moe`` is ``mlp``)
MODULE_RENAMES = ((".block_sparse_moe.", ".mlp."),)
#: transformers 5's 3-D parameter names under ``<p>.experts``
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"

_PROJ = "|".join(sorted({p for style in PROJECTION_STYLES for p in style}))
_PER_EXPERT = re.compile(rf"(.+)\.experts\.(0|[1-9][0-9]*)\.({_PROJ})\.weight", re.DOTALL)


class FusedExperts(NamedTuple):
    """A transformers 5 expert parameter and, per expert, the checkpoint tensors whose rows it stacks."""

    name: str
    parts: tuple[tuple[str, ...], ...]   # per expert: (gate, up) or (down,)


def is_per_expert(name: str) -> bool:
    """A checkpoint's per-expert weight (``<p>.experts.<i>.<projection>.weight``)."""
    return _PER_EXPERT.fullmatch(name) is not None


def expert_projection(module: str) -> str | None:
    """``<p>.experts.<projection>`` for a per-expert module ``<p>.experts.<i>.<projection>``, else None:
    what the experts of one layer share (engines give them one static input scale, the max)."""
    m = _PER_EXPERT.fullmatch(f"{module}.weight")
    return None if m is None else f"{m.group(1)}.experts.{m.group(3)}"


def in_memory_name(name: str) -> str:
    """A checkpoint's module path as transformers 5 names it (:data:`MODULE_RENAMES`)."""
    for old, new in MODULE_RENAMES:
        name = name.replace(old, new)
    return name


def plan_fused(checkpoint_names: Iterable[str], wanted: Iterable[str]) -> tuple[list[FusedExperts], dict[str, str]]:
    """(the ``wanted`` expert parameters that a checkpoint's per-expert tensors make, the ``wanted``
    names a checkpoint holds under another module name → that name), for names ``wanted`` (a model's)
    that ``checkpoint_names`` lacks. An expert layer is planned when every expert 0..E-1 has all
    three projections of one style."""
    names = list(checkpoint_names)
    have, wanted = set(names), set(wanted)
    layers: dict[tuple[str, tuple[str, ...]], dict[int, dict[str, str]]] = {}
    for n in names:
        m = _PER_EXPERT.fullmatch(n)
        if m is None:
            continue
        prefix, i, proj = m.group(1), int(m.group(2)), m.group(3)
        style = next(s for s in PROJECTION_STYLES if proj in s)
        layers.setdefault((prefix, style), {}).setdefault(i, {})[proj] = n
    fused: list[FusedExperts] = []
    for (prefix, (gate, up, down)), experts in layers.items():
        if set(experts) != set(range(len(experts))) or any(len(e) != 3 for e in experts.values()):
            continue
        base = in_memory_name(f"{prefix}.experts")
        order = [experts[i] for i in range(len(experts))]
        for leaf, projs in ((FUSED_GATE_UP, (gate, up)), (FUSED_DOWN, (down,))):
            target = f"{base}.{leaf}"
            if target in wanted and target not in have:
                fused.append(FusedExperts(target, tuple(tuple(e[p] for p in projs) for e in order)))
    renamed = {}
    for n in names:
        new = in_memory_name(n)
        if new != n and new in wanted and new not in have and _PER_EXPERT.fullmatch(n) is None:
            renamed[new] = n
    return fused, renamed


# --- the other way: transformers 5's 3-D experts written under the checkpoints' per-expert names ----

#: architecture (``config.json`` ``architectures[0]``) → (per-expert projections (gate, up, down), the
#: checkpoints' name of the MoE module where it is not transformers 5's ``mlp``); None: the
#: architecture's checkpoints keep the 3-D names (gpt-oss). Others: Qwen's names.
CHECKPOINT_STYLES: dict[str, tuple[tuple[str, str, str], str | None] | None] = {
    "MixtralForCausalLM": (("w1", "w3", "w2"), "block_sparse_moe"),
    "GptOssForCausalLM": None,
}
DEFAULT_STYLE = (PROJECTION_STYLES[0], None)
_FUSED = re.compile(rf"(.+)\.experts\.({FUSED_GATE_UP}|{FUSED_DOWN})", re.DOTALL)


class ExpertPart(NamedTuple):
    """One per-expert checkpoint tensor: rows ``rows`` (None: all) of expert ``expert`` of ``source``."""

    source: str
    expert: int
    rows: tuple[int, int] | None


def fused_name(name: str) -> bool:
    """transformers 5's name of a layer's 3-D experts (``<p>.experts.gate_up_proj`` / ``down_proj``)."""
    return _FUSED.fullmatch(name) is not None


def checkpoint_name(name: str, architecture: str | None) -> str:
    """``name`` as the architecture's checkpoints (and engines) write it: Mixtral's ``mlp`` is
    ``block_sparse_moe`` there (its router included)."""
    style = CHECKPOINT_STYLES.get(architecture or "", DEFAULT_STYLE)
    if style is None or style[1] is None:
        return name
    return name.replace(".mlp.", f".{style[1]}.")


def plan_split_fused(shapes: dict[str, tuple[int, ...]], architecture: str | None) -> dict[str, ExpertPart]:
    """Per-expert checkpoint name → its part of a transformers 5 expert parameter, for every 3-D
    ``<p>.experts.gate_up_proj`` / ``down_proj`` in ``shapes`` (gate_up: the first half of each expert's
    rows is the gate, the second the up). Empty for architectures whose checkpoints keep 3-D names."""
    style = CHECKPOINT_STYLES.get(architecture or "", DEFAULT_STYLE)
    if style is None:
        return {}
    (gate, up, down), _ = style
    out: dict[str, ExpertPart] = {}
    for name, shape in shapes.items():
        m = _FUSED.fullmatch(name)
        if m is None or len(shape) != 3:
            continue
        base = checkpoint_name(f"{m.group(1)}.experts", architecture)
        rows = shape[1]
        for i in range(shape[0]):
            if m.group(2) == FUSED_GATE_UP:
                out[f"{base}.{i}.{gate}.weight"] = ExpertPart(name, i, (0, rows // 2))
                out[f"{base}.{i}.{up}.weight"] = ExpertPart(name, i, (rows // 2, rows))
            else:
                out[f"{base}.{i}.{down}.weight"] = ExpertPart(name, i, None)
    return out


def expert_module_names(experts: str, i: int, architecture: str | None) -> tuple[str, str, str] | None:
    """(gate, up, down) module names of expert ``i`` of transformers 5's experts module ``experts``
    (``<p>.experts``) as the architecture's checkpoints and exports write them; None where they keep
    the experts whole (gpt-oss)."""
    style = CHECKPOINT_STYLES.get(architecture or "", DEFAULT_STYLE)
    if style is None:
        return None
    base = checkpoint_name(experts, architecture)
    return tuple(f"{base}.{i}.{proj}" for proj in style[0])
