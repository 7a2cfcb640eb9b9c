"""Models: quantize on the meta device, plan memory, materialize, and load straight from a checkpoint.

``load_into`` replaces each parameter and buffer named in a checkpoint by the checkpoint's tensor,
built through its ``TensorProto`` on the target device (on CPU: the file's mmap'd pages, no copy;
elsewhere: one copy into buffers allocated from the prototype) — the high-precision weight never
exists. Tied parameters stay one object.
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import torch
from torch import nn

from .errors import CheckpointError, ShapeError
from .formats.base import QuantizedTensorStorage, Quantizer
from .precision import stays_high_precision
from .proto import TensorProto, to_tensor_proto
from .recipes import recipe_quantizer

__all__ = ["load_into", "quantize_model", "materialize", "plan", "Plan", "LoadResult"]

class LoadResult(NamedTuple):
    """What ``load_into(..., strict=False)`` returns, in the manner of ``load_state_dict``."""

    model: nn.Module
    missing_keys: list[str]
    unexpected_keys: list[str]


def _slots(model: nn.Module, non_persistent: bool = False) -> dict[str, tuple[nn.Module, str, bool, Any]]:
    """name → (owning module, attribute, is_parameter, current tensor) for every param and
    (persistent) buffer, tied duplicates included (one tensor object under each of its names)."""
    out = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for pname, p in module._parameters.items():
            if p is not None:
                out[prefix + pname] = (module, pname, True, p)
        for bname, b in module._buffers.items():
            if b is not None and (non_persistent or bname not in module._non_persistent_buffers_set):
                out[prefix + bname] = (module, bname, False, b)
    return out


def _set(module: nn.Module, attr: str, is_param: bool, value: torch.Tensor, requires_grad: bool) -> Any:
    if is_param:
        value = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=requires_grad)
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value
    return value


def load_into(model: nn.Module, path: str | os.PathLike, *, device: str | torch.device = "cpu",
              strict: bool = True, assign: bool = True, verify: bool = False):
    """Fill ``model`` (built on ``meta`` or anywhere) from a te-serial checkpoint, on ``device``.

    Quantized weights become ``nn.Parameter``s wrapping te-serial quantized tensors with the
    saved ``requires_grad``. Shapes must agree (a checkpoint for another architecture is refused,
    naming every mismatch). ``strict=True`` refuses missing or unexpected keys and returns the
    model; ``strict=False`` returns ``LoadResult(model, missing_keys, unexpected_keys)``.
    ``assign=False`` copies into the existing (non-meta) tensors instead of replacing them.
    """
    from .checkpoint import open_checkpoint
    device = torch.device(device)
    slots = _slots(model)
    with open_checkpoint(path) as ckpt:
        protos = ckpt.protos
        # names that share one tensor in the model count as present when any of them is saved
        groups: dict[int, list[str]] = {}
        for name, (_, _, _, t) in slots.items():
            groups.setdefault(id(t), []).append(name)
        missing = [n for n in slots if n not in protos and not any(a in protos for a in groups[id(slots[n][3])])]
        unexpected = [n for n in protos if n not in slots]
        mismatched = [f"{n}: checkpoint {list(protos[n].shape)} vs model {list(slots[n][3].shape)}"
                      for n in slots if n in protos and tuple(protos[n].shape) != tuple(slots[n][3].shape)]
        if mismatched:
            raise CheckpointError("checkpoint does not fit this model; size mismatch for "
                                  + "; ".join(mismatched[:20]) + (" …" if len(mismatched) > 20 else ""),
                                  file=str(path))
        if strict and (missing or unexpected):
            raise CheckpointError(f"missing keys {missing[:20]}, unexpected keys {unexpected[:20]} "
                                  "(strict=False to load what matches)", file=str(path))
        wanted = [n for n in slots if n in protos]
        loaded = ckpt.load_tensors(wanted, device=device, verify=verify)
    done: dict[int, Any] = {}  # original tensor id → new tensor, so tied slots stay one object
    for name in wanted:
        module, attr, is_param, old = slots[name]
        if id(old) in done:
            (module._parameters if is_param else module._buffers)[attr] = done[id(old)]
            continue
        new = loaded[name]
        if not assign and old.device.type != "meta":
            with torch.no_grad():
                old.copy_(new)
            done[id(old)] = old
            continue
        done[id(old)] = _set(module, attr, is_param, new, protos[name].requires_grad)
    for name, (module, attr, is_param, old) in slots.items():  # tied partners of loaded names
        if name not in protos and id(old) in done:
            (module._parameters if is_param else module._buffers)[attr] = done[id(old)]
    missing = [n for n in missing if id(slots[n][3]) not in done]
    return model if strict else LoadResult(model, missing, unexpected)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantize_model(model: nn.Module, recipe: str | Quantizer, *, include: Sequence[str] = ("*",),
                   exclude: Sequence[str] | None = None, module_types: tuple[type, ...] = (nn.Linear,),
                   columnwise: bool | None = None) -> nn.Module:
    """Replace the weights of matching modules by quantized parameters, in place; returns the model.

    Modules are chosen by type (``nn.Linear`` by default) and by glob patterns on their qualified
    names. By default (``exclude=None``) the weights :func:`te_serial.precision.stays_high_precision`
    keeps — embeddings, output heads, norms, MoE routers; the rule ``convert`` uses — stay as they
    are; ``exclude`` patterns (on module names) replace that rule. ``recipe`` is a name from
    :data:`te_serial.recipes.RECIPES` or a quantizer; ``columnwise`` (default:
    ``torch.is_grad_enabled()``, as TE does) adds the transposed usage needed for training. On a
    meta model the parameters become meta quantized tensors: prototypes only, for :func:`plan`.
    Weights whose shape the recipe cannot hold are left alone with a warning.
    """
    col = torch.is_grad_enabled() if columnwise is None else columnwise
    q = recipe if isinstance(recipe, Quantizer) else recipe_quantizer(recipe, rowwise=True, columnwise=col)
    done: dict[int, nn.Parameter] = {}
    for mname, module in model.named_modules():
        if not isinstance(module, module_types) or not _matches(mname, include):
            continue
        w = module._parameters.get("weight")
        if w is None or isinstance(w, QuantizedTensorStorage):
            continue
        if exclude is None:
            if stays_high_precision(f"{mname}.weight" if mname else "weight", tuple(w.shape)):
                continue
        elif _matches(mname, exclude):
            continue
        if id(w) in done:  # tied with a weight already quantized
            module._parameters["weight"] = done[id(w)]
            continue
        try:
            q.check_shape(tuple(w.shape))
        except ShapeError as e:
            warnings.warn(f"te-serial: {mname}.weight left unquantized: {e}", stacklevel=2)
            continue
        if w.device.type == "meta":
            qt = TensorProto(tuple(w.shape), w.dtype, q, w.requires_grad, w.device).create_tensor()
        else:
            qt = q.quantize(w.detach())
        done[id(w)] = module._parameters["weight"] = nn.Parameter(qt, requires_grad=w.requires_grad)
    return model


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give every meta parameter and buffer uninitialized storage on ``device``, quantized ones
    allocated from their prototypes (for training from scratch with quantized primary weights)."""
    device = torch.device(device)
    done: dict[int, Any] = {}
    for name, (module, attr, is_param, t) in _slots(model, non_persistent=True).items():
        if t.device.type != "meta":
            continue
        if id(t) not in done:
            proto = to_tensor_proto(t)
            made = proto.create_tensor(device=device)
            done[id(t)] = _set(module, attr, is_param, made, t.requires_grad)
        else:
            (module._parameters if is_param else module._buffers)[attr] = done[id(t)]
    return model


