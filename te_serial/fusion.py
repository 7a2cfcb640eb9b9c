"""The one table of which linear layers a serving engine fuses into one GEMM, and the one rule of
when a fused group's members must hold one tensor scale.

vLLM, SGLang and TensorRT-LLM load ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and
``gate_proj``/``up_proj`` into one ``gate_up_proj`` (their ``packed_modules_mapping``), and apply
ONE tensor-wide scale to the fused weight. So every path that quantizes with a tensor-wide scale
(``quantize_model``, quantize-on-load, ``convert``) gives each fused group one shared amax, from
this table: the engine's one scale is then every member's, and what it serves is what te-serial
quantized. Members copied exactly from a quantized source, with their own scales, are a matter
of the format (``Quantizer.shares_fused_scale``): NVFP4's global scale (``weight_scale_2`` /
``weight_global_scale``) engines take as the members' max, with a log warning at most, so a
member keeping its own is served wrong and an export requantizes it to the group's; per-tensor
FP8 engines requantize to the members' largest scale themselves at load
(``requantize_with_max_scale``), as the ModelOpt and llm-compressor exports, which leave each
member its own scale, need: an export keeps those bytes (``fused="shared"`` requantizes them).

A group is a set of sibling modules (same parent) named by their last name component; the
architecture's groups come from ``config.json``'s ``architectures``. For an architecture not in
the table every known group applies (a group only forms where all its members exist), and a
user rule (``fused=[("wq", "wk", "wv"), …]``) replaces the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from .errors import ConversionError

if TYPE_CHECKING:  # pragma: no cover
    from .formats.base import Quantizer

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
W1_W3 = ("w1", "w3")                            # Mixtral experts, InternLM2 feed_forward
MLA_A = ("q_a_proj", "kv_a_proj_with_mqa")      # DeepSeek-V2/V3 MLA: vLLM's fused_qkv_a_proj

#: architecture (``config.json`` ``architectures[0]``) → the module groups its engines fuse
FUSED_MODULES: dict[str, tuple[tuple[str, ...], ...]] = {
    **{arch: (QKV, GATE_UP) for arch in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "GemmaForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM")},
    "MixtralForCausalLM": (QKV, W1_W3),
    "DeepseekV2ForCausalLM": (MLA_A, GATE_UP),
    "DeepseekV3ForCausalLM": (MLA_A, GATE_UP),
    "InternLM2ForCausalLM": (W1_W3,),
}
#: every group the table knows: what applies to an architecture it does not name
ALL_GROUPS: tuple[tuple[str, ...], ...] = (QKV, GATE_UP, W1_W3, MLA_A)

#: ``fused=`` values, each with the table's groups by architecture: "auto" (members quantized here
#: share one amax; members copied exactly are requantized to the group's scale in an export where
#: engines need one, ``Quantizer.shares_fused_scale``: NVFP4), "shared" (copies in per-tensor FP8
#: too), "off" (nothing shared: engines then serve NVFP4 groups with wrong values wherever the
#: members' scales differ, and te-serial says so per group). A list of groups replaces the table
#: and shares as "auto" does.
FUSED_MODES = ("auto", "shared", "off")


def groups_for(architecture: str | None, rule: str | Sequence[Sequence[str]] | None = "auto"
               ) -> tuple[tuple[str, ...], ...]:
    """The member-name groups that apply: ``rule`` "auto" or "shared" (the table's, by
    ``architecture``), "off" / None (none), or the user's own list of groups."""
    if rule is None or rule == "off":
        return ()
    if rule in ("auto", "shared"):
        return FUSED_MODULES.get(architecture or "", ALL_GROUPS)
    if isinstance(rule, str):
        raise ConversionError(f"fused must be one of {list(FUSED_MODES)} or a list of module-name groups "
                              f"such as [['q_proj', 'k_proj', 'v_proj']], got {rule!r}", field="fused")
    try:
        groups = tuple(tuple(str(m) for m in g) for g in rule)
    except TypeError:
        raise ConversionError("fused groups must be lists of module names, e.g. [['wq', 'wk', 'wv']]",
                              field="fused") from None
    for g in groups:
        if len(g) < 2 or len(set(g)) != len(g) or any(not m or "." in m for m in g):
            raise ConversionError(f"fused group {list(g)}: two or more distinct module names (the last component "
                                  "of each module's path)", field="fused")
    return groups


def requantizes_copies(q: "Quantizer", rule: str | Sequence[Sequence[str]] | None) -> bool:
    """Whether an export requantizes a fused group's members copied exactly in ``q``'s format whose
    tensor scale is not the group's, under ``fused=rule``: where engines need one scale
    (``q.shares_fused_scale()``), or with "shared" wherever ``q``'s scale is tensor-wide; never
    with "off" / None."""
    if rule is None or rule == "off" or not q.takes_tensor_amax():
        return False
    return rule == "shared" or q.shares_fused_scale()


def checks_scale(q: "Quantizer", rule: str | Sequence[Sequence[str]] | None) -> bool:
    """Whether an export checks that a fused group's weight tensor scales (in ``q``'s format) came out
    equal: where it requantizes copies to one, and where engines need one though ``fused="off"``
    shares nothing (then a warning, not a refusal)."""
    return requantizes_copies(q, rule) or q.shares_fused_scale()


def architecture_of(config: Mapping | None) -> str | None:
    """``config.json``'s first architecture, if it names one."""
    archs = (config or {}).get("architectures") if isinstance(config, Mapping) else None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def fused_groups(names: Iterable[str], groups: Sequence[Sequence[str]], suffix: str = ".weight"
                 ) -> list[tuple[str, ...]]:
    """The fused groups among ``names`` (tensor names ending in ``suffix``, or module names with
    ``suffix=""``): for each parent module and each group whose members all appear under it, the
    members' names in the group's order (the engine's shard order)."""
    by_parent: dict[str, dict[str, str]] = {}
    for name in names:
        if suffix and not name.endswith(suffix):
            continue
        module = name[: len(name) - len(suffix)] if suffix else name
        parent, _, leaf = module.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = name
    out = []
    for parent, leaves in by_parent.items():
        for g in groups:
            if all(m in leaves for m in g):
                out.append(tuple(leaves[m] for m in g))
    return out
