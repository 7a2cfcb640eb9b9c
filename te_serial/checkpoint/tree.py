"""State-dict trees ↔ flat tensor tables, with the tree itself stored in msgpack (no pickle).

Tensors become msgpack extension type 1 (their flat name); tuples extension type 2, so they
come back as tuples; TE modules' pickled ``_extra_state`` extension type 3 (decoded, never
unpickled); dicts (str or int keys), lists and plain scalars are stored as they are. A tensor's
flat name joins the keys on its path with dots (``layers.0.weight``).

Reading, for the reader (see :func:`unpack_manifest`, :func:`check_tree`, :func:`rebuild_tree`):

* Extension types appear only inside the manifest's ``tree`` field. Everywhere else the
  manifest is decoded with ``max_ext_len=0``, so msgpack's C decoder itself refuses any
  extension type or timestamp there; inside ``tree`` the three types above are accepted and
  a timestamp decodes to an object that :func:`check_tree` refuses (never to a ``datetime``,
  whose conversion could raise ``OverflowError``). Any map with a repeated key is refused.
* The tree's root is a map; map keys are str or int; values are nil, bool, int, float, str,
  bin, arrays, maps, tensor references, tuples, and TE extra state -- the latter only as the
  value of a str key ending in ``_extra_state``, never inside another extra state, and holding
  exactly what :func:`te_serial.te.extra_state.check_extra_state` accepts. A tensor referenced
  inside an extra state is referenced nowhere else in the tree. Depth ≤ 64.
* Re-encoding extra state to TE's bytes on load spends from one
  :class:`~te_serial.te.extra_state.ExtraStateBudget` for the whole checkpoint (work ≤
  min(2,000,000, 65,536 + F/4) opcodes and values, bytes ≤ 2·F + 16 MiB, F = the checkpoint's
  size in bytes).
* Non-strict loads: a tensor that was skipped is dropped from its dict, becomes ``None`` in a
  list or tuple, and an extra state that refers to one is dropped (or ``None``) as a whole; the
  names are reported through ``rebuild_tree(..., missing=[])``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import torch

from ..errors import CheckpointError, ManifestError, UnsupportedValueError
from ..formats.tensors import QuantizedTensorStorage
from ..te.extra_state import ExtraStateBudget  # noqa: F401  (re-exported for the reader)

TENSOR_EXT, TUPLE_EXT, TE_EXTRA_STATE_EXT = 1, 2, 3
EXTRA_STATE_SUFFIX = "_extra_state"
MAX_DEPTH = 64
_INT_RANGE = (-(1 << 63), 1 << 64)


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
    from ..te.interop import is_te_tensor  # TE storages are tensors here too (not torch.Tensors)
    return isinstance(value, (torch.Tensor, QuantizedTensorStorage)) or is_te_tensor(value)


def flatten_tree(obj: Any) -> tuple[Any, dict[str, Any]]:
    """(tree with TensorRef leaves, {flat name: tensor}) for a state dict or ``nn.Module``.

    A uint8 ``<...>_extra_state`` tensor (or BytesIO) holding TE's pickle is decoded with the
    restricted decoder (never unpickled) into a :class:`TEExtraState`; inside it, nothing is
    taken for extra state again.
    """
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict(keep_vars=True)  # Parameters themselves: their requires_grad is saved
    if not isinstance(obj, dict):
        raise UnsupportedValueError(f"save_quantized needs a state dict or nn.Module, got {type(obj).__name__}")
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: tuple, in_extra: bool) -> Any:
        where = ".".join(map(str, path)) or "<root>"
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(f"state dict nests deeper than {MAX_DEPTH} levels at {where!r}")
        if path and not in_extra and _is_pickled_extra_state(path[-1], value):
            from ..te.extra_state import decode_te_extra_state  # never unpickles
            return TEExtraState(walk(decode_te_extra_state(value, where=where), path, True))
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
                if isinstance(k, int) and not _INT_RANGE[0] <= k < _INT_RANGE[1]:
                    raise UnsupportedValueError(f"dict key {k} at {where!r} does not fit in 64 bits")
                out[k] = walk(v, path + (k,), in_extra)
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(v, path + (i,), in_extra) for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            if isinstance(value, int) and not isinstance(value, bool) and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
                raise UnsupportedValueError(f"integer at {where!r} does not fit in 64 bits")
            return value
        if isinstance(value, torch.dtype):
            raise UnsupportedValueError(f"value at {where!r} is a torch.dtype; store its name as a string")
        raise UnsupportedValueError(
            f"value at {where!r} has type {type(value).__name__}, which te-serial stores only as "
            "tensors, numbers, strings, bools, None, lists, tuples or dicts (no pickle)")

    return walk(obj, (), False), tensors


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

_PLAIN = frozenset({str, int, float, bool, type(None), bytes})  # the scalar types a tree may hold
_MSGPACK_ERRORS = (ValueError, TypeError, OverflowError, msgpack.ExtraData, msgpack.FormatError,
                   msgpack.StackError, msgpack.OutOfData, UnicodeDecodeError, RecursionError)


class _Unpacker:
    """One decode: nested extension payloads count towards one depth limit (each is decoded by a
    recursive call, so without a bound a few hundred bytes could exhaust the C stack); maps with
    repeated keys are refused; ``field`` is the top-level manifest field being decoded."""

    def __init__(self, source: Optional[str] = None) -> None:
        self.depth = 0
        self.source = source
        self.field: Optional[str] = None
        self.ext_allowed = True

    def fail(self, message: str) -> ManifestError:
        return ManifestError(message, file=self.source, field=self.field)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if not self.ext_allowed:
            raise self.fail(f"msgpack extension type {code} outside the manifest's tree "
                            "(te-serial writes extension types only inside 'tree')")
        if code == TENSOR_EXT:
            try:
                return TensorRef(data.decode("utf-8"))
            except UnicodeDecodeError:
                raise self.fail("a tensor reference whose name is not UTF-8") from None
        if code in (TUPLE_EXT, TE_EXTRA_STATE_EXT):
            if self.depth >= MAX_DEPTH:
                raise self.fail(f"the manifest's tree nests extension types deeper than {MAX_DEPTH} levels")
            self.depth += 1
            try:
                inner = self.unpackb(data)
            finally:
                self.depth -= 1
            if code == TUPLE_EXT:
                if type(inner) is not list:
                    raise self.fail(f"a tuple extension whose payload is a {type(inner).__name__}, not an array")
                return tuple(inner)
            return TEExtraState(inner)
        raise self.fail(f"unknown msgpack extension type {code} in manifest")

    def pairs(self, pairs: list) -> dict:
        """object_pairs_hook: a dict, refusing repeated keys (msgpack would keep the last)."""
        try:
            d = dict(pairs)
        except TypeError:  # an unhashable key (an array or map, or a tuple holding one)
            raise self.fail("a map key that is an array or a map") from None
        if len(d) != len(pairs):
            seen: set = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise self.fail(f"a map with the key {_short(dup)} more than once")
        return d  # key types: check_tree names the path of a tree key te-serial never writes

    def options(self, **limits: int) -> dict:
        """msgpack's decoding options for this decode (``limits``: overrides of UNPACK_LIMITS).
        timestamp=0: msgpack's timestamp type becomes a msgpack.Timestamp (refused by check_tree
        like every type te-serial never writes), never a datetime, whose conversion can raise
        OverflowError."""
        return dict(ext_hook=self.ext_hook, object_pairs_hook=self.pairs, raw=False, strict_map_key=False,
                    use_list=True, timestamp=0, **dict(UNPACK_LIMITS, **limits))

    def unpackb(self, data: bytes) -> Any:
        return msgpack.unpackb(data, **self.options())


def _short(value: Any) -> str:
    r = repr(value) if not isinstance(value, (bytes, str)) or len(value) <= 60 else repr(value[:60]) + "..."
    return r if len(r) <= 100 else r[:100] + "..."


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`, with size limits; any malformation is a :class:`ManifestError`.

    Extension types are accepted anywhere (tools and tests use this to read and edit
    manifests); a reader uses :func:`unpack_manifest`."""
    try:
        return _Unpacker().unpackb(data)
    except ManifestError:
        raise
    except _MSGPACK_ERRORS as e:
        raise ManifestError(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None


def unpack_manifest(data: bytes, *, source: Optional[str] = None) -> dict:
    """Decode a manifest: a map with str keys, extension types only inside ``tree``.

    Every field but ``tree`` is decoded with ``max_ext_len=0``, so msgpack itself refuses any
    extension type or timestamp there (unknown fields may hold only plain msgpack values);
    ``tree`` is decoded with te-serial's three extension types (and is then for
    :func:`check_tree`). Repeated keys in any map, a top level that is not a map, trailing bytes
    and every msgpack error raise :class:`ManifestError` naming ``source`` and the field.
    """
    u = _Unpacker(source)
    try:
        stream = msgpack.Unpacker(None, max_buffer_size=max(len(data), 1), **u.options(max_ext_len=0))
        stream.feed(data)
        try:
            n = stream.read_map_header()
        except (ValueError, msgpack.OutOfData, msgpack.FormatError):
            raise ManifestError("manifest is not a msgpack map", file=source) from None
        doc: dict = {}
        for _ in range(n):
            u.field, u.ext_allowed = None, False
            key = stream.unpack()
            if type(key) is not str:
                raise ManifestError(f"manifest key {_short(key)} is not a str", file=source)
            if key in doc:
                raise ManifestError(f"manifest field {key!r} appears more than once", file=source, field=key)
            u.field = key
            if key == "tree":
                start = stream.tell()
                stream.skip()
                u.ext_allowed = True
                doc[key] = u.unpackb(data[start:stream.tell()])
            elif key == "tensors":
                start = stream.tell()
                stream.skip()
                doc[key] = _unpack_columns(data[start:stream.tell()], u)
            else:
                doc[key] = stream.unpack()
        if stream.tell() != len(data):
            u.field = None
            raise ManifestError(f"{len(data) - stream.tell()} trailing bytes after the manifest's map",
                                file=source)
        return doc
    except ManifestError:
        raise
    except ValueError as e:
        if "max_ext_len" in str(e) and not u.ext_allowed:  # an extension type / timestamp outside the tree
            raise u.fail("a msgpack extension type or timestamp outside the manifest's tree "
                         "(te-serial writes extension types only inside 'tree')") from None
        raise u.fail(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None
    except _MSGPACK_ERRORS as e:
        raise u.fail(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class DeferredColumn:
    """A manifest column kept as its msgpack bytes until first used (the checksums: a uint64 per
    buffer, most of a manifest's decoding and validation, and needed only to verify a read).
    The manifest's own checksum already covers these bytes; :meth:`Manifest.checksums` decodes and
    validates them on first access."""

    raw: bytes


#: the ``tensors`` columns decoded only when first used
DEFERRED_COLUMNS = frozenset({"checksums"})


def _unpack_columns(raw: bytes, u: "_Unpacker") -> Any:
    """The ``tensors`` field: a map whose deferred columns stay bytes (nil stays None); anything
    else is decoded as any field is (and left for the schema to refuse if it is not a map)."""
    if not raw or not (0x80 <= raw[0] <= 0x8F or raw[0] in (0xDE, 0xDF)):
        return msgpack.unpackb(raw, **u.options(max_ext_len=0))
    sub = msgpack.Unpacker(None, max_buffer_size=max(len(raw), 1), **u.options(max_ext_len=0))
    sub.feed(raw)
    cols: dict = {}
    for _ in range(sub.read_map_header()):
        key = sub.unpack()
        if type(key) is not str:
            raise u.fail(f"a tensors column name {_short(key)} that is not a str")
        if key in cols:
            raise u.fail(f"a map with the key {_short(key)} more than once")
        if key in DEFERRED_COLUMNS:
            start = sub.tell()
            sub.skip()
            body = raw[start:sub.tell()]
            cols[key] = None if body == b"\xc0" else DeferredColumn(body)
        else:
            cols[key] = sub.unpack()
    return cols


def unpack_column(raw: bytes, *, source: Optional[str] = None, field: Optional[str] = None) -> Any:
    """A deferred column's value, decoded as :func:`unpack_manifest` decodes fields (no extension
    types, the same limits); a malformation is a :class:`ManifestError` naming ``field``."""
    u = _Unpacker(source)
    u.field, u.ext_allowed = field, False
    try:
        return msgpack.unpackb(raw, **u.options(max_ext_len=0))
    except ManifestError:
        raise
    except _MSGPACK_ERRORS as e:
        raise u.fail(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None


def _path_str(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


class _TreeChecker:
    def __init__(self, source: Optional[str]) -> None:
        self.source = source
        self.refs: list[str] = []
        self.extra_refs: list[str] = []

    def fail(self, message: str, path: tuple) -> ManifestError:
        return ManifestError(f"manifest tree: {message}", file=self.source, tensor=_path_str(path) if path else None,
                             field="tree")

    def node(self, v: Any, path: tuple, depth: int) -> None:
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None or t is bytes:
            return
        if depth > MAX_DEPTH:
            raise self.fail(f"nests deeper than {MAX_DEPTH} levels", path)
        if t is TensorRef:
            self.refs.append(v.name)
            return
        if t is dict:
            for k, x in v.items():
                if type(k) is not str and type(k) is not int:
                    raise self.fail(f"map key {_short(k)} is a {type(k).__name__} (te-serial writes str "
                                    "and int keys only)", path)
                if type(x) is TEExtraState:
                    self.extra_state(x, path + (k,), depth + 1)
                else:
                    self.node(x, path + (k,), depth + 1)
            return
        if t is list or t is tuple:
            if _PLAIN.issuperset(map(type, v)):  # lists of scalars at C speed
                return
            for i, x in enumerate(v):
                self.node(x, path + (i,), depth + 1)
            return
        if t is TEExtraState:
            raise self.fail("TE extra state that is not the value of a '..._extra_state' key", path)
        raise self.fail(f"a value of type {t.__module__}.{t.__qualname__}, which te-serial never writes", path)

    def extra_state(self, x: TEExtraState, path: tuple, depth: int) -> None:
        from ..te.extra_state import check_extra_state
        where = _path_str(path)
        if not (type(path[-1]) is str and path[-1].endswith(EXTRA_STATE_SUFFIX)):
            raise self.fail("TE extra state that is not the value of a '..._extra_state' key", path)
        if depth > MAX_DEPTH:
            raise self.fail(f"nests deeper than {MAX_DEPTH} levels", path)

        def error(message: str) -> ManifestError:
            return ManifestError(f"manifest tree: {message}", file=self.source, tensor=where, field="tree")

        refs = check_extra_state(x.state, where=where, tensor_type=TensorRef, error=error)
        names = [r.name for r in refs]
        self.refs.extend(names)
        self.extra_refs.extend(names)


def check_tree(tree: Any, *, source: Optional[str] = None) -> list[str]:
    """Check a decoded manifest tree (see the module docstring); the tensor names it refers to.

    Raises :class:`ManifestError` (``field="tree"``, the tree path as ``tensor``) for a root that
    is not a map, a key that is not str or int, a value of a type te-serial never writes
    (timestamps, ...), misplaced or malformed TE extra state, a tensor referenced inside an
    extra state and anywhere else too, or nesting deeper than 64.
    """
    checker = _TreeChecker(source)
    if type(tree) is not dict:
        raise ManifestError(f"manifest tree: the root is a {type(tree).__name__}, not a map", file=source,
                            field="tree")
    try:
        checker.node(tree, (), 0)
    except RecursionError:
        raise ManifestError("manifest tree nests too deeply", file=source, field="tree") from None
    if checker.extra_refs:
        counts = Counter(checker.refs)
        twice = [n for n in checker.extra_refs if counts[n] != 1]
        if twice:
            raise ManifestError(f"manifest tree: tensor {twice[0]!r} is referenced by TE extra state and "
                                "again elsewhere (each extra-state tensor is its own)", file=source,
                                tensor=twice[0], field="tree")
    return checker.refs


def extra_state_refs(tree: Any) -> set[str]:
    """Names of the tensors referenced inside TE extra-state nodes of a (checked) tree.

    A reader loads these few small tensors on CPU whatever the target device: TE's
    ``_extra_state`` is CPU bytes, and they cannot be encoded from the meta device."""
    out: set[str] = set()
    stack = [(tree, False, 0)]
    while stack:
        v, inside, depth = stack.pop()
        if depth > 2 * MAX_DEPTH:
            continue  # check_tree refuses such trees; never loop on an unchecked one
        t = type(v)
        if t is TensorRef:
            if inside:
                out.add(v.name)
        elif t is TEExtraState:
            stack.append((v.state, True, depth + 1))
        elif t is dict:
            stack.extend((x, inside, depth + 1) for x in v.values())
        elif (t is list or t is tuple) and not _PLAIN.issuperset(map(type, v)):
            stack.extend((x, inside, depth + 1) for x in v)
    return out


def _tensor_bytes(tensors: dict[str, Any]) -> int:
    total, seen = 0, set()
    for t in tensors.values():
        if id(t) in seen:
            continue
        seen.add(id(t))
        try:
            if isinstance(t, QuantizedTensorStorage):
                total += sum(b.numel() * b.element_size() for b in t.buffers().values())
            elif isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        except Exception:  # noqa: BLE001 - a budget estimate only
            pass
    return total


_MISSING = object()


class _Rebuilder:
    def __init__(self, tensors: dict[str, Any], budget: Any, missing: Optional[list]) -> None:
        self.tensors, self.budget, self.missing = tensors, budget, missing
        self.lost = 0  # references not found in `tensors` so far

    def fail(self, message: str, path: tuple) -> ManifestError:
        return ManifestError(f"manifest tree: {message}", tensor=_path_str(path) if path else None, field="tree")

    def node(self, v: Any, path: tuple, depth: int, in_extra: bool) -> Any:
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None or t is bytes:
            return v
        if depth > MAX_DEPTH:
            raise self.fail(f"nests deeper than {MAX_DEPTH} levels", path)
        if t is TensorRef:
            out = self.tensors.get(v.name, _MISSING)
            if out is _MISSING:
                self.lost += 1
                if self.missing is not None:
                    self.missing.append(v.name)
            return out
        if t is dict:
            out = {}
            for k, x in v.items():
                r = self.node(x, path + (k,), depth + 1, in_extra)
                if r is not _MISSING:
                    out[k] = r
            return out
        if t is list or t is tuple:
            if _PLAIN.issuperset(map(type, v)):  # lists of scalars at C speed
                return list(v) if t is list else v
            items = [self.node(x, path + (i,), depth + 1, in_extra) for i, x in enumerate(v)]
            items = [None if r is _MISSING else r for r in items]
            return items if t is list else tuple(items)
        if t is TEExtraState:
            if in_extra:
                raise self.fail("TE extra state inside TE extra state", path)
            lost = self.lost
            state = self.node(v.state, path, depth + 1, True)
            if self.lost != lost:  # an extra state missing a tensor is left out as a whole
                return _MISSING
            return _te_extra_state_value(state, _path_str(path), self.budget)
        raise self.fail(f"a value of type {t.__module__}.{t.__qualname__}, which te-serial never writes", path)


def rebuild_tree(tree: Any, tensors: dict[str, Any], *, budget: Any = None, missing: Optional[list] = None,
                 file: Optional[str] = None) -> Any:
    """Replace TensorRef leaves by tensors, and TE extra state by TE's ``_extra_state`` bytes.

    ``budget`` is the :class:`~te_serial.te.extra_state.ExtraStateBudget` of the whole
    checkpoint (``ExtraStateBudget(F)``, F = manifest + buffer files in bytes); by default one is
    made from the bytes of ``tensors``. A name absent from ``tensors`` (skipped by a non-strict
    load) is dropped from its dict and becomes ``None`` in a list or tuple; an extra state that
    refers to one is left out (``None`` in a list) as a whole; such names are appended to
    ``missing`` when given. Extra-state tensors may be on any device but ``meta``, which has no
    bytes to encode (an :class:`~te_serial.errors.UnsupportedValueError`; the reader loads them on
    CPU whatever the target device). Without Transformer Engine (or with one
    that lacks a class the state names) an extra state is returned decoded, with a warning.
    Every failure is a :class:`~te_serial.errors.CheckpointError` naming ``file``.
    """
    if budget is None:
        budget = ExtraStateBudget(_tensor_bytes(tensors))
    try:
        out = _Rebuilder(tensors, budget, missing).node(tree, (), 0, False)
    except CheckpointError as e:
        raise _with_file(e, file) from None
    except RecursionError:
        raise ManifestError("manifest tree nests too deeply", file=file, field="tree") from None
    return {} if out is _MISSING else out


def _with_file(e: CheckpointError, file: Optional[str]) -> CheckpointError:
    """The same error naming ``file`` too (CheckpointError bakes its context into the message)."""
    if file is None or e.file is not None:
        return e
    where = ", ".join(f"{k}={v!r}" for k, v in (("file", e.file), ("tensor", e.tensor), ("field", e.field))
                      if v is not None)
    msg = str(e)
    if where and msg.endswith(f" ({where})"):
        msg = msg[: -len(where) - 3]
    try:
        new = type(e)(msg, file=file, tensor=e.tensor, field=e.field)
    except Exception:  # noqa: BLE001 - a subclass with another signature: keep the original
        return e
    new.__cause__ = e.__cause__
    return new


def _te_extra_state_value(state: Any, where: str, budget: Any) -> Any:
    """TE's own ``_extra_state`` bytes for a decoded state (TE's recipe classes are needed to
    write them); without TE, the decoded dict itself, with a warning."""
    from ..te.extra_state import TEUnavailableError, check_extra_state, encode_te_extra_state
    check_extra_state(state, where=where, budget=budget)
    try:
        return encode_te_extra_state(state, where=where, budget=budget)
    except TEUnavailableError as e:
        warnings.warn(f"te-serial: TE extra state {where!r} returned decoded, not as TE's bytes: {e}",
                      stacklevel=4)
        return state
