"""The interface every serving layout implements, and the activation-scheme choice they share."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ...errors import ConversionError
from ...formats import Quantizer
from ...formats.layout_rules import spread_scales
from ...formats.tensors import QuantizedTensorStorage
from .base import ROW, F32, assemble, representation, solve_amax

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource, SourceTensor

#: ``activations=`` choices: ``auto`` (static scales where every quantized layer has an activation
#: amax, else weight-only where the layout has it, else the layout's dynamic scheme),
#: ``weight_only`` (W8A16 / W4A16), ``dynamic`` (scales computed at run time), ``static``
#: (calibrated per-tensor input scales: W8A8 / W4A4).
ACTIVATION_MODES = ("auto", "weight_only", "dynamic", "static")
_MODE_ALIASES = {"none": "weight_only", "weight-only": "weight_only", "w16": "weight_only", "a16": "weight_only"}

#: FP8 KV-cache scales (ModelOpt ``<attn>.k_proj.k_scale`` / ``v_proj.v_scale``, compressed-tensors
#: ``<attn>.k_scale`` / ``v_scale``): plain fp32 tensors that imports keep and exports write back,
#: with the config's KV-cache scheme (engines quantize the KV cache with them)
KV_CACHE_SCALES = (".k_scale", ".v_scale")

#: written next to an export: what te-serial knows beyond the layout (each tensor's quantizer and
#: tensor amax), so importing the export gives back the source's bytes. Engines ignore it.
SIDECAR_NAME = "te_serial_export.json"
SIDECAR_FORMAT = "te-serial export sidecar"


def parse_mode(mode: str | None) -> str:
    m = _MODE_ALIASES.get(mode or "auto", mode or "auto")
    if m not in ACTIVATION_MODES:
        raise ConversionError(f"activations must be one of {', '.join(ACTIVATION_MODES)} (or 'none'), got {mode!r}",
                              field="activations")
    return m


@dataclasses.dataclass(frozen=True)
class Offer:
    """One conversion target a layout offers: a weight scheme (:data:`~.base.SCHEMES`) written in
    the layout's convention. The target table, its aliases, the CLI's help, import detection and
    the report's names all come from these declarations."""

    target: str                       # the name ``convert(recipe=...)`` takes
    description: str
    modes: Mapping[str, str]          # activation mode → the layout's name for the combination
    name: str = ""                    # the layout's name in reports, where targets share one (else target)
    fmt: str = ""                     # a tensor's format in reports (else the layout's name)
    aliases: tuple[str, ...] = ()
    #: activation mode → why no engine serves MoE experts written in it (such exports are refused)
    no_moe: Mapping[str, str] = dataclasses.field(default_factory=dict)