@dataclass
class Plan:
    """Bytes per parameter/buffer (tied ones once) and totals, by format."""

    rows: list[tuple[str, tuple[int, ...], str, int]] = field(default_factory=list)  # name, shape, kind, bytes

    @property
    def total_bytes(self) -> int:
        return sum(r[3] for r in self.rows)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, _, kind, n in self.rows:
            out[kind] = out.get(kind, 0) + n
        return out

    def __str__(self) -> str:
        lines = [f"{'name':<48}{'shape':<20}{'format':<22}{'bytes':>14}"]
        lines += [f"{n:<48}{str(list(s)):<20}{k:<22}{b:>14,}" for n, s, k, b in self.rows]
        lines.append(f"{'total':<90}{self.total_bytes:>14,}")
        lines += [f"  {k:<88}{v:>14,}" for k, v in self.by_kind().items()]
        return "\n".join(lines)


def plan(model: nn.Module, recipe: str | Quantizer | None = None, **quantize_kwargs) -> Plan:
    """Memory the model's parameters and buffers take, from their prototypes (no data needed).

    With ``recipe``, the estimate is for the model as :func:`quantize_model` would leave it, without
    changing the model.
    """
    if recipe is not None:
        meta = _meta_copy(model)
        quantize_model(meta, recipe, **quantize_kwargs)
        return plan(meta)
    out = Plan()
    seen: set[int] = set()
    for name, (_, _, _, t) in _slots(model).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        proto = to_tensor_proto(t)
        kind = proto.quantizer.kind if proto.quantizer is not None else str(proto.dtype).replace("torch.", "")
        out.rows.append((name, proto.shape, kind, proto.nbytes))
    return out


def _meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose tensors are meta (for estimates), ties kept."""
    import copy
    memo: dict[int, Any] = {}
    for _, (_, _, is_param, t) in _slots(model).items():
        if id(t) not in memo:
            meta = to_tensor_proto(t).create_tensor(device="meta") if isinstance(t, QuantizedTensorStorage) \
                else torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta
    return copy.deepcopy(model, memo)
