"""Activation amax from a calibration pass, for the static activation scales of serving exports.

::

    with ActivationAmax(model) as cal:          # hooks every nn.Linear (or ``modules=`` types)
        for batch in calibration_data:
            model(batch)
    cal.save("amax.json")                       # {module name: max |input|}
    te_serial.convert(ckpt, out, recipe="modelopt_nvfp4", activation_amax="amax.json")

MoE experts held as 3-D parameters (transformers 5's experts modules) are recorded per expert,
under the names exports give them (``te_serial.moe``: ``mlp.experts.<i>.gate_proj`` …): the gate
and up projections' input is what the router sends expert ``i``; the down projection's is that
expert's activated intermediate, recomputed in fp32 from the module's own weights and gate.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch


def _experts_module(m: torch.nn.Module) -> bool:
    """A transformers 5 experts module (``use_experts_implementation``: 3-D expert parameters)."""
    return all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed", "_apply_gate", "num_experts"))


class ActivationAmax:
    """Record max |input| of each matching module over the forward passes run inside the block."""

    def __init__(self, model: torch.nn.Module, modules: tuple[type, ...] = (torch.nn.Linear,)) -> None:
        self.model, self.types = model, modules
        self.amax: dict[str, float] = {}
        self._hooks: list = []

    def __enter__(self) -> "ActivationAmax":
        from ..fusion import architecture_of
        cfg = getattr(self.model, "config", None)
        arch = architecture_of(cfg.to_dict() if callable(getattr(cfg, "to_dict", None)) else None) \
            or type(self.model).__name__
        for name, m in self.model.named_modules():
            if isinstance(m, self.types):
                self._hooks.append(m.register_forward_pre_hook(self._hook(name)))
            elif _experts_module(m):
                self._hooks.append(m.register_forward_hook(self._experts_hook(name, arch), with_kwargs=True))
        return self

    def _note(self, name: str, x: torch.Tensor) -> None:
        """An expert's amax; none for an expert that saw only zeros (exports give it its layer's)."""
        a = float(torch.nan_to_num(x.abs(), nan=0.0).amax()) if x.numel() else 0.0
        if math.isfinite(a) and a > 0:
            self.amax[name] = max(self.amax.get(name, 0.0), a)

    def _experts_hook(self, name: str, arch: str):
        """Per expert: the input the router sends it (gate / up), and its activated intermediate (down)."""
        from ..moe import expert_module_names

        def record(module, args, kwargs, output):
            given = list(args) + list(kwargs.values())
            if len(given) < 2 or not all(isinstance(t, torch.Tensor) for t in given[:2]):
                return
            x = given[0].detach().reshape(-1, given[0].shape[-1]).float()
            index = given[1].detach().reshape(x.shape[0], -1)
            with torch.no_grad():
                for e in torch.unique(index).tolist():
                    names = expert_module_names(name, int(e), arch) if 0 <= e < module.num_experts else None
                    if names is None:
                        continue
                    h = x[(index == e).any(-1)]
                    w = (module.gate_up_proj if module.has_gate else module.up_proj)[e].float()
                    proj = h @ w if module.is_transposed else h @ w.t()
                    if module.has_bias:
                        proj = proj + (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[e].float()
                    mid = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)
                    for n in names[:2]:
                        self._note(n, h)
                    self._note(names[2], mid)
        return record

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
