"""Hand weights to a serving engine without writing a checkpoint: :func:`export_tensors`.

An RL trainer syncs its policy into vLLM (``model.load_weights(weights)``) or SGLang
(``update_weights_from_tensor``) every few steps. ``export_tensors`` yields exactly what
``convert(..., recipe=layout)`` writes into the files — the engine's tensor names and layout,
fused groups (q/k/v, gate/up) quantized with one tensor scale — one tensor at a time, from a model
in memory or any checkpoint te-serial reads. A file export is this stream with a sink.

>>> import te_serial as ts
>>> for name, t in ts.export_tensors(model, layout="modelopt_nvfp4"):     # doctest: +SKIP
...     engine_model.load_weights([(name, t)])
"""

from __future__ import annotations

import os
import warnings
from typing import Iterator, Mapping, Sequence

import torch

from .conversion.core import check_fused_scales, export_buffers, plan_conversion, share_fused_scales
from .conversion.layouts.base import prefix
from .conversion.sources import ModuleSource, open_source, split_experts
from .conversion.transforms import execute, values
from .errors import ConversionError

__all__ = ["export_tensors"]


def export_tensors(model_or_ckpt: torch.nn.Module | Mapping[str, torch.Tensor] | str | os.PathLike, layout: str, *,
                   rules: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
                   activations: str | None = "auto", activation_amax: Mapping[str, float] | None = None,
                   fused: str | Sequence[Sequence[str]] | None = "auto", dtype: torch.dtype = torch.bfloat16,
                   bucket_bytes: int | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]] | Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``(name, tensor)`` in a serving layout's names and layout (``modelopt_nvfp4``,
    ``compressed_tensors_fp8`` … : :data:`te_serial.conversion.TARGETS`), the tensors
    ``convert(..., recipe=layout)`` would write, with the same ``rules``, ``activations``,
    ``activation_amax`` and ``fused`` (see :func:`te_serial.convert`).

    ``model_or_ckpt``: an ``nn.Module`` (its te-serial quantized and plain parameters and buffers),
    a state dict, or a checkpoint path. Each tensor is converted when it is asked for, so memory
    holds one tensor's outputs at a time; ``bucket_bytes`` yields lists of pairs of up to that many
    bytes instead (what ``update_weights_from_tensor`` takes), one list per tensor larger than it.
    NVFP4 members of a fused group copied with unequal scales (per-tensor FP8 ones too with
    ``fused="shared"``) are requantized with the group's (a warning says which); the values are
    never checked against the source here (``convert`` does that).
    """
    source = ModuleSource(model_or_ckpt) if isinstance(model_or_ckpt, (torch.nn.Module, Mapping)) \
        else open_source(model_or_ckpt, dtype=dtype)
    with source:
        src = split_experts(source)
        family, spec, plans = plan_conversion(src, recipe=layout, rules=rules, dtype=dtype,
                                              activations=activations, activation_amax=activation_amax, fused=fused)
        if spec is None:
            raise ConversionError(f"{layout!r} is not a serving layout; export_tensors writes the layouts engines "
                                  "load (modelopt_*, compressed_tensors_*, deepseek_fp8)", field="layout")
        for note in share_fused_scales(src, plans, fused, spec, measure=False):  # no report to give figures in
            if "requantized" in note:
                warnings.warn(f"te-serial: {note}", stacklevel=2)
        shared: dict[str, dict[str, torch.Tensor]] = {}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for plan in plans:
            t = src.load(plan.name)
            out, _ = execute(plan.step, t, lambda t=t: values(t))
            blobs = export_buffers(family, plan.name, out, spec)
            del t, out
            if plan.name in spec.schemes:  # never hand an engine a fused group with unequal scales
                keys = spec.shared_scale_keys(plan.name, plan.step.out_q)
                shared[plan.name] = {k: blobs[prefix(plan.name) + k] for k in keys if prefix(plan.name) + k in blobs}
                for note in check_fused_scales(spec, shared, only=plan.name):
                    warnings.warn(f"te-serial: {note}", stacklevel=2)
            for name, tensor in blobs.items():
                if bucket_bytes is None:
                    yield name, tensor
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
        if bucket:
            yield bucket
