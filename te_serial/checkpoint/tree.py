"""State-dict trees ↔ flat tensor tables, with the tree itself stored in msgpack (no pickle).

Tensors become msgpack extension type 1 (their flat name); tuples extension type 2, so they
come back as tuples; dicts (str or int keys), lists and plain scalars are stored as they are.
A tensor's flat name joins the keys on its path with dots (``layers.0.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ..errors import ManifestError, UnsupportedValueError
from ..formats.base import QuantizedTensorStorage

TENSOR_EXT, TUPLE_EXT, TE_EXTRA_STATE_EXT = 1, 2, 3
EXTRA_STATE_SUFFIX = "_extra_state"
MAX_DEPTH = 64


@dataclass(frozen=True)
class TensorRef:
    """A tensor's place in the tree: its flat name in the checkpoint's tensor table."""

    name: str


@dataclass(frozen=True)
class TEExtraState:
    """A TE module's pickled ``_extra_state``, stored decoded (recipe as plain data, scales and
    amax histories as ordinary tensors) and turned back into TE's bytes on load."""

    state: Any


def _is_pickled_extra_state(key: Any, value: Any) -> bool:
    import io
    if not (isinstance(key, str) and key.endswith(EXTRA_STATE_SUFFIX)):
        return False
    if isinstance(value, io.BytesIO):
        return True
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and value.numel() > 0


def _is_tensor(value: Any) -> bool:
    from ..te_interop import is_te_tensor  # TE storages are tensors here too (not torch.Tensors)
    return isinstance(value, (torch.Tensor, QuantizedTensorStorage)) or is_te_tensor(value)


def flatten_tree(obj: Any) -> tuple[Any, dict[str, Any]]:
    """(tree with TensorRef leaves, {flat name: tensor}) for a state dict or ``nn.Module``."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict(keep_vars=True)  # Parameters themselves: their requires_grad is saved
    if not isinstance(obj, dict):
        raise UnsupportedValueError(f"save_quantized needs a state dict or nn.Module, got {type(obj).__name__}")
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: tuple) -> Any:
        where = ".".join(map(str, path)) or "<root>"
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(f"state dict nests deeper than {MAX_DEPTH} levels at {where!r}")
        if path and _is_pickled_extra_state(path[-1], value):
            from ..te_extra_state import decode_te_extra_state  # never unpickles
            return TEExtraState(walk(decode_te_extra_state(value, where=where), path))
        if _is_tensor(value):
            if where in tensors:
                raise UnsupportedValueError(f"two tensors flatten to the same name {where!r}")
            tensors[where] = value
            return TensorRef(where)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise UnsupportedValueError(f"dict key {k!r} at {where!r}: only str and int keys are stored")
                out[k] = walk(v, path + (k,))
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(v, path + (i,)) for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
                raise UnsupportedValueError(f"integer at {where!r} does not fit in 64 bits")
            return value
        if isinstance(value, torch.dtype):
            raise UnsupportedValueError(f"value at {where!r} is a torch.dtype; store its name as a string")
        raise UnsupportedValueError(
            f"value at {where!r} has type {type(value).__name__}, which te-serial stores only as "
            "tensors, numbers, strings, bools, None, lists, tuples or dicts (no pickle)")

    return walk(obj, ()), tensors


def _default(value: Any) -> Any:
    if isinstance(value, TensorRef):
        return msgpack.ExtType(TENSOR_EXT, value.name.encode("utf-8"))
    if isinstance(value, tuple):
        return msgpack.ExtType(TUPLE_EXT, pack(list(value)))
    if isinstance(value, TEExtraState):
        return msgpack.ExtType(TE_EXTRA_STATE_EXT, pack(value.state))
    if isinstance(value, dict):  # OrderedDict and other dict subclasses under strict_types
        return dict(value)
    raise TypeError(f"cannot pack {type(value).__name__}")


def pack(obj: Any) -> bytes:
    """msgpack bytes of a manifest-like object (TensorRef and tuple as extension types)."""
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


#: bounds handed to msgpack so a hostile manifest cannot make us allocate without limit
UNPACK_LIMITS = dict(max_str_len=1 << 24, max_bin_len=1 << 26, max_array_len=1 << 22,
                     max_map_len=1 << 22, max_ext_len=1 << 24)


class _Unpacker:
    """One decode: nested extension payloads count towards one depth limit (each is decoded by a
    recursive call, so without a bound a few hundred bytes could exhaust the C stack)."""

    def __init__(self) -> None:
        self.depth = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == TENSOR_EXT:
            return TensorRef(data.decode("utf-8"))
        if code in (TUPLE_EXT, TE_EXTRA_STATE_EXT):
            if self.depth >= MAX_DEPTH:
                raise ManifestError(f"the manifest's tree nests extension types deeper than {MAX_DEPTH} levels")
            self.depth += 1
            try:
                inner = self.unpack(data)
            finally:
                self.depth -= 1
            return tuple(inner) if code == TUPLE_EXT else TEExtraState(inner)
        raise ManifestError(f"unknown msgpack extension type {code} in manifest")

    def unpack(self, data: bytes) -> Any:
        # timestamp=3 turns msgpack's built-in timestamp type into datetime objects, which
        # tree_refs then refuses like every other type te-serial never writes.
        return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False,
                               use_list=True, timestamp=3, **UNPACK_LIMITS)


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`, with size limits; any malformation is a :class:`ManifestError`."""
    try:
        return _Unpacker().unpack(data)
    except ManifestError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None


def tree_refs(tree: Any, depth: int = 0) -> list[str]:
    """Flat names of the tensors a tree refers to (checks the tree's shape on the way)."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"manifest tree nests deeper than {MAX_DEPTH} levels")
    if isinstance(tree, TensorRef):
        return [tree.name]
    if isinstance(tree, TEExtraState):
        return tree_refs(tree.state, depth + 1)
    if isinstance(tree, dict):
        return [n for v in tree.values() for n in tree_refs(v, depth + 1)]
    if isinstance(tree, (list, tuple)):
        return [n for v in tree for n in tree_refs(v, depth + 1)]
    if tree is None or isinstance(tree, (bool, int, float, str, bytes)):
        return []
    raise ManifestError(f"manifest tree holds a {type(tree).__name__}, which te-serial never writes")


def rebuild_tree(tree: Any, tensors: dict[str, Any]) -> Any:
    """Replace TensorRef leaves by tensors (missing names are dropped from dicts)."""
    if isinstance(tree, TensorRef):
        return tensors[tree.name]
    if isinstance(tree, TEExtraState):
        return _te_extra_state_value(rebuild_tree(tree.state, tensors))
    if isinstance(tree, dict):
        return {k: rebuild_tree(v, tensors) for k, v in tree.items()
                if not (isinstance(v, TensorRef) and v.name not in tensors)}
    if isinstance(tree, list):
        return [rebuild_tree(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        return tuple(rebuild_tree(v, tensors) for v in tree)
    return tree


def _te_extra_state_value(state: Any) -> Any:
    """TE's own ``_extra_state`` bytes for a decoded state (TE's recipe classes are needed to
    write them); without TE, the decoded dict itself, with a warning."""
    from ..errors import TeSerialError
    from ..te_extra_state import encode_te_extra_state
    try:
        return encode_te_extra_state(state)
    except (TeSerialError, ImportError) as e:
        import warnings
        warnings.warn(f"te-serial: TE extra state returned decoded, not as TE's bytes: {e}", stacklevel=3)
        return state
