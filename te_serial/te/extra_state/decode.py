"""The decoding entry points: an ``_extra_state`` value (tensor, ``io.BytesIO`` or bytes) to plain
data through the restricted parsers, and TE's own stateless test, answered without executing pickle."""

from __future__ import annotations

import io
import pickletools
from typing import Any, List, Optional, Tuple

import torch

from .check import check_extra_state
from .containers import LEGACY_PREFIX, load_storage_from_bytes, parse_legacy_torch_save, parse_zip_torch_save
from .errors import UnsafeExtraStateError, short_repr, unsafe_error
from .limits import MAX_PAYLOAD_BYTES, MAX_PAYLOAD_WORK, ExtraStateBudget
from .pickle_vm import Ctx, Machine, describe
from .plain import Plainer
from .schema import DELAYED_SCALING_KEYS, KNOWN_RECIPE_POLICIES, RECIPE_MODULE, STATELESS_RECIPES


def _payload(value: Any, where: Optional[str]) -> Tuple[bytes, str]:
    """(bytes, kind) with kind "pickle" (uint8 tensor / bytes) or "torch.save" (BytesIO)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return b"", "pickle"
        if value.dtype != torch.uint8:
            raise unsafe_error(f"extra state tensor has dtype {value.dtype}, expected torch.uint8", where)
        if value.numel() > MAX_PAYLOAD_BYTES:
            raise unsafe_error(f"extra state of {value.numel()} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
        if value.device.type == "meta":
            raise unsafe_error("extra state tensor is on the meta device (it has no bytes to decode)",
                         where)
        if value.layout != torch.strided:
            raise unsafe_error(f"extra state tensor has layout {value.layout}", where)
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        return flat.numpy().tobytes(), "pickle"
    if isinstance(value, io.BytesIO):
        data = value.getbuffer()
        try:
            if len(data) > MAX_PAYLOAD_BYTES:
                raise unsafe_error(f"extra state of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
            return bytes(data), "torch.save"
        finally:
            data.release()
    if isinstance(value, (bytes, bytearray, memoryview)):
        if isinstance(value, memoryview) and (value.ndim != 1 or value.itemsize != 1):
            value = value.cast("B") if value.c_contiguous else value.tobytes()
        if len(value) > MAX_PAYLOAD_BYTES:
            raise unsafe_error(f"extra state of {len(value)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
        data = bytes(value)
        if data.startswith(b"PK\x03\x04") or data.startswith(LEGACY_PREFIX):
            return data, "torch.save"
        return data, "pickle"
    raise unsafe_error(f"unsupported extra state type {type(value).__name__} (expected a uint8 tensor, "
                 "io.BytesIO or bytes)", where)


def _decode_raw(data: bytes, kind: str, ctx: Ctx) -> Any:
    where = ctx.where
    if len(data) > MAX_PAYLOAD_BYTES:
        raise unsafe_error(f"extra state of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
    if kind == "torch.save":
        if data.startswith(b"PK\x03\x04"):
            return parse_zip_torch_save(data, ctx)
        if data.startswith(LEGACY_PREFIX):
            return parse_legacy_torch_save(data, ctx, expect_storage=False,
                                            context="legacy torch.save payload")
        raise unsafe_error("io.BytesIO extra state is neither a zip nor a legacy torch.save payload",
                     where)
    f = io.BytesIO(data)
    obj = Machine("pickle", ctx, load_from_bytes=load_storage_from_bytes).run(f)
    if f.tell() != len(data):
        raise unsafe_error(f"{len(data) - f.tell()} trailing bytes after the pickle's STOP", where)
    return obj


def decode_te_extra_state(value: Any, *, where: Optional[str] = None,
                          budget: Optional[ExtraStateBudget] = None) -> Optional[dict]:
    """Decode a TE module ``_extra_state`` value without executing any pickle code.

    ``value`` is what TE's ``get_extra_state`` returned: a uint8 tensor (``pickle.dumps``
    bytes), a legacy ``io.BytesIO`` (``torch.save``), or the raw ``bytes`` of either. Returns
    ``None`` for empty / ``None`` state, else ``{"recipe": <plain recipe dict> | None, ...}``
    with the payload's other entries (``scale_fwd``, ``amax_history_fwd``, ``scale_bwd``,
    ``amax_history_bwd``, ``extra_fp8_variables``, TE 1.x's ``scale_inv_*``) in their stored
    order, holding only plain Python values and CPU tensors (each owning its memory). ``where``
    (e.g. the state-dict key) is named in errors. Work and bytes are charged to ``budget``
    (default: a budget of its own for a "checkpoint" the size of the payload; see the package's
    Bounds). Raises :class:`UnsafeExtraStateError` for anything else, and nothing but it.
    """
    if value is None:
        return None
    data, kind = _payload(value, where)
    if not data:
        return None
    if budget is None:
        budget = ExtraStateBudget(len(data))
    ctx = Ctx(where, budget)
    saved_max = budget.max_work  # one payload also gets at most MAX_PAYLOAD_WORK of it
    budget.max_work = min(saved_max, budget.work + MAX_PAYLOAD_WORK)
    try:
        obj = _decode_raw(data, kind, ctx)
        del data
        if obj is None:
            return None
        if type(obj) is not dict:
            raise unsafe_error(f"extra state is a {describe(obj)}, expected a dict", where)
        if not all(type(k) is str for k in obj):
            raise unsafe_error("extra state dict has non-str keys", where)
        plain = Plainer(ctx).convert(obj)
        out = {"recipe": plain.get("recipe")}
        out.update((k, v) for k, v in plain.items() if k != "recipe")
        check_extra_state(out, where=where)
        return out
    except UnsafeExtraStateError:
        raise
    except RecursionError:
        raise unsafe_error("a value nested too deeply", where) from None
    except MemoryError:
        raise unsafe_error("a value too large to decode", where) from None
    except Exception as exc:  # pylint: disable=broad-except  # a bug here must not escape as-is
        raise unsafe_error(f"undecodable payload: {type(exc).__name__}: {short_repr(str(exc))}",
                     where) from exc
    finally:
        budget.max_work = saved_max


def _classify_like_te(data: bytes) -> bool:
    """True iff TE's ``_classify_extra_state_pickle`` answers IGNORE (opcode scan, no execution).

    The scan stops (answering False, "not stateless") past a payload-sized budget of opcodes."""
    strings: List[str] = []
    has_recipe_key = has_delayed = has_global = False
    policies = set()
    limit = min(MAX_PAYLOAD_WORK, ExtraStateBudget(len(data)).max_work)
    try:
        for count, (opcode, arg, _pos) in enumerate(pickletools.genops(data)):
            if count > limit:
                return False
            name = opcode.name
            if name in ("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                        "BINUNICODE8", "SHORT_BINUNICODE"):
                text = arg
                if isinstance(arg, bytes):
                    try:
                        text = arg.decode("utf-8")
                    except UnicodeDecodeError:
                        text = None
                if isinstance(text, str):
                    strings.append(text)
                    has_recipe_key = has_recipe_key or text == "recipe"
                    has_delayed = has_delayed or text in DELAYED_SCALING_KEYS
                continue
            if name == "GLOBAL":
                has_global = True
                parts = arg.split() if isinstance(arg, str) else []
                ref = tuple(parts) if len(parts) == 2 else None
            elif name == "STACK_GLOBAL":
                has_global = True
                ref = (strings[-2], strings[-1]) if len(strings) >= 2 else None
            else:
                continue
            if ref is not None and ref[0] == RECIPE_MODULE and ref[1] in KNOWN_RECIPE_POLICIES:
                policies.add("delayed" if ref[1] == "DelayedScaling" else
                             "dynamic" if ref[1] == "CustomRecipe" else "stateless")
    except Exception:  # pylint: disable=broad-except  # TE: unparsable → unsafe load
        return False
    if not has_global and not has_delayed:
        return True
    if not has_recipe_key or "delayed" in policies or has_delayed or not policies:
        return False
    return True


def is_stateless_extra_state(value: Any) -> bool:
    """Whether ``value`` carries no state TE would restore, so it can be stored as empty.

    True for ``None``, empty tensors/bytes/BytesIO, and uint8-tensor pickles that TE's own
    ``set_extra_state`` ignores (it mirrors TE's opcode-only classifier: no globals and no
    delayed-scaling keys, or a ``recipe`` of a stateless/custom recipe class and no delayed-
    scaling keys). A legacy ``io.BytesIO`` is decoded (restrictedly) and is stateless when it
    holds ``None`` or no delayed-scaling tensors under a non-delayed recipe. Never executes
    pickle code; raises :class:`UnsafeExtraStateError` only for a BytesIO it cannot decode.
    """
    if value is None:
        return True
    data, kind = _payload(value, None)
    if not data:
        return True
    if kind == "pickle":
        return _classify_like_te(data)
    state = decode_te_extra_state(value)
    if state is None:
        return True
    recipe = state.get("recipe")
    return not any(k in state for k in DELAYED_SCALING_KEYS) and recipe is not None and \
        recipe.get("__class__") in STATELESS_RECIPES
