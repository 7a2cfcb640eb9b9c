"""One tensor scale per fused group: the pass ``convert`` and ``load_into`` run before quantizing.

A serving engine fuses q/k/v (gate/up, …: :mod:`te_serial.fusion`) into one GEMM with one
tensor-wide scale. So the members of a group that are quantized with a tensor-wide scale
(per-tensor FP8 current scaling, NVFP4's global scale: ``Quantizer.takes_tensor_amax``) take the
group's largest amax: the engine then serves what te-serial quantized. Members copied exactly
from a quantized source keep their bytes where their scale already is the group's (a recorded
amax that is the largest; per-tensor FP8, which records none: the largest scale, the group's
amax then being one that gives it). The others, into a serving layout (``reexpress``), depend on
the format (:func:`te_serial.fusion.requantizes_copies`): where engines apply the one scale as
they find it (NVFP4's global scale) they are requantized from their values with the shared amax,
lossy unless the values come out bit-identical, and the report says so per tensor; where engines
requantize the members to the largest scale themselves at load (per-tensor FP8, as ModelOpt's and
llm-compressor's exports need) they keep their bytes, and the report says per tensor how far
that requantization moves their values (a consumer route).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch

from .. import numerics as nx
from ..formats import fused
from ..formats.protocol import ROWWISE, flatten_2d
from ..formats.tensors import QuantizedTensorStorage
from ..formats.base import Quantizer
from ..fusion import fused_groups, requantizes_copies
from .layouts.base import solve_amax
from .transforms import Step, values


def _tensor_scale(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor-wide factor every rowwise value of a quantized tensor shares (its recorded amax,
    or a per-tensor scale), as fp32 bits to compare; None for a plain tensor."""
    if not isinstance(t, QuantizedTensorStorage):
        return None
    q, b = t.quantizer, t.buffers()
    amax = q.recorded_tensor_amax(b)
    if amax is not None:
        return amax.reshape(()).float()
    if q.scale_per_tensor and q.has_usage(ROWWISE):
        return q.block_scales(b, tuple(t.logical_shape), ROWWISE).reshape(()).float()
    return None


def _amax(t: torch.Tensor) -> torch.Tensor:
    """max|t| (NaN ignored) as a 0-d fp32 tensor: a plain tensor's in one pass over its own dtype
    (the native maxima where they take it), a quantized one's over its values."""
    if isinstance(t, QuantizedTensorStorage):
        return nx.nan_ignoring_amax(values(t)).float()
    got = fused.nan_free_amaxes(t.reshape(flatten_2d(tuple(t.shape)))) if t.numel() else None
    return got[fused.TENSOR_AMAX].reshape(()).float() if got is not None else nx.nan_ignoring_amax(t).float()


