"""Models: quantize on the meta device, plan memory, materialize, and load straight from a checkpoint.

``load_into`` fills a model (built on ``meta`` or anywhere) from any checkpoint te-serial reads:
a te-serial checkpoint, plain or sharded Hugging Face safetensors, DeepSeek-V3 block FP8 or
compressed-tensors FP8. Each tensor ends as the model declares it: a parameter that
:func:`quantize_model` gave a quantized prototype gets that format (converted on the fly by the
per-tensor step :func:`te_serial.convert` runs, one tensor in memory at a time, with the same
report), a plain one the model's dtype. A tensor already in the model's format is read straight
into place through its ``TensorProto`` (on CPU: the file's mmap'd pages, no copy; elsewhere: one
copy into buffers allocated from the prototype) — the high-precision weight never exists. Tied
parameters stay one object.

Whatever is still on ``meta`` afterwards (non-persistent buffers such as rotary ``inv_freq``,
keys a non-strict load skipped) is allocated on the device and initialized the way transformers
does it — the model's ``_init_weights`` (Hugging Face models), else the module's own
``reset_parameters``, or a hook the caller passes — while everything loaded hides behind meta
stand-ins, so no initializer can touch it; what none of them writes is an error naming it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

from .checkpoint.writer import save_quantized
from .errors import (CheckpointError, ConversionError, FormatError, ShapeError, TeSerialError,
                     UnsupportedOperationError)
from . import fusion
from . import numerics as nx
from .formats.tensors import NOMINAL_DTYPES, QuantizedTensorStorage
from .formats.base import Quantizer
from .precision import is_expert_weight, stays_high_precision
from .proto import TensorProto, to_tensor_proto
from .recipes import recipe_quantizer

InitFn = Callable[[nn.Module], Any]


class LoadResult(NamedTuple):
    """What ``load_into(..., strict=False)`` returns, in the manner of ``load_state_dict``, with the
    per-tensor :class:`~te_serial.ConversionReport` (``convert``'s)."""

    model: nn.Module
    missing_keys: list[str]
    unexpected_keys: list[str]
    report: Any = None


def tensor_slots(model: nn.Module, non_persistent: bool = False) -> dict[str, tuple[nn.Module, str, bool, Any]]:
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
        if isinstance(value, nn.Parameter) and value.requires_grad == requires_grad:
            pass
        else:
            grad = requires_grad and (value.is_floating_point() or isinstance(value, QuantizedTensorStorage))
            value = nn.Parameter(value.detach(), requires_grad=grad)
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value
    return value


def with_nominal(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized tensor with nominal ``dtype`` over the same buffers (no copy)."""
    if isinstance(t, QuantizedTensorStorage) and t.dtype != dtype and dtype in NOMINAL_DTYPES:
        return t._rebuild(t.buffers(), fake_dtype=dtype)
    return t


# --- Hugging Face models ---------------------------------------------------------------------------

def _is_hf(model: nn.Module) -> bool:
    return getattr(model, "config", None) is not None and callable(getattr(model, "save_pretrained", None))


def model_config_dict(model: nn.Module) -> dict | None:
    """The Hugging Face model's config as a dict (for its ``architectures``), else None."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def _tie_hf(model: nn.Module) -> None:
    """Tie what the model's config ties, as ``from_pretrained`` does: accelerate's
    ``init_empty_weights`` leaves transformers 5's ``lm_head`` untied on meta."""
    if _is_hf(model) and callable(getattr(model, "tie_weights", None)):
        model.tie_weights()


def _hf_ignored(model: nn.Module, names: list[str], which: str) -> list[str]:
    """``names`` less those the model's ``_keys_to_ignore_on_load_<which>`` patterns cover (and, for
    unexpected keys, old checkpoints' rotary ``inv_freq``), as ``from_pretrained`` leaves them out."""
    if not _is_hf(model):
        return names
    patterns = list(getattr(model, f"_keys_to_ignore_on_load_{which}", None) or [])
    if which == "unexpected":
        patterns.append(r"rotary_emb\.inv_freq$")
    if not patterns:
        return names
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    return [n for n in names if rx.search(n) is None]


def _te_serial_save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *args,
                               max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                               is_main_process: bool = True, push_to_hub: bool = False, **kwargs):
    """``save_pretrained`` of a model holding te-serial tensors: a te-serial checkpoint directory
    (``save_quantized``: shards of at most ``max_shard_size``, the manifest, ``config.json`` with
    its ``quantization_config``, the weight index ``from_pretrained`` reads through
    ``te_serial.hf``) plus ``generation_config.json``. A model without them saves as transformers
    does. ``push_to_hub`` goes through this method too (transformers' ``push_to_hub`` calls it)."""
    quantized = [n for n, p in self.named_parameters() if isinstance(p, QuantizedTensorStorage)]
    if not quantized:
        return type(self).save_pretrained(self, save_directory, *args, max_shard_size=max_shard_size,
                                          safe_serialization=safe_serialization, is_main_process=is_main_process,
                                          push_to_hub=push_to_hub, **kwargs)
    if not safe_serialization:
        raise UnsupportedOperationError("safe_serialization=False would pickle; te-serial writes safetensors "
                                        "buffers and a msgpack manifest only")
    if push_to_hub:
        raise UnsupportedOperationError("save_pretrained(push_to_hub=True) of a te-serial model: call "
                                        "model.push_to_hub(repo_id), which saves through this method and uploads")
    unknown = sorted(set(kwargs) - _HF_SAVE_OPTIONS)
    if unknown or args:
        raise UnsupportedOperationError(f"save_pretrained of a te-serial model takes save_directory, "
                                        f"max_shard_size and safe_serialization; got {unknown or list(args)}")
    if not is_main_process:
        return None
    save_quantized(self, save_directory, max_shard_size=max_shard_size)
    generation = getattr(self, "generation_config", None)
    can_generate = getattr(self, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(save_directory)
    return None


#: transformers' save_pretrained options a te-serial save has no use for (the hub token: uploads are
#: push_to_hub's)
_HF_SAVE_OPTIONS = frozenset({"token"})


def guard_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` write a te-serial checkpoint while the model holds te-serial
    tensors (transformers would fail on their storage with an unrelated message)."""
    if _is_hf(model) and "save_pretrained" not in model.__dict__:
        model.__dict__["save_pretrained"] = types.MethodType(_te_serial_save_pretrained, model)


# --- what is left on meta -------------------------------------------------------------------------

def _sentinel(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).max


def _standin(v: Any, is_param: bool) -> Any:
    """A meta tensor of ``v``'s shape and dtype (quantized: its nominal dtype): initializers run on
    it as on the real one and write nothing."""
    m = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return nn.Parameter(m, requires_grad=v.requires_grad) if is_param else m


def _written(slot_value: Any, fresh: torch.Tensor, version: int) -> bool:
    """Did an initializer write the tensor we put in the slot (or put a real one there)?"""
    if slot_value is not fresh:
        return isinstance(slot_value, torch.Tensor) and slot_value.device.type != "meta"
    if fresh._version != version:
        return True
    sentinel = _sentinel(fresh.dtype)
    if sentinel is None:  # bool: writes through .data go unseen
        return False
    with torch.no_grad():
        d = fresh.detach()
        return not bool((torch.isnan(d) if sentinel != sentinel else d == sentinel).all())


def _initializers(model: nn.Module, init_fn: InitFn | None) -> dict[int, list[tuple[str, InitFn]]]:
    """id(module) → the initializers to try, in order: the caller's hook, the nearest enclosing
    Hugging Face model's ``_init_weights`` (what ``from_pretrained`` runs for missing keys and
    non-persistent buffers), the module's own ``reset_parameters``."""
    out: dict[int, list[tuple[str, InitFn]]] = {}

    def walk(module: nn.Module, owner: nn.Module | None) -> None:
        if callable(getattr(module, "_init_weights", None)) and getattr(module, "config", None) is not None:
            owner = module
        chain: list[tuple[str, InitFn]] = []
        if init_fn is not None:
            chain.append(("init_fn", init_fn))
        if owner is not None:
            chain.append((f"{type(owner).__name__}._init_weights", owner._init_weights))
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            chain.append((f"{type(module).__name__}.reset_parameters", lambda m, reset=reset: reset()))
        out.setdefault(id(module), chain)
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return out


def _fill_meta(model: nn.Module, device: torch.device, init_fn: InitFn | None) -> list[str]:
    """Allocate every tensor still on meta on ``device`` and initialize it (see the module
    docstring); quantized prototypes are initialized in their nominal dtype, then quantized.
    Returns the names filled; raises naming what no initializer wrote."""
    slots = tensor_slots(model, non_persistent=True)
    pending: dict[int, list[str]] = {}
    for name, (_, _, _, t) in slots.items():
        if t.device.type == "meta":
            pending.setdefault(id(t), []).append(name)
    if not pending:
        return []
    chains = _initializers(model, init_fn)
    # loaded (and already initialized) tensors hide behind meta stand-ins while initializers run,
    # so a reset_parameters that recurses, or an init that writes .data, touches none of them
    hidden: list[tuple[dict, str, Any]] = []
    standins: dict[int, Any] = {}
    for module in model.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for k, v in store.items():
                if v is None or v.device.type == "meta":
                    continue
                hidden.append((store, k, v))
                if id(v) not in standins:
                    standins[id(v)] = _standin(v, is_param)
                store[k] = standins[id(v)]
    done: dict[int, Any] = {}
    failed: dict[str, str] = {}
    try:
        owners: dict[int, tuple[nn.Module, list]] = {}
        claimed: set[int] = set()  # a tied tensor is allocated and initialized at its first owner
        for name, (module, attr, is_param, t) in slots.items():
            if t.device.type == "meta" and id(t) not in claimed:
                claimed.add(id(t))
                owners.setdefault(id(module), (module, []))[1].append((attr, is_param, t, name))
        for module, items in reversed(list(owners.values())):  # children before their parents
            fresh = {}
            for attr, is_param, t, name in items:
                sentinel = _sentinel(t.dtype)
                hp = torch.empty(t.shape, dtype=t.dtype, device=device)
                if sentinel is not None:
                    hp.fill_(sentinel)
                value = nn.Parameter(hp, requires_grad=t.requires_grad) if is_param else hp
                store = module._parameters if is_param else module._buffers
                store[attr] = value
                fresh[attr] = (store, value, value._version, t, name)
            left = dict(fresh)
            for label, fn in chains.get(id(module), []):
                with torch.no_grad():
                    fn(module)
                for attr, (store, value, version, t, name) in list(left.items()):
                    now = store.get(attr)
                    if _written(now, value, version):
                        is_param = store is module._parameters
                        if isinstance(t, QuantizedTensorStorage):  # initialized in its nominal dtype: quantize now
                            q = t.quantizer.quantize(now.detach(), fake_dtype=t.dtype)
                            now = nn.Parameter(q, requires_grad=t.requires_grad) if is_param else q
                        done[id(t)] = now
                        store[attr] = _standin(now, is_param)  # out of the next initializer's reach
                        del left[attr]
                if not left:
                    break
            for attr, (store, value, version, t, name) in left.items():
                store[attr] = t
                kind = "parameter" if store is module._parameters else (
                    "non-persistent buffer" if attr in module._non_persistent_buffers_set else "buffer")
                tried = ", ".join(lbl for lbl, _ in chains.get(id(module), [])) or "no initializer found"
                failed[name] = f"{name} ({type(module).__name__} {kind}; tried: {tried})"
    finally:
        for store, k, v in hidden:
            store[k] = v
    for key, value in done.items():
        for n in pending[key]:
            m, a, p, _ = slots[n]
            (m._parameters if p else m._buffers)[a] = value
    if failed:
        raise CheckpointError(
            "tensors left on the meta device that nothing initializes: " + "; ".join(failed.values())
            + ". Pass init_fn=callable(module) that fills them, give the module a reset_parameters(), "
            "build the model with buffers off meta (accelerate's init_empty_weights() keeps buffers real), "
            "or save them in the checkpoint")
    return [n for key in done for n in pending[key]]


def _move_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Real non-persistent buffers (e.g. built under accelerate's ``init_empty_weights``) follow the
    load to ``device``, as ``from_pretrained`` moves them."""
    for name, (module, attr, is_param, t) in tensor_slots(model, non_persistent=True).items():
        if is_param or attr not in module._non_persistent_buffers_set or t.device.type == "meta":
            continue
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            module._buffers[attr] = t.to(device)


# --- loading --------------------------------------------------------------------------------------

#: source tensors from this size on give the heap back after their conversion (see _trim_heap)
_TRIM_BYTES = 1 << 20
_LIBC: list = []


def _trim_heap() -> None:
    """Return the freed pages of one tensor's conversion to the OS (glibc ``malloc_trim``): its
    temporaries sit between the long-lived quantized buffers, and unreturned they add up over a
    model's worth of tensors. A no-op where glibc is not the allocator."""
    if not _LIBC:
        try:
            import ctypes
            _LIBC.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](0)


def _choose(st, old: Any, derive_usages: bool) -> tuple[Any, str | None]:
    """(step or None for "take the source tensor as it is", usage-mismatch message or None) for
    source tensor ``st`` going into the model's tensor ``old``."""
    from .conversion.transforms import plan_plain, plan_te
    p = st.quantizer
    dtype = old.dtype
    slot_q = old.quantizer if isinstance(old, QuantizedTensorStorage) else None
    if slot_q is None:
        if p is not None or st.dtype == dtype or not (st.dtype.is_floating_point and dtype.is_floating_point):
            return None, None  # same dtype, or a quantized tensor replacing a plain weight
        return plan_plain(None, st.dtype, dtype), None  # cast to the model's dtype
    if p is None:
        return plan_te(None, slot_q, dtype, st.dtype), None  # quantize on load
    if p.same_layout(slot_q):
        have, want = set(p.conversion_usages()), set(slot_q.conversion_usages())
        if have == want:
            return None, None
        lacking = sorted(want - have)
        if not lacking:  # the checkpoint holds more usages: take the model's, exactly
            return _nominal(plan_te(p, slot_q, dtype, st.dtype), dtype), None
        step = plan_te(p, slot_q, dtype, st.dtype)
        if derive_usages and step.exact and not step.requant:
            return _nominal(step, dtype), None
        why = ("derive_usages=True builds it exactly from the checkpoint's bytes"
               if step.exact and not step.requant else "it cannot be derived exactly from the checkpoint's bytes")
        msg = (f"{st.name}: the checkpoint holds {'+'.join(sorted(have))}, the model's prototype also "
               f"{' and '.join(lacking)} ({why}; or quantize_model(..., columnwise={'columnwise' not in want}))")
        return None, msg
    return _nominal(plan_te(p, slot_q, dtype, st.dtype), dtype), None  # another format: converted


def _nominal(step, dtype: torch.dtype):
    return dataclasses.replace(step, out_dtype=dtype) if dtype in NOMINAL_DTYPES else step


def _slices(found, names, shard_fn, path) -> dict[str, tuple[Any, Any, tuple[int, ...]]]:
    """name → (rows, cols, shape of the slice) for the tensors ``shard_fn`` slices."""
    from .formats.slicing import range_bounds
    out = {}
    for name in names:
        st = found[name]
        spec = shard_fn(name, st.proto)
        if spec is None:
            continue
        if not isinstance(spec, dict) or not spec or set(spec) - {"rows", "cols"}:
            raise CheckpointError(f"shard_fn must return None or a dict with 'rows' and/or 'cols', got {spec!r}",
                                  file=str(path), tensor=name)
        shape = tuple(st.shape)
        if not shape:
            raise CheckpointError("a 0-d tensor cannot be sliced", file=str(path), tensor=name)
        m, k = math.prod(shape[:-1]), shape[-1]
        rows, cols = spec.get("rows"), spec.get("cols")
        r0, r1 = range_bounds(rows, m, 1, "rows")
        c0, c1 = range_bounds(cols, k, 1, "cols")
        out[name] = (rows, cols, (*shape[:-1], c1 - c0) if rows is None else (r1 - r0, c1 - c0))
    return out


def load_into(model: nn.Module, path: str | os.PathLike, *, device: str | torch.device = "cpu",
              strict: bool = True, assign: bool = True, verify: bool = False, init_fn: InitFn | None = None,
              derive_usages: bool = False, report: str | os.PathLike | None = None, shard_fn=None,
              fused: str | Sequence[Sequence[str]] | None = "auto"):
    """Fill ``model`` (built on ``meta`` or anywhere) from the checkpoint at ``path``, on ``device``.

    ``path``: any layout te-serial reads — a te-serial checkpoint, a plain or sharded Hugging
    Face safetensors directory (or file), DeepSeek-V3 block FP8, compressed-tensors FP8.

    Each tensor comes out as the model declares it: where :func:`quantize_model` left a quantized
    prototype, in that format (a source in another format or in high precision is converted on
    the fly, streaming, by the step :func:`te_serial.convert` runs; lossless where an exact path
    exists, else lossy, as the report says); a plain parameter in the model's dtype; a quantized
    source tensor for a plain parameter replaces it as it is. Quantized parameters keep the
    prototype's ``requires_grad`` (what ``quantize_model`` set; a checkpoint's quantized tensor
    replacing a plain weight: what was saved); plain ones keep the model's own, as
    ``load_state_dict`` does.

    A checkpoint tensor lacking a usage the model's prototype has (e.g. rowwise-only into
    rowwise+columnwise) is an error under ``strict``, else a warning and the checkpoint's tensor is
    taken as saved; ``derive_usages=True`` builds the missing usage from the checkpoint's bytes
    where the format says that is exact.

    Afterwards nothing is left on ``meta``: tensors no checkpoint holds (non-persistent buffers
    such as rotary ``inv_freq``; keys a non-strict load skipped) are allocated on ``device`` and
    initialized by ``init_fn(module)`` if given, else by the enclosing Hugging Face model's
    ``_init_weights``, else by the module's ``reset_parameters`` — with the loaded tensors out of
    their reach; what none of them writes is an error naming it.

    Shapes must agree (a checkpoint for another architecture is refused, naming every mismatch).
    ``strict=True`` refuses missing or unexpected keys and returns the model; ``strict=False``
    returns ``LoadResult(model, missing_keys, unexpected_keys, report)``. The per-tensor
    :class:`~te_serial.ConversionReport` is also ``model.te_serial_report`` (and saved as JSON
    at ``report`` if given). ``assign=False`` copies into the existing (non-meta) tensors instead
    of replacing them. Hugging Face models are tied first (``tie_weights()``, as
    ``from_pretrained`` does), and their ``save_pretrained`` then points to
    ``te_serial.save_quantized`` while they hold te-serial tensors.

    ``shard_fn(name, proto)`` (tensor parallelism: a model built for one rank) returns ``None``
    for the whole tensor or ``{"rows": (r0, r1)}`` / ``{"cols": (c0, c1)}`` (TE's 2-D view, aligned
    to the format's blocks): only that range's bytes are read (``Checkpoint.get(name, rows=,
    cols=)``, equal to ``slice_quantized`` of the whole), and the model's tensor has the slice's
    shape. Sliced tensors come from a te-serial checkpoint in the model's format.

    ``fused``: weights quantized on the way in with a tensor-wide scale share one amax per group
    a serving engine fuses (q/k/v, gate/up, …), as :func:`quantize_model` does; see there.
    """
    from .conversion.report import ConversionReport
    from .conversion.sources import open_source
    t0 = time.perf_counter()
    device = torch.device(device)
    _tie_hf(model)
    slots = tensor_slots(model)
    with open_source(path, verify=verify) as opened:
        source = as_model_names(opened, slots)
        missing, unexpected, sliced = _match(model, slots, source.tensors, path, shard_fn, strict)
        steps, first, notes = plan_load(source, slots, path, derive_usages=derive_usages, strict=strict, fused=fused,
                                        config=model_config_dict(model), reads=device.type != "meta")
        rep = ConversionReport(str(path), "model", source.layout, "model", None)
        rep.notes.extend(notes)
        loaded, reports = _read_steps(source, slots, steps, sliced, device, verify, path)
        done = _assign_loaded(slots, loaded, source.tensors, assign)
        rep.tensors = _load_reports(source, slots, first, done, reports)
        rep.notes.extend(f"unexpected (not loaded): {n}" for n in unexpected)
    missing = [n for n in missing if id(slots[n][3]) not in done]
    if device.type != "meta":
        if assign:
            _move_non_persistent(model, device)
        filled = _fill_meta(model, device, init_fn)
        rep.notes.extend(f"initialized (not in the checkpoint): {n}" for n in filled)
    if any(isinstance(t, QuantizedTensorStorage) for t in done.values()):
        guard_save_pretrained(model)
    rep.seconds = time.perf_counter() - t0
    model.te_serial_report = rep
    if report is not None:
        rep.save(report)
    return model if strict else LoadResult(model, missing, unexpected, rep)


def _match(model: nn.Module, slots: dict, found: dict, path, shard_fn, strict: bool
           ) -> tuple[list[str], list[str], dict]:
    """(missing, unexpected, this rank's slices) of the checkpoint against the model's tensors;
    refuses shapes that do not fit, and under ``strict`` any missing or unexpected key."""
    # names that share one tensor in the model count as present when any of them is saved
    groups: dict[int, list[str]] = {}
    for name, (_, _, _, t) in slots.items():
        groups.setdefault(id(t), []).append(name)
    missing = [n for n in slots if n not in found and not any(a in found for a in groups[id(slots[n][3])])]
    unexpected = [n for n in found if n not in slots]
    missing, unexpected = _hf_ignored(model, missing, "missing"), _hf_ignored(model, unexpected, "unexpected")
    sliced = _slices(found, [n for n in slots if n in found], shard_fn, path) if shard_fn is not None else {}
    mismatched = [f"{n}: checkpoint {list(sliced[n][2] if n in sliced else found[n].shape)} vs model "
                  f"{list(slots[n][3].shape)}" for n in slots if n in found and
                  tuple(sliced[n][2] if n in sliced else found[n].shape) != tuple(slots[n][3].shape)]
    if mismatched:
        raise CheckpointError("checkpoint does not fit this model; size mismatch for "
                              + "; ".join(mismatched[:20]) + (" …" if len(mismatched) > 20 else ""), file=str(path))
    if strict and (missing or unexpected):
        raise CheckpointError(f"missing keys {missing[:20]}, unexpected keys {unexpected[:20]} "
                              "(strict=False to load what matches)", file=str(path))
    return missing, unexpected, sliced


def as_model_names(source, slots: dict):
    """``source`` as the model names its tensors: a MoE checkpoint's per-expert tensors as the
    model's 3-D expert parameters where the model has those and the checkpoint does not
    (:class:`~te_serial.conversion.sources.FusedExpertsView`), else ``source`` itself."""
    from .conversion.sources import FusedExpertsView
    view = FusedExpertsView(source, slots)
    return view if view.changes else source


def plan_load(source, slots: dict, path, *, derive_usages: bool, strict: bool, fused, config: dict | None,
              reads: bool) -> tuple[dict, dict[int, str], list[str]]:
    """How each model tensor ``source`` holds is loaded, decided before any byte is read but the
    fused groups' members (read when ``reads``: weights quantized on the way in share one amax per
    group, as :func:`quantize_model` gives them): (name → step or None, tensor id → its first name,
    notes). ``slots``: name → (module, attr, is_param, the model's tensor or a prototype of it)."""
    from .conversion.fused_scales import share_fused_amax
    steps, first = _choose_steps(slots, source.tensors, derive_usages, strict, path)
    notes: list[str] = []
    if reads:
        groups = fusion.groups_for(fusion.architecture_of(config or source.config), fused)
        changed, notes = share_fused_amax(source.load, steps, groups, rule=fused, reexpress=False)
        steps.update(changed)
    return steps, first, notes


def read_for_model(source, name: str, step, device: torch.device, path, src=None) -> tuple[torch.Tensor, Any]:
    """(tensor, report) of ``source``'s tensor ``name`` through its load step (None: as it is; ``src``:
    its bytes already read), on ``device``; errors are te-serial's, naming the tensor."""
    from .conversion.core import convert_tensor, tensor_plan
    from .conversion.transforms import Step
    st = source.tensors[name]
    if step is None:
        step = Step("keep", st.quantizer, st.dtype, exact=True, builder="keep")
    try:
        out, report, _ = convert_tensor(source, tensor_plan(st, step), "te", src=src)
    except CheckpointError:
        raise
    except (TeSerialError, RuntimeError, ValueError, TypeError, OSError, MemoryError) as e:
        raise ConversionError(f"{type(e).__name__}: {e}", file=str(path), tensor=name) from e
    return (out if out.device.type == device.type else out.to(device)), report


def _choose_steps(slots: dict, found: dict, derive_usages: bool, strict: bool, path) -> tuple[dict, dict[int, str]]:
    """One decision per model tensor (tied names share it), all before any byte is read: (name →
    its conversion step, None to take the checkpoint's tensor as it is; tensor id → its first name)."""
    first: dict[int, str] = {}
    steps: dict[str, Any] = {}
    problems: list[str] = []
    for name in slots:
        old = slots[name][3]
        if name not in found or id(old) in first:
            continue
        first[id(old)] = name
        steps[name], problem = _choose(found[name], old, derive_usages)
        if problem:
            problems.append(problem)
    if problems:
        text = "usage mismatch between checkpoint and model prototypes: " + "; ".join(problems[:20])
        if strict:
            raise CheckpointError(text, file=str(path))
        warnings.warn(f"te-serial: {text}; taking the checkpoint's tensors as saved", stacklevel=3)
    return steps, first


def _read_steps(source, slots: dict, steps: dict, sliced: dict, device: torch.device, verify: bool, path
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(name → the tensor for the model, name → its report): the checkpoint's tensors as they are
    (a te-serial checkpoint through the one reader, mmap'd on CPU; slices read alone), then the
    conversions one at a time on CPU, moved to ``device``; meta prototypes on ``meta``."""
    found = source.tensors
    reports: dict[str, Any] = {}
    loaded: dict[str, Any] = {}

    def run(name: str, step, src=None):
        out, reports[name] = read_for_model(source, name, step, device, path, src)
        return out

    direct = [n for n, s in steps.items() if s is None]
    ckpt = getattr(source, "ckpt", None)  # a te-serial checkpoint
    wrong = [n for n in sliced if n in steps and (steps[n] is not None or ckpt is None)]
    if wrong:
        raise CheckpointError(f"shard_fn slices {wrong[:5]}, which need converting on load; slices are read only "
                              "from a te-serial checkpoint in the model's format", file=str(path))
    if device.type == "meta":  # prototypes only: nothing to read
        for name, step in steps.items():
            st, old = found[name], slots[name][3]
            proto = st.proto if step is None else step.proto(st.shape)
            loaded[name] = TensorProto(sliced[name][2] if name in sliced else proto.shape,
                                       old.dtype if step is None and st.quantizer is None
                                       else proto.dtype, proto.quantizer).create_tensor(device="meta")
        return loaded, reports
    got = {}
    if ckpt is not None and direct:
        got = ckpt.load_tensors([n for n in direct if n not in sliced and n in ckpt], device=device, verify=verify)
        for n in direct:
            if n in sliced:  # this rank's range only: just its bytes
                got[n] = ckpt.get(n, device=device, verify=verify, rows=sliced[n][0], cols=sliced[n][1])
    for name in direct:
        loaded[name] = run(name, None, got.pop(name, None))
    del got
    for name, step in steps.items():  # conversions: one tensor at a time
        if step is not None:
            loaded[name] = run(name, step)
            if found[name].nbytes >= _TRIM_BYTES:
                _trim_heap()
    return loaded, reports


def _assign_loaded(slots: dict, loaded: dict[str, Any], found: dict, assign: bool) -> dict[int, Any]:
    """Put each loaded tensor into its slot (replaced, or copied into with ``assign=False``), with
    the ``requires_grad`` ``load_into`` promises; tied partners get the same object. Original
    tensor id → the new tensor."""
    done: dict[int, Any] = {}
    names = set(loaded)
    for name in slots:
        if name not in names:
            continue
        module, attr, is_param, old = slots[name]
        new = with_nominal(loaded.pop(name), old.dtype)
        if not assign and old.device.type != "meta":
            with torch.no_grad():
                old.copy_(new)
            done[id(old)] = old
            continue
        quantized_slot = isinstance(old, QuantizedTensorStorage)
        grad = old.requires_grad if (quantized_slot or not isinstance(new, QuantizedTensorStorage)) \
            else found[name].proto.requires_grad
        done[id(old)] = _set(module, attr, is_param, new, grad)
    for name, (module, attr, is_param, old) in slots.items():  # tied partners of loaded names
        if id(old) in done and name not in names:
            (module._parameters if is_param else module._buffers)[attr] = done[id(old)]
    return done


def _load_reports(source, slots: dict, first: dict[int, str], done: dict[int, Any], reports: dict[str, Any]) -> list:
    """The report's rows: in the checkpoint's order, as convert reports it; then tied names the
    checkpoint does not hold; then what the source drops (activation scales)."""
    from .conversion.report import DROPPED, TensorReport
    found = source.tensors
    for name, (_, _, _, old) in slots.items():
        ref = reports.get(first.get(id(old), ""))
        if id(old) in done and name not in reports and ref is not None:
            reports[name] = TensorReport(name, ref.shape, ref.source, ref.target, "tied", ref.label,
                                         ref.max_abs_err, ref.rel_rmse, ref.snr_db, 0, 0, f"tied to {first[id(old)]}")
    rows = [reports[n] for n in found if n in reports] + [reports[n] for n in slots if n in reports and n not in found]
    rows += [TensorReport(name, (), "activation scale", "-", "drop", DROPPED, src_bytes=nbytes, note=reason)
             for name, (reason, nbytes) in source.dropped.items()]
    return rows


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class Chosen(NamedTuple):
    """A weight the default rule quantizes: where it sits and the quantizer it gets."""

    module_name: str
    module: nn.Module
    attr: str
    weight: torch.Tensor
    quantizer: Quantizer


def choose_weights(model: nn.Module, q: Quantizer, *, include: Sequence[str] = ("*",),
                   exclude: Sequence[str] | None = None, module_types: tuple[type, ...] = (nn.Linear,),
                   warn: bool = True) -> dict[str, Chosen]:
    """Parameter name → :class:`Chosen`: the weights :func:`quantize_model` quantizes with recipe
    quantizer ``q`` (quantize on load shares the choice): ``module_types``' ``weight`` and every
    module's 3-D expert stacks, on modules matching ``include`` and, by default, outside
    :func:`~te_serial.precision.stays_high_precision` (``exclude`` patterns on module names replace
    that rule). Each gets ``q``, an expert stack a grouped quantizer of per-expert members
    (:func:`~te_serial.formats.grouped.per_expert`). Weights the recipe cannot hold are left out,
    with a warning naming why."""
    from .formats.grouped import per_expert
    out: dict[str, Chosen] = {}
    for mname, module in model.named_modules():
        if not _matches(mname, include) or (exclude is not None and _matches(mname, exclude)):
            continue
        prefix = f"{mname}." if mname else ""
        for attr, w in module._parameters.items():
            if w is None or isinstance(w, QuantizedTensorStorage):
                continue
            name = prefix + attr
            shape = tuple(w.shape)
            if not ((attr == "weight" and isinstance(module, module_types)) or is_expert_weight(name, shape)):
                continue
            if exclude is None and stays_high_precision(name, shape):
                continue
            try:  # experts stored (in, out) (gpt-oss: transformers' is_transposed) are quantized as (out, in)
                wq = per_expert(q, shape, transposed=bool(getattr(module, "is_transposed", False)))
                wq.check_shape(shape)
            except (ShapeError, FormatError) as e:
                if warn:
                    warnings.warn(f"te-serial: {name} left unquantized: {e}", stacklevel=3)
                continue
            out[name] = Chosen(mname, module, attr, w, wq)
    return out


def chosen_linears(chosen: dict[str, Chosen]) -> dict[str, torch.Tensor]:
    """Module name → weight of the linear layers among ``chosen`` (what fused groups are made of)."""
    return {c.module_name: c.weight for c in chosen.values() if c.attr == "weight" and c.weight.dim() == 2}


def quantize_model(model: nn.Module, recipe: str | Quantizer, *, include: Sequence[str] = ("*",),
                   exclude: Sequence[str] | None = None, module_types: tuple[type, ...] = (nn.Linear,),
                   columnwise: bool | None = None, fused: str | Sequence[Sequence[str]] | None = "auto") -> nn.Module:
    """Replace the weights of matching modules by quantized parameters, in place; returns the model.

    Modules are chosen by type (``nn.Linear`` by default) and by glob patterns on their qualified
    names; a MoE layer's experts held as 3-D parameters (transformers 5's ``experts.gate_up_proj``,
    ``experts.down_proj``) are quantized too, each expert on its own with its own scales, into one
    grouped tensor (TE's ``GroupedLinear`` layout) that transformers' expert implementations use as
    they use the 3-D parameter. By default (``exclude=None``) the weights
    :func:`te_serial.precision.stays_high_precision` keeps — embeddings, output heads, norms, MoE
    routers; the rule ``convert`` uses — stay as they are; ``exclude`` patterns (on module names)
    replace that rule. ``recipe`` is a name from :data:`te_serial.recipes.RECIPES` or a quantizer;
    ``columnwise`` (default: ``torch.is_grad_enabled()``, as TE does) adds the transposed usage
    needed for training. On a meta model the parameters become meta quantized tensors: prototypes
    only, for :func:`plan`. Weights whose shape the recipe cannot hold are left alone with a
    warning. A Hugging Face model is tied first (``tie_weights()``, which accelerate's
    ``init_empty_weights`` leaves undone), and its ``save_pretrained`` then points to
    ``te_serial.save_quantized``.

    ``fused``: with a recipe whose scale is tensor-wide (per-tensor FP8 current scaling, NVFP4's
    global scale), the modules a serving engine fuses into one GEMM (q/k/v, gate/up, …:
    :mod:`te_serial.fusion`, by the model's ``config.architectures``) are quantized with one shared
    amax, so the engine's one scale is every member's; ``"off"`` quantizes each on its own, or give
    your own groups of module names. An expert stack's fused gate/up rows are one member each,
    with one scale.
    """
    col = torch.is_grad_enabled() if columnwise is None else columnwise
    q = recipe if isinstance(recipe, Quantizer) else recipe_quantizer(recipe, rowwise=True, columnwise=col)
    _tie_hf(model)
    chosen = choose_weights(model, q, include=include, exclude=exclude, module_types=module_types)
    shared = shared_amax(model, q, chosen_linears(chosen), fused)
    done: dict[int, nn.Parameter] = {}
    for name, c in chosen.items():
        w = c.weight
        if id(w) in done:  # tied with a weight already quantized
            c.module._parameters[c.attr] = done[id(w)]
            continue
        if w.device.type == "meta":
            qt = TensorProto(tuple(w.shape), w.dtype, c.quantizer, w.requires_grad, w.device).create_tensor()
        else:
            qt = c.quantizer.quantize(w.detach(), tensor_amax=shared.get(c.module_name) if c.attr == "weight" else None)
        done[id(w)] = c.module._parameters[c.attr] = nn.Parameter(qt, requires_grad=w.requires_grad)
    if done:
        guard_save_pretrained(model)
    return model


def shared_amax(model: nn.Module, q: Quantizer, weights: dict[str, torch.Tensor],
                 rule: str | Sequence[Sequence[str]] | None) -> dict[str, torch.Tensor]:
    """Module name → its fused group's amax (the members' largest), for a quantizer whose scale is
    tensor-wide; members the recipe cannot hold, and meta weights, take no part."""
    groups = fusion.groups_for(fusion.architecture_of(model_config_dict(model)), rule)
    if not groups or not q.takes_tensor_amax():
        return {}
    out: dict[str, torch.Tensor] = {}
    for members in fusion.fused_groups(weights, groups, suffix=""):
        ws = [weights[m] for m in members]
        if any(w.device.type == "meta" for w in ws) or len({id(w) for w in ws}) != len(ws):
            continue
        try:
            for w in ws:
                q.check_shape(tuple(w.shape))
        except ShapeError:
            continue
        amax = torch.stack([nx.nan_ignoring_amax(w.detach()).float().cpu() for w in ws]).amax()
        out.update({m: amax for m in members})
    return out


def materialize(model: nn.Module, device: str | torch.device, *, init_fn: InitFn | None = None) -> nn.Module:
    """Allocate every meta parameter and buffer on ``device`` and initialize it, for training from
    scratch with quantized primary weights: the same rule as what ``load_into`` leaves on meta —
    ``init_fn(module)``, else the enclosing Hugging Face model's ``_init_weights``, else the module's
    ``reset_parameters`` (a quantized prototype is initialized in its nominal dtype, one tensor at a
    time, then quantized with its quantizer); what none of them writes is an error naming it, so no
    uninitialized memory is handed back as values."""
    _tie_hf(model)
    _fill_meta(model, torch.device(device), init_fn)
    if any(isinstance(p, QuantizedTensorStorage) for p in model.parameters()):
        guard_save_pretrained(model)
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
    for name, (_, _, _, t) in tensor_slots(model).items():
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
    for _, (_, _, is_param, t) in tensor_slots(model).items():
        if id(t) not in memo:
            meta = to_tensor_proto(t).create_tensor(device="meta") if isinstance(t, QuantizedTensorStorage) \
                else torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta
    return copy.deepcopy(model, memo)
