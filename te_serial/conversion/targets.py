"""What a conversion can produce: the target table, rules, and names for formats in reports.

A target is a te-serial recipe (every entry of :data:`te_serial.recipes.RECIPES`, written as a
te-serial checkpoint), a plain dtype (``bf16``/``fp16``/``fp32``: a Hugging Face-style
safetensors checkpoint any HF loader reads), or a serving layout, as each layout offers it
(``ExternalLayout.offers``: ModelOpt ``modelopt_*``, compressed-tensors ``compressed_tensors_*``,
``deepseek_fp8``). Plain dtypes mix with any other target
(they mean "a plain tensor of that dtype"); te-serial recipes and each serving layout do not mix,
since they are different file layouts; several weight schemes of one serving layout make a mixed
export (ModelOpt ``MIXED_PRECISION``, compressed-tensors config groups).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from ..dtypes import dtype_name
from ..errors import ConversionError
from ..formats import Quantizer
from ..precision import HIGH_PRECISION_PATTERNS, stays_high_precision
from ..recipes import RECIPES, recipe_quantizer
from .layouts import FAMILIES as LAYOUTS

KEEP = "keep"

#: families: "te" (te-serial checkpoint), "plain" (HF safetensors), and the serving layouts
#: "modelopt", "ct" (compressed-tensors), "deepseek"
FAMILY_LAYOUT = {"te": "te-serial", "plain": "safetensors", "deepseek": "block FP8 (weight_scale_inv)",
                 "ct": "compressed-tensors", "modelopt": "ModelOpt", "gpt_oss": "gpt-oss MXFP4"}


@dataclasses.dataclass(frozen=True)
class Target:
    """One conversion target: its name, family and what it needs."""

    name: str
    family: str
    description: str
    dtype: torch.dtype | None = None      # plain targets
    scheme: str | None = None             # serving layouts: the weight scheme (layouts/base.py)
    layout: str | None = None             # serving layouts: the layout's name in reports

    def quantizer(self, *, rowwise: bool = True, columnwise: bool = True) -> Quantizer:
        """The weight quantizer of a te-serial recipe target."""
        if self.family != "te":
            raise ConversionError(f"target {self.name!r} is not a te-serial recipe")
        return recipe_quantizer(self.name, rowwise=rowwise, columnwise=columnwise)


def _build_targets() -> dict[str, Target]:
    out: dict[str, Target] = {}
    for name, (desc, _) in RECIPES.items():
        out[name] = Target(name, "te", desc)
    out["bf16"] = Target("bf16", "plain", "plain BF16 (Hugging Face safetensors)", dtype=torch.bfloat16)
    out["fp16"] = Target("fp16", "plain", "plain FP16 (Hugging Face safetensors)", dtype=torch.float16)
    out["fp32"] = Target("fp32", "plain", "plain FP32 (Hugging Face safetensors)", dtype=torch.float32)
    for family, layout in LAYOUTS.items():   # the serving layouts: each one's own declarations
        for scheme, offer in layout.offers.items():
            out[offer.target] = Target(offer.target, family, offer.description, scheme=scheme,
                                       layout=layout.layout_name(scheme))
    return out


TARGETS: dict[str, Target] = _build_targets()
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            **{a: o.target for lay in LAYOUTS.values() for o in lay.offers.values() for a in o.aliases}}


def target_names() -> list[str]:
    return list(TARGETS)


def target(name: str) -> Target:
    """The target called ``name`` (a recipe, ``bf16``/``fp16``/``fp32``, or an engine layout)."""
    key = _ALIASES.get(name, name) if isinstance(name, str) else name
    if key not in TARGETS:
        raise ConversionError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)} (or 'keep' in rules)")
    return TARGETS[key]


# --- rules ---------------------------------------------------------------------------------------

#: what the default rules keep as they are (te_serial.precision: the rule quantize_model uses too)
DEFAULT_KEEP_PATTERNS = HIGH_PRECISION_PATTERNS


class Rules:
    """Ordered glob patterns on tensor names → target name or ``"keep"``; the first match wins.

    ``None`` gives the default: tensors :func:`~te_serial.precision.stays_high_precision` keeps
    (all but 2-D ``*.weight`` tensors outside :data:`DEFAULT_KEEP_PATTERNS`) are kept, the rest
    get ``recipe``. With explicit rules, unmatched tensors are kept.
    """

    def __init__(self, rules: Mapping[str, str] | Sequence[tuple[str, str]] | None, recipe: str | None) -> None:
        self.recipe = recipe
        self.default = rules is None
        if rules is None:
            self.items: list[tuple[str, str]] = []
        elif isinstance(rules, Mapping):
            self.items = [(str(k), str(v)) for k, v in rules.items()]
        else:
            try:
                self.items = [(str(p), str(v)) for p, v in rules]
            except (TypeError, ValueError):
                raise ConversionError("rules must map glob patterns to a target name or 'keep'") from None
        for pattern, value in self.items:
            if value != KEEP:
                target(value)  # fails with the list of choices
        if recipe is not None:
            target(recipe)

    def values(self) -> list[str]:
        vals = [v for _, v in self.items if v != KEEP]
        if self.recipe is not None:
            vals.append(self.recipe)
        return vals

    def lookup(self, name: str, shape: tuple[int, ...]) -> tuple[str, bool]:
        """(target name or ``"keep"``, explicit): ``explicit`` is False for the default rule."""
        if self.default:
            if self.recipe is None or stays_high_precision(name, shape):
                return KEEP, False
            return self.recipe, False
        for pattern, value in self.items:
            if fnmatch.fnmatchcase(name, pattern):
                return value, True
        return KEEP, True

    def family(self) -> str:
        """The output layout family these rules and the recipe ask for."""
        fams = {target(v).family for v in self.values()}
        special = sorted(fams - {"plain"})
        if len(special) > 1:
            names = sorted({v for v in self.values() if target(v).family != "plain"})
            raise ConversionError(f"targets {names} write different checkpoint layouts "
                                  f"({', '.join(FAMILY_LAYOUT[f] for f in special)}); convert to one of them")
        if special:
            return special[0]
        return "plain" if fams else "te"


def load_rules(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Rules from a file: a JSON object ``{pattern: target}`` (or a list of pairs), or text lines
    ``pattern target`` / ``pattern = target`` (``#`` starts a comment)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"cannot read rules: {e}", file=str(p)) from None
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConversionError(f"rules are not valid JSON: {e}", file=str(p)) from None
        items: Iterable = data.items() if isinstance(data, dict) else data
        try:
            out = [(str(a), str(b)) for a, b in items]
        except (TypeError, ValueError):
            raise ConversionError("JSON rules must be {pattern: target} or [[pattern, target], ...]",
                                  file=str(p)) from None
    else:
        out = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = [s.strip() for s in line.split("=", 1)] if "=" in line else line.split()
            if len(parts) != 2 or not all(parts):
                raise ConversionError(f"line {lineno}: expected 'pattern target', got {line!r}", file=str(p))
            out.append((parts[0], parts[1]))
    for pattern, value in out:
        if value != KEEP:
            try:
                target(value)
            except ConversionError as e:
                raise ConversionError(f"rule {pattern!r}: {e}", file=str(p)) from None
    return out


# --- names for formats --------------------------------------------------------------------------

_SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.float8_e8m0fnu: "e8m0"}


def describe_dtype(dtype: torch.dtype) -> str:
    return _SHORT_DTYPES.get(dtype) or dtype_name(dtype)


@functools.lru_cache(maxsize=1024)
def describe_quantizer(q: Quantizer) -> str:
    """The recipe name whose layout ``q`` has (``mxfp8``, ``fp8_block`` …), else the format's
    descriptive layout name."""
    for name in RECIPES:
        ref = recipe_quantizer(name, rowwise=q.rowwise, columnwise=q.columnwise)
        if ref.same_layout(q):
            return name
    return q.layout_name()


def usage_label(q: Quantizer | None) -> str:
    if q is None:
        return "-"
    return "+".join(u for u, on in (("row", q.rowwise), ("col", q.columnwise)) if on)