def _scale_for(q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """The tensor-wide scale (as :func:`_tensor_scale` reads it) that ``q`` gives a tensor quantized
    with ``amax``: one block of zeros quantized with it."""
    rows, cols = q.slice_alignment()
    probe = q.set_usage(rowwise=True, columnwise=False).quantize(torch.zeros(rows, cols), tensor_amax=amax, eager=True)
    return _tensor_scale(probe)


#: the consumer route a copied member that keeps its own scale takes in an engine (TensorReport.routes)
ENGINE_REQUANTIZE_ROUTE = "vLLM / SGLang fused GEMMs (they requantize a fused group to its largest scale at load)"


def share_fused_amax(load: Callable[[str], torch.Tensor], steps: Mapping[str, Step | None],
                     groups: Sequence[Sequence[str]], *, rule="auto", reexpress: bool, measure: bool = True
                     ) -> tuple[dict[str, Step], list[str]]:
    """The steps of fused-group members rewritten to quantize with the group's one amax, and a note
    per group that changed. ``load(name)`` reads a source tensor (each member once, here, and a
    copied member that keeps its own scale once more); ``steps``: tensor name → its planned step
    (None: not converted); ``rule``: ``fused=``. ``reexpress``: members copied exactly whose scale
    differs from the group's go to an export engines read: requantized with the group's amax where
    :func:`~te_serial.fusion.requantizes_copies`, else kept, with how far the engines'
    requantization moves them as a route of their report (``measure``: computed, which reads them
    again); without it they are left as they are."""
    shared = {n: s for n, s in steps.items() if s is not None and s.out_q is not None and s.out_q.takes_tensor_amax()}
    out: dict[str, Step] = {}
    notes: list[str] = []
    counts: dict[str, int] = {}  # group label → groups given one amax
    own_scales: dict[str, int] = {}  # group label → groups whose copied members keep their own scales
    for members in fused_groups(shared, groups):
        layouts = {shared[m].out_q.layout_key() for m in members}
        if len(layouts) != 1:
            notes.append(f"{', '.join(members)}: written in different formats; no shared scale")
            continue
        amax: dict[str, torch.Tensor] = {}
        scale: dict[str, torch.Tensor | None] = {}
        recorded: set[str] = set()  # members whose amax is the one their bytes were made with
        exact = {m for m in members if shared[m].builder == "exact" and not shared[m].requant}
        for m in members:
            src = load(m)
            scale[m] = _tensor_scale(src) if m in exact else None
            own = src.quantizer.recorded_tensor_amax(src.buffers()) \
                if isinstance(src, QuantizedTensorStorage) and m in exact else None
            if own is not None:
                recorded.add(m)
            amax[m] = own if own is not None else _amax(src)
            del src
        if exact == set(members) and all(scale[m] is not None for m in members) \
                and len({int(scale[m].view(torch.int32)) for m in members}) == 1:
            continue  # copied as they are, already one scale
        group_amax = torch.stack([amax[m].reshape(()) for m in members]).amax()
        q = shared[members[0]].out_q
        kept = [m for m in exact if m not in recorded and scale[m] is not None]
        if kept:  # per-tensor scales (no amax recorded): the largest member keeps its bytes, if an amax gives its scale
            top = max(kept, key=lambda m: float(scale[m]))
            a, found = solve_amax(scale[top], lambda a: _scale_for(q, a), amax[top])
            if found and bool(a >= group_amax):
                group_amax = a
        target = _scale_for(q, group_amax)
        label = "+".join(m.rsplit(".", 2)[-2] for m in members)
        changed = []
        keeps_own = False
        for m in members:
            step = shared[m]
            if m in exact:
                keeps = scale[m] is not None and torch.equal(scale[m].view(torch.int32), target.view(torch.int32))
                if keeps or not reexpress:
                    continue
                if not requantizes_copies(q, rule):  # the engine requantizes it at load: said per tensor
                    if measure:
                        change = _requantized_change(load(m), q, group_amax)
                        out[m] = dataclasses.replace(step, routes={**step.routes, ENGINE_REQUANTIZE_ROUTE: change})
                    keeps_own = True
                    continue
                out[m] = Step("requantize", step.out_q, step.out_dtype, builder="quantize",
                              tensor_amax=float(group_amax),
                              note=f"requantized with the fused group's shared amax ({label}: engines apply one "
                                   "tensor scale to the fused weight); its own scale differed")
                changed.append(m)
            else:
                note = (step.note + "; " if step.note else "") + f"fused group {label}: shared amax"
                out[m] = dataclasses.replace(step, tensor_amax=float(group_amax), note=note)
        if keeps_own:
            own_scales[label] = own_scales.get(label, 0) + 1
        if any(m not in exact for m in members) or changed:
            counts[label] = counts.get(label, 0) + 1
        if changed:
            notes.append(f"fused group {label} ({members[0].rsplit('.', 2)[0]}): {len(changed)} of {len(members)} "
                         f"requantized to the group's shared amax {float(group_amax):.6g}")
    if own_scales:
        notes.insert(0, "fused groups whose members keep their own tensor scales, as copied (" + ", ".join(
            f"{label} ×{n}" for label, n in own_scales.items()) + "): serving engines requantize a fused group's members "
            "to its largest scale at load (vLLM / SGLang requantize_with_max_scale); each member's figure is in its "
            "routes; fused='shared' requantizes them here instead")
    if counts:
        notes.insert(0, "fused groups quantized with one shared amax each (serving engines apply one tensor scale "
                        "per fused GEMM): " + ", ".join(f"{label} ×{n}" for label, n in counts.items()))
    return out, notes


def _requantized_change(src: torch.Tensor, q: Quantizer, amax: torch.Tensor) -> float:
    """The largest change of a value of ``src`` requantized in ``q`` with the tensor amax ``amax``:
    what an engine's requantization to a fused group's scale does to a member copied with its own
    (te-serial's requantization, which ``fused="shared"`` writes)."""
    x = values(src)
    again = q.set_usage(rowwise=True, columnwise=False).quantize(x, tensor_amax=amax, eager=True)
    return float(nx.nan_ignoring_amax(values(again) - x))

