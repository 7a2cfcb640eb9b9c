"""One tensor scale per fused group: the pass ``convert`` and ``load_into`` run before quantizing.

A serving engine fuses q/k/v (gate/up, …: :mod:`te_serial.fusion`) into one GEMM with one
tensor-wide scale. So the members of a group that are quantized with a tensor-wide scale
(per-tensor FP8 current scaling, NVFP4's global scale: ``Quantizer.takes_tensor_amax``) take the
group's largest amax. Members quantized from high-precision values simply get it. Members copied
exactly from a quantized source keep their bytes where their scale already is the group's (a
recorded amax that is the largest; per-tensor FP8, which records none: the largest scale, the
group's amax then being one that gives it); into a serving layout (``reexpress``) the others are
requantized from their values with the shared amax: lossy unless the values come out
bit-identical, and the report says so per tensor.
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
from ..fusion import fused_groups
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


def share_fused_amax(load: Callable[[str], torch.Tensor], steps: Mapping[str, Step | None],
                     groups: Sequence[Sequence[str]], *, reexpress: bool) -> tuple[dict[str, Step], list[str]]:
    """The steps of fused-group members rewritten to quantize with the group's one amax, and a note
    per group that changed. ``load(name)`` reads a source tensor (each member once, here); ``steps``:
    tensor name → its planned step (None: not converted). ``reexpress``: requantize members copied
    exactly whose scale differs from the group's (an export engines read), else leave them as they are."""
    shared = {n: s for n, s in steps.items() if s is not None and s.out_q is not None and s.out_q.takes_tensor_amax()}
    out: dict[str, Step] = {}
    notes: list[str] = []
    counts: dict[str, int] = {}  # group label → groups given one amax
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
        for m in members:
            step = shared[m]
            if m in exact:
                keeps = scale[m] is not None and torch.equal(scale[m].view(torch.int32), target.view(torch.int32))
                if keeps or not reexpress:
                    continue
                out[m] = Step("requantize", step.out_q, step.out_dtype, builder="quantize",
                              tensor_amax=float(group_amax),
                              note=f"requantized with the fused group's shared amax ({label}: engines apply one "
                                   "tensor scale to the fused weight); its own scale differed")
                changed.append(m)
            else:
                note = (step.note + "; " if step.note else "") + f"fused group {label}: shared amax"
                out[m] = dataclasses.replace(step, tensor_amax=float(group_amax), note=note)
        counts[label] = counts.get(label, 0) + 1
        if changed:
            notes.append(f"fused group {label} ({members[0].rsplit('.', 2)[0]}): {len(changed)} of {len(members)} "
                         f"requantized to the group's shared amax {float(group_amax):.6g}")
    if counts:
        notes.insert(0, "fused groups quantized with one shared amax each (serving engines apply one tensor scale "
                        "per fused GEMM): " + ", ".join(f"{label} ×{n}" for label, n in counts.items()))
    return out, notes