class ExternalLayout:
    """One serving layout (a family of conversion targets)."""

    family: str = ""
    #: weight scheme → what the layout offers for it (its target, name, activation modes)
    offers: dict[str, Offer] = {}
    #: files this layout writes besides the shards, index and config.json
    extra_file_names: tuple[str, ...] = ()
    #: the report's name for an export holding several weight schemes ("": the layout has none)
    mixed_name: str = ""
    #: ``detect_layout``'s name for a checkpoint of this layout holding several weight schemes
    source_name: str = ""
    #: weight scheme → the layout's name for it, for schemes it reads but does not write
    read_only: dict[str, str] = {}
    #: the layout quantizes MoE experts only, written whole (3-D) under transformers' names (gpt-oss);
    #: other layouts take 2-D ``*.weight`` tensors, experts one by one
    experts_only: bool = False
    #: schemes whose export of a weight is its rows' exports stacked (row-block scales, no per-tensor
    #: value): a stack's experts are exported as one tensor, then cut by rows (``convert``)
    row_local: frozenset[str] = frozenset()

    # --- naming ------------------------------------------------------------------------------
    @property
    def modes(self) -> dict[str, Mapping[str, str]]:
        """scheme → {activation mode → the name the layout gives that combination}."""
        return {s: o.modes for s, o in self.offers.items()}

    def layout_name(self, scheme: str) -> str:
        o = self.offers.get(scheme)
        return self.read_only[scheme] if o is None else o.name or o.target

    def tensor_format(self, scheme: str) -> str:
        """A weight's format as reports name it."""
        o = self.offers.get(scheme)
        return self.read_only[scheme] if o is None else o.fmt or self.layout_name(scheme)

    def representation(self, scheme: str) -> Quantizer:
        return representation(scheme)

    # --- activation scheme -------------------------------------------------------------------
    def resolve_mode(self, scheme: str, requested: str, with_amax: int, total: int) -> tuple[str, str]:
        """(mode, sentence for the report) for ``requested`` when ``with_amax`` of the ``total``
        quantized layers have an activation amax."""
        table = self.modes[scheme]
        name = self.layout_name(scheme)
        if requested == "auto":
            if "static" in table and total and with_amax == total:
                mode = "static"
                why = "every quantized layer has an activation amax"
            elif "weight_only" in table:
                mode = "weight_only"
                why = ("no activation amax known" if not with_amax else
                       f"activation amax known for only {with_amax} of {total} quantized layers")
                why += " (TE delayed-scaling state or activation_amax= from a calibration pass give them)"
            elif "dynamic" in table:
                mode = "dynamic"
                why = "the layout computes activation scales at run time"
            else:
                raise ConversionError(
                    f"{name} needs static activation scales ({table.get('static')}), and "
                    + ("none are known" if not with_amax else f"only {with_amax} of {total} layers have one")
                    + ": pass activation_amax= (--activation-amax FILE) from a calibration pass, or choose a "
                    "layout with a weight-only scheme", field="activations")
            return mode, f"activations: {table[mode]} ({_MODE_WORDS[mode]}), chosen because {why}"
        if requested not in table:
            raise ConversionError(f"{name} has no {requested} activation scheme (it has: "
                                  + ", ".join(f"{m} = {a}" for m, a in table.items()) + ")", field="activations")
        if requested == "static" and with_amax < total:
            raise ConversionError(f"activations='static' needs an activation amax for every quantized layer; "
                                  f"{total - with_amax} of {total} have none (pass activation_amax=)",
                                  field="activations")
        return requested, f"activations: {table[requested]} ({_MODE_WORDS[requested]}), as asked"

    def check_experts(self, scheme: str, mode: str, experts: list[str]) -> None:
        """Refuse writing MoE expert weights (``experts``) in ``scheme`` / ``mode`` where no engine has
        a MoE path for it (:attr:`Offer.no_moe`): such an export would load nowhere."""
        why = self.offers[scheme].no_moe.get(mode)
        if why and experts:
            raise ConversionError(f"{self.layout_name(scheme)} ({self.modes[scheme][mode]}) for MoE experts "
                                  f"({experts[0]} and {len(experts) - 1} more): {why}; choose another scheme or "
                                  "activation mode, or keep the experts out with a rule", tensor=experts[0],
                                  field="activations")

    # --- export --------------------------------------------------------------------------------
    def expert_representation(self, scheme: str, shape: tuple[int, ...]) -> Quantizer | None:
        """The te-serial quantizer (rowwise) of a 3-D expert stack of ``shape`` this layout writes whole,
        or None where it writes experts one by one (:attr:`experts_only` layouts)."""
        return None

    def weight_keys(self, name: str, shape: tuple[int, ...], scheme: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def act_keys(self, name: str, scheme: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The static activation-scale tensors of one layer (``activations='static'``)."""
        return []

    def export(self, name: str, t: QuantizedTensorStorage, scheme: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def export_act(self, name: str, scheme: str, amax: float) -> dict[str, torch.Tensor]:
        return {}

    def rounding_route(self, scheme: str, t: QuantizedTensorStorage) -> tuple[str, float] | None:
        """A consumer route that rounds this weight's stored scales (a reader holding them in a
        narrower dtype): (the route, in words; the largest change of a value it causes), or None
        where every route reads the written values exactly."""
        return None

    def act_scale(self, scheme: str, amax: float) -> torch.Tensor:
        """The static input scale this layout stores for an activation ``amax`` (0-d fp32), what
        :meth:`export_act` writes: one rounding to fp32 of the exact quotient (amax in double)."""
        raise NotImplementedError

    def act_amax(self, scheme: str, scale: float) -> float:
        """An activation amax (a double) whose :meth:`act_scale` is the fp32 ``scale`` bit for bit."""
        raise NotImplementedError

    #: scheme → the key suffixes (after ``<module>.``) of a weight's tensor-wide scale, which an engine
    #: applies once to a fused group (q/k/v, gate/up)
    weight_tensor_scales: dict[str, tuple[str, ...]] = {}
    #: scheme → the key suffixes of its static input scales, written equal across a fused group (the
    #: members share their input)
    input_scales: dict[str, tuple[str, ...]] = {}

    def shared_scale_keys(self, scheme: str, weight: bool) -> tuple[str, ...]:
        """The key suffixes that must be equal across a fused group's members: the input scales, and
        with ``weight`` (the group shares its tensor scale) the weight's tensor scale."""
        return (self.weight_tensor_scales.get(scheme, ()) if weight else ()) + self.input_scales.get(scheme, ())

    def reader(self, scheme: str, blobs: Mapping[str, torch.Tensor], name: str) -> Callable | None:
        """For two-level schemes: the layout reader's value of (codes, block scale bytes), given
        this weight's exported tensors (see :func:`~.base.codes_check`); None otherwise."""
        return None

    def quantization_config(self, scheme: str, mode: str, ignored: list[str], *, kv_cache: bool = False) -> dict:
        raise NotImplementedError

    def mixed_config(self, groups: list[tuple[str, str, list[str]]], ignored: list[str], *,
                     kv_cache: bool = False) -> dict:
        """``quantization_config`` of an export holding several weight schemes: ``groups`` is
        (weight scheme, activation mode, the modules written in it) for each."""
        raise NotImplementedError

    def extra_files(self, groups: list[tuple[str, str, list[str]]], ignored: list[str], *,
                    kv_cache: bool = False) -> dict[str, Any]:
        return {}

    # --- import ----------------------------------------------------------------------------------
    def claim(self, src: "SafetensorsSource") -> None:
        """Turn the source's keys of this layout into quantized :class:`SourceTensor` s."""
        raise NotImplementedError

    def load(self, src: "SafetensorsSource", st: "SourceTensor") -> torch.Tensor:
        raise NotImplementedError

    def load_members(self, src: "SafetensorsSource", st: "SourceTensor", start: int, stop: int) -> torch.Tensor:
        """Experts ``start`` .. ``stop - 1`` of a grouped weight, as a grouped tensor of their own (a layout
        that stores experts stacked reads only theirs)."""
        return self.load(src, st).member_range(start, stop)

    def quantizer_for(self, src: "SafetensorsSource", name: str, scheme: str) -> Quantizer:
        """The quantizer a weight comes back with: the te-serial source's own (recorded in the
        sidecar by te-serial's export) when its rowwise buffers are laid out as the scheme's,
        else the scheme's representation."""
        rep = self.representation(scheme)
        entry = src.sidecar.get(name)
        if entry is None:
            return rep
        try:
            q = Quantizer.from_dict(entry["quantizer"]).set_usage(rowwise=True, columnwise=False)
        except Exception:  # a sidecar that does not parse is ignored, never trusted
            return rep
        return q if _same_rowwise(q, rep) else rep

    def global_amax(self, src: "SafetensorsSource", st: "SourceTensor", stored: torch.Tensor,
                    forward: Callable[[torch.Tensor], torch.Tensor], guess: torch.Tensor, key: str) -> torch.Tensor:
        """The fp32 tensor amax of an imported two-level weight: one whose ``forward`` is the stored
        global scale bit for bit (te-serial's own from the sidecar where it still is, else searched
        near ``guess``). Where no fp32 amax gives those bits, the nearest, and the import's notes
        say what a re-export will write instead."""
        amax = sidecar_amax(src.sidecar.get(st.name))
        if amax is not None and torch.equal(forward(amax).view(torch.int32), stored.view(torch.int32)):
            return amax
        amax, found = solve_amax(stored, forward, guess)
        if not found:
            src.notes.setdefault(st.name, f"{key} {float(stored)!r} is the global scale of no fp32 amax: the values "
                                          f"are held within the stated ulp bound, and a re-export writes "
                                          f"{float(forward(amax))!r}")
        return amax

    def finish_load(self, src: "SafetensorsSource", st: "SourceTensor", data: torch.Tensor, scale: torch.Tensor,
                    amax: torch.Tensor | None = None) -> QuantizedTensorStorage:
        """The te-serial tensor of ``st`` from the layout's arrays; a recorded 2-D quantizer whose
        tiles the scales do not repeat falls back to the scheme's representation."""
        q, shape = st.quantizer, tuple(st.shape)
        t = assemble(q, shape, st.dtype, data, scale, amax)
        lay = q.usage_layout(ROW)
        if lay.tile is not None:
            b = t.buffers()
            again = spread_scales(q.tile_scales(b, shape, ROW), lay.tile, lay.grid, q.grid_shape(shape, ROW))
            stored = q.block_scales(b, shape, ROW)
            if not torch.equal(again.contiguous().view(torch.uint8), stored.contiguous().view(torch.uint8)):
                rep = self.representation(st.keys["scheme"])
                t = assemble(rep, shape, st.dtype, data, scale, amax)
                src.notes.setdefault(st.name, "recorded 2-D quantizer does not match the scales: read as 1-D")
        return t


@functools.lru_cache(maxsize=256)
def _same_rowwise(q: Quantizer, rep: Quantizer) -> bool:
    """Do ``q`` and ``rep`` lay out rowwise buffers alike (so ``rep`` may be recorded for ``q``'s bytes)?"""
    try:
        a, b = q.describe_buffers((256, 256)), rep.describe_buffers((256, 256))
    except Exception:
        return False
    if {k: (v.shape, v.dtype) for k, v in a.items()} != {k: (v.shape, v.dtype) for k, v in b.items()}:
        return False
    return q.value_dtypes() == rep.value_dtypes() and q.global_scale_divisor() == rep.global_scale_divisor() \
        and q.usage_layout(ROW).grid == rep.usage_layout(ROW).grid


_MODE_WORDS = {"weight_only": "weight-only: activations stay in high precision",
               "dynamic": "activation scales computed at run time",
               "static": "static per-tensor activation scales from the recorded amax"}


# --- sidecar ----------------------------------------------------------------------------------------

def sidecar_entry(t: QuantizedTensorStorage, source_q: Quantizer | None = None) -> dict:
    """What te-serial knows of an exported weight: the quantizer of the tensor it came from when
    its rowwise bytes were kept (``source_q``), else the written one, and the tensor amax."""
    q = t.quantizer
    recorded = source_q if source_q is not None and source_q.rowwise and _same_rowwise(
        source_q.set_usage(rowwise=True, columnwise=False), q) else q
    entry: dict[str, Any] = {"quantizer": recorded.to_dict(), "dtype": str(t.fake_dtype).replace("torch.", "")}
    lay = None if q.is_container else q.usage_layout(ROW)   # a grouped tensor's members hold no tensor amax here
    if lay is not None and lay.amax is not None and q.has_usage(ROW):
        entry["amax"] = float(t.buffers()[lay.amax].reshape(())).hex()
    return entry


def write_sidecar(entries: Mapping[str, dict], activation_amax: Mapping[str, float]) -> bytes:
    doc = {"format": SIDECAR_FORMAT, "version": 1, "tensors": dict(entries),
           "activation_amax": {k: float(v).hex() for k, v in activation_amax.items()}}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()   # one line: C's encoder (indent runs Python's, ~4× slower)


def read_sidecar(path: Path) -> tuple[dict[str, dict], dict[str, float]]:
    """(tensor name → entry, module → activation amax) from a sidecar; empty when absent or not
    what te-serial writes (it is a hint, checked against the tensors, never an authority)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}, {}
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT:
        return {}, {}
    tensors = {k: v for k, v in (doc.get("tensors") or {}).items() if isinstance(k, str) and isinstance(v, dict)}
    acts = {}
    for k, v in (doc.get("activation_amax") or {}).items():
        try:
            acts[str(k)] = float.fromhex(v)
        except (TypeError, ValueError):
            continue
    return tensors, acts


def sidecar_amax(entry: dict | None) -> torch.Tensor | None:
    if not entry or not isinstance(entry.get("amax"), str):
        return None
    try:
        v = float.fromhex(entry["amax"])
    except ValueError:
        return None
    return torch.tensor(v, dtype=F32) if math.isfinite(v) else None
