"""Activation amax from a calibration pass, for the static activation scales of serving exports.

::

    with ActivationAmax(model) as cal:          # hooks every nn.Linear (or ``modules=`` types)
        for batch in calibration_data:
            model(batch)
    cal.save("amax.json")                       # {module name: max |input|}
    te_serial.convert(ckpt, out, recipe="modelopt_nvfp4", activation_amax="amax.json")
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch


class ActivationAmax:
    """Record max |input| of each matching module over the forward passes run inside the block."""

    def __init__(self, model: torch.nn.Module, modules: tuple[type, ...] = (torch.nn.Linear,)) -> None:
        self.model, self.types = model, modules
        self.amax: dict[str, float] = {}
        self._hooks: list = []

    def __enter__(self) -> "ActivationAmax":
        for name, m in self.model.named_modules():
            if isinstance(m, self.types):
                self._hooks.append(m.register_forward_pre_hook(self._hook(name)))
        return self

    def _hook(self, name: str):
        def record(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.numel():
                a = float(torch.nan_to_num(x.detach().float().abs(), nan=0.0).amax())
                if math.isfinite(a):
                    self.amax[name] = max(self.amax.get(name, 0.0), a)
        return record

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(dict(sorted(self.amax.items())), indent=1) + "\n", encoding="utf-8")
