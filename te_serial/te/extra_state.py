"""Read and write Transformer Engine module ``_extra_state`` without ever unpickling it.

What TE stores
--------------
Every TE module (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``,
``DotProductAttention`` ...) puts an ``<prefix>_extra_state`` entry in its state dict
(``TransformerEngineBaseModule.get_extra_state`` in ``transformer_engine/pytorch/module/base.py``):

* ``torch.empty(0, dtype=torch.uint8)`` when FP8 is not in use or the recipe is stateless
  (``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``Float8BlockScaling``, ``NVFP4BlockScaling``);
* otherwise a 1-D ``uint8`` tensor holding ``pickle.dumps(state)`` (default protocol, 4 on
  Python 3.8-3.13), where ``state`` is a dict::

      {"recipe": <transformer_engine.common.recipe.DelayedScaling instance>,
       "scale_fwd": fp32 CPU tensor, "amax_history_fwd": fp32 CPU tensor (amax_history_len, n),
       "scale_bwd": ..., "amax_history_bwd": ...,
       "extra_fp8_variables": {the bool/int/float/str/tuple/list entries of fp8_meta}}

  The recipe is pickled by reference to ``transformer_engine.common.recipe`` (``STACK_GLOBAL`` +
  ``NEWOBJ`` + ``BUILD`` of its ``__dict__``; the ``Format`` enum as ``REDUCE(Format,
  (NEWOBJ(_FormatHelper, (max_fwd, max_bwd)),))``). Each tensor is pickled as
  ``REDUCE(torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, requires_grad,
  REDUCE(collections.OrderedDict, ())))`` and each storage as
  ``REDUCE(torch.storage._load_from_bytes, (bytes,))`` -- the bytes being a complete *legacy*
  (non-zip) ``torch.save`` of that storage: five concatenated protocol-2 pickles (magic number,
  protocol version 1001, sys-info dict, the storage as a ``BINPERSID`` of
  ``("storage", torch.FloatStorage, key, location, numel, None)``, the list of keys), then per
  key an int64 little-endian element count and the raw little-endian bytes;
* TE 1.x wrote no ``recipe`` (and also ``scale_inv_fwd`` / ``scale_inv_bwd``), and before
  TE 2.0 (PR #1335) the value was an ``io.BytesIO`` holding ``torch.save(state)`` (zip format
  with ``archive/data.pkl`` + ``archive/data/<key>``; ``torch.save(None)`` when FP8 was off),
  whose tensors usually live on ``cuda:0``.

TE's own ``set_extra_state`` classifies the pickle with ``pickletools`` and refuses to
``pickle.loads`` a delayed-scaling (or unknown) payload unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` -- because unpickling executes whatever callables the
payload names.

Why we never unpickle
---------------------
A checkpoint is untrusted input. ``pickle.loads`` (and ``torch.load``, even with
``weights_only=True``, whose allow-list and parser have had bypasses) runs code chosen by the
file. This module instead walks the opcodes with :func:`pickletools.genops` -- a pure parser that
executes nothing -- and interprets them with a tiny stack machine that knows only the shapes TE
writes. No global is ever imported or called: an allowed ``GLOBAL`` becomes an inert marker,
and ``REDUCE`` / ``NEWOBJ`` / ``BUILD`` are accepted only for the exact (callable, arguments)
combinations above, each reimplemented here as plain data. Tensors are rebuilt from the raw
storage bytes with ``torch.frombuffer`` + ``as_strided`` after bounds checks; the nested
``torch.save`` payloads are parsed by hand (legacy format) or with :mod:`zipfile` (zip format).

What is accepted
----------------
Opcodes: ``PROTO FRAME STOP MARK POP POP_MARK DUP``, ``NONE NEWTRUE NEWFALSE``, ``INT BININT
BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT``, ``UNICODE BINUNICODE SHORT_BINUNICODE
BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8``, ``EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE
TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS``, the memo opcodes, ``GLOBAL
STACK_GLOBAL REDUCE NEWOBJ BUILD``, and ``BINPERSID`` inside ``torch.save`` payloads only.

Globals: ``torch._utils._rebuild_tensor_v2``, ``torch.storage._load_from_bytes`` (top level
only), ``collections.OrderedDict`` (only called with no arguments, as a tensor's empty
backward-hooks), ``torch.{Float,Half,BFloat16,Byte,Char,Short,Int,Long,Bool}Storage`` (only
inside ``torch.save`` persistent ids) and the recipe classes of
``transformer_engine.common.recipe`` (see :data:`RECIPE_CLASSES`, :data:`RECIPE_NAMEDTUPLES`,
``Format``).

Output: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``
and CPU ``torch.Tensor`` only. A recipe object becomes ``{"__class__": "DelayedScaling",
"fields": {...}}`` (namedtuples too, with their field names), an enum member becomes
``{"__enum__": "Format", "name": "HYBRID"}``.

Everything else -- an unknown global, a ``REDUCE`` of anything but the combinations above,
``INST``/``OBJ``/``NEWOBJ_EX``/``EXT*``/``PERSID``/buffers/sets/py2 strings, cycles, nesting
deeper than :data:`MAX_DEPTH`, storages that claim more bytes than present or more than
:data:`MAX_STORAGE_BYTES`, views with a negative or zero stride (on a dimension of size > 1),
overlapping views, views reaching past their storage, recipe fields that are not plain
identifiers (``__class__``, ``__reduce_ex__`` ...), zip payloads with compressed, encrypted or more
than :data:`MAX_ZIP_ENTRIES` entries, truncated or trailing data -- raises
:class:`UnsafeExtraStateError` (a :class:`~te_serial.errors.UnsupportedValueError`, so a
:class:`~te_serial.errors.CheckpointError`) naming what was refused and where. No other exception
class leaves :func:`decode_te_extra_state` for any input.

Bounds
------
All ``_extra_state`` entries of one checkpoint share one :class:`ExtraStateBudget`, made from
F = the checkpoint's size in bytes (the manifest plus every buffer file; for a single file, its
size):

* work -- pickle opcodes interpreted plus values checked, converted or rebuilt -- at most
  ``min(2,000,000, 65,536 + F / 4)`` steps for the whole checkpoint, and at most 262,144
  (:data:`MAX_PAYLOAD_WORK`) for the decoding of any one payload;
* bytes -- tensor and storage bytes materialized by the decoder, tensor copies and encoded
  payloads made while loading -- at most ``2 * F + 16 MiB`` for the whole checkpoint;
* one payload at most :data:`MAX_PAYLOAD_BYTES` (64 MiB), one storage at most
  :data:`MAX_STORAGE_BYTES` (64 MiB), a zip payload at most :data:`MAX_ZIP_ENTRIES` entries,
  stored (never compressed) and unencrypted; at most :data:`MAX_MEMO` memo entries,
  :data:`MAX_STACK` stack items, :data:`MAX_DEPTH` levels of nesting, ints of
  :data:`MAX_INT_BITS` bits.

A value decoded outside a checkpoint (``decode_te_extra_state(value)``, e.g. while saving)
gets a budget of its own with F = the payload's length. Past a bound the entry is refused with
:class:`UnsafeExtraStateError` before the memory is allocated. While one entry is encoded,
transient memory is a small multiple (about 4x) of that entry's tensor bytes.

:func:`encode_te_extra_state` is the inverse: it rebuilds real
``transformer_engine.common.recipe`` objects (so it needs TE's Python package importable) and
calls ``pickle.dumps`` exactly as ``get_extra_state`` does, so TE's ``set_extra_state`` reads the
result and, for the same state, the bytes equal TE's own except for the storage keys inside
the nested ``torch.save`` payloads (TE uses the storages' memory addresses). What it pickles is
only what it built itself -- plain values, CPU tensor copies, and instances of the installed TE's
recipe classes whose instance dicts hold such values under identifier, non-dunder names -- so
the result is not decoded again (a pure-Python re-check over bytes we produced ourselves would
only cost time in proportion to the payload). Where the installed TE (or its absence) cannot
express a valid state, it raises :class:`TEUnavailableError`; loading then returns the decoded
state with a warning.
"""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools
import re
import reprlib
import struct
import sys
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import UnsupportedValueError


class UnsafeExtraStateError(UnsupportedValueError):
    """A TE ``_extra_state`` payload uses something the restricted decoder refuses (or is malformed)."""


class TEUnavailableError(UnsupportedValueError):
    """A valid extra state that the installed Transformer Engine cannot express as TE's bytes:
    its recipe module is not importable, or lacks a class, enum member or field layout the state
    names. Loading returns the decoded state with a warning instead."""


# --------------------------------------------------------------------------- limits

MAX_PAYLOAD_BYTES = 64 << 20
"""Largest extra-state payload accepted (a 256-GEMM GroupedLinear's amax histories are ~5 MiB)."""
MAX_STORAGE_BYTES = 64 << 20
"""Largest single storage accepted."""
MAX_DEPTH = 32
"""Deepest container nesting accepted in the decoded value."""
MAX_NODES = 1_000_000
"""Most values (counting shared ones each time they are reachable) in one decoded value."""
MAX_STACK = 100_000
MAX_MARKS = 64
MAX_MEMO = 65_536
MAX_INT_BITS = 1024
MAX_NDIM = 32
MAX_ZIP_ENTRIES = 1024
"""Most entries in a zip-format ``torch.save`` payload (TE 1.x wrote fewer than 20)."""

MAX_WORK = 2_000_000
"""Most work units (opcodes + values) for all extra state of one checkpoint."""
MAX_PAYLOAD_WORK = 1 << 18
"""Most work units one payload's decode may spend (a TE payload needs a few thousand)."""
WORK_SLACK = 1 << 16
WORK_BYTES_PER_UNIT = 4
BYTES_FACTOR = 2
BYTES_SLACK = 16 << 20


class ExtraStateBudget:
    """Work and bytes that all ``_extra_state`` entries of one checkpoint may spend together.

    ``file_bytes`` is the checkpoint's size (manifest + buffer files). Work (pickle opcodes
    interpreted, values checked / converted / rebuilt) is bounded by
    ``min(MAX_WORK, WORK_SLACK + file_bytes // WORK_BYTES_PER_UNIT)``; bytes (tensor bytes
    materialized by the decoder, storage bytes it copies, encoded payloads) by
    ``BYTES_FACTOR * file_bytes + BYTES_SLACK``. Exceeding either raises
    :class:`UnsafeExtraStateError` before the memory is allocated.
    """

    __slots__ = ("file_bytes", "max_work", "max_bytes", "work", "bytes")

    def __init__(self, file_bytes: int) -> None:
        f = max(0, int(file_bytes))
        self.file_bytes = f
        self.max_work = min(MAX_WORK, WORK_SLACK + f // WORK_BYTES_PER_UNIT)
        self.max_bytes = BYTES_FACTOR * f + BYTES_SLACK
        self.work = 0
        self.bytes = 0

    def __repr__(self) -> str:
        return (f"ExtraStateBudget(file_bytes={self.file_bytes}, work={self.work}/{self.max_work}, "
                f"bytes={self.bytes}/{self.max_bytes})")

    def exhausted(self, where: Optional[str]) -> UnsafeExtraStateError:
        return UnsafeExtraStateError(
            f"TE extra state: over its budget of {self.max_work} steps (pickle opcodes and value "
            f"nodes; checkpoint of {self.file_bytes} bytes)", tensor=where)

    def spend(self, units: int, where: Optional[str]) -> None:
        self.work += units
        if self.work > self.max_work:
            raise self.exhausted(where)

    def spend_bytes(self, n: int, where: Optional[str], what: str = "") -> None:
        self.bytes += n
        if self.bytes > self.max_bytes:
            raise UnsafeExtraStateError(
                f"TE extra state: {what + ' ' if what else ''}would take the checkpoint's extra "
                f"state past {self.max_bytes} bytes (2 x its {self.file_bytes} bytes + 16 MiB)",
                tensor=where)


# --------------------------------------------------------------------------- what TE writes

RECIPE_MODULE = "transformer_engine.common.recipe"
RECIPE_CLASSES = frozenset({
    "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "MMParams", "QParams",
})  # fmt: skip
"""Classes of ``transformer_engine.common.recipe`` rebuilt as ``NEWOBJ(cls, ()) + BUILD(dict)``."""
RECIPE_NAMEDTUPLES: Dict[str, Tuple[str, ...]] = {
    "_FormatHelper": ("max_fwd", "max_bwd"),
    "_OverrideLinearPrecision": ("fprop", "dgrad", "wgrad"),  # DelayedScaling field up to TE 2.x
}
"""NamedTuples of the recipe module (``NEWOBJ(cls, values)``) and their field names."""
_FORMAT_MEMBERS: Dict[Tuple[Any, Any], str] = {
    (6, 6): "E2M1", (448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID",
}  # fmt: skip
_RECIPE_ENUMS = {"Format": _FORMAT_MEMBERS}
_STATELESS_RECIPES = frozenset({"Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                                "NVFP4BlockScaling"})
_KNOWN_RECIPE_POLICIES = _STATELESS_RECIPES | {"DelayedScaling", "CustomRecipe"}

DELAYED_SCALING_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")

_STORAGE_DTYPES: Dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "ByteStorage": torch.uint8, "CharStorage": torch.int8, "ShortStorage": torch.int16,
    "IntStorage": torch.int32, "LongStorage": torch.int64, "BoolStorage": torch.bool,
}  # fmt: skip
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001
_LEGACY_PREFIX = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."  # pickle.dumps(_LEGACY_MAGIC, 2)
_LOCATION_RE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")
_ZIP_KEY_RE = re.compile(r"[A-Za-z0-9_]{1,64}")


# --------------------------------------------------------------------------- inert markers


class _Global:
    """An allowed global, never imported: just what it names and what it may be used for."""

    __slots__ = ("module", "name", "kind")

    def __init__(self, module: str, name: str, kind: str) -> None:
        self.module, self.name, self.kind = module, name, kind

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class _RecipeObj:
    """``NEWOBJ(recipe_cls, ())`` then ``BUILD(state)``: the class name and its instance dict."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: str) -> None:
        self.cls, self.fields = cls, None


class _NamedTupleObj:
    __slots__ = ("cls", "values")

    def __init__(self, cls: str, values: tuple) -> None:
        self.cls, self.values = cls, values


class _EnumMember:
    __slots__ = ("cls", "name")

    def __init__(self, cls: str, name: str) -> None:
        self.cls, self.name = cls, name


class _EmptyHooks:
    """``collections.OrderedDict()``: only valid as a tensor's (empty) backward hooks."""

    __slots__ = ()


class _Storage:
    __slots__ = ("dtype", "key", "location", "numel", "data")

    def __init__(self, dtype: torch.dtype, key: str, location: str, numel: int) -> None:
        self.dtype, self.key, self.location, self.numel = dtype, key, location, numel
        self.data: Optional[bytes] = None


class _TensorSpec:
    __slots__ = ("storage", "offset", "size", "stride", "requires_grad")

    def __init__(self, storage, offset, size, stride, requires_grad) -> None:
        self.storage, self.offset, self.size = storage, offset, size
        self.stride, self.requires_grad = stride, requires_grad


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _describe(obj: Any) -> str:
    if isinstance(obj, _Global):
        return f"global {obj!r}"
    if isinstance(obj, (_RecipeObj, _NamedTupleObj)):
        return f"{RECIPE_MODULE}.{obj.cls} object"
    if isinstance(obj, _EnumMember):
        return f"{RECIPE_MODULE}.{obj.cls}.{obj.name}"
    if isinstance(obj, _Storage):
        return "torch storage"
    if isinstance(obj, _TensorSpec):
        return "tensor"
    if isinstance(obj, _EmptyHooks):
        return "collections.OrderedDict object"
    return type(obj).__name__


class _ShortRepr(reprlib.Repr):
    """reprlib that never builds the full repr of a large bytes / str value first."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 6

    def repr_bytes(self, x, level):
        return repr(bytes(x[:40])) + (f"...({len(x)} bytes)" if len(x) > 40 else "")

    repr_bytearray = repr_bytes


_SHORT = _ShortRepr()


def _short(obj: Any) -> str:
    """A bounded repr for error messages (a hostile value may be megabytes long)."""
    try:
        return _SHORT.repr(obj)
    except Exception:  # pylint: disable=broad-except  # a repr is never worth an escaping error
        return f"<{type(obj).__name__}>"


def _bad_field_name(name: Any) -> bool:
    """Recipe instance-dict keys must be plain identifiers; never dunders (``__reduce_ex__`` in an
    instance dict would be called by ``pickle.dumps``; ``__class__`` / ``__dict__`` are not
    fields)."""
    return type(name) is not str or not name.isidentifier() or (
        name.startswith("__") and name.endswith("__"))


class _Ctx:
    """One decode: where to name in errors, the budget, and storages already turned into tensors."""

    __slots__ = ("where", "budget", "bases", "handed_out")

    def __init__(self, where: Optional[str], budget: ExtraStateBudget) -> None:
        self.where, self.budget = where, budget
        self.bases: Dict[int, torch.Tensor] = {}
        self.handed_out: set = set()


# --------------------------------------------------------------------------- the stack machine

_MARK = object()
_SCALARS = (type(None), bool, int, float, str, bytes)
_SCALAR_SET = frozenset(_SCALARS)


_INTS = frozenset({int, bool})


def _widest_int(values: Any) -> int:
    """Bits of the widest int among scalars (C speed when they are all ints / bools)."""
    types = set(map(type, values))
    if int not in types:
        return 0
    if types <= _INTS:
        return max(max(values).bit_length(), min(values).bit_length())
    return max(x.bit_length() for x in values if type(x) is int)


class _Machine:
    """Interprets one pickle with ``pickletools.genops``; knows only what TE's payloads contain.

    ``persistent_load`` is set only inside ``torch.save`` payloads (it also enables the
    ``torch.*Storage`` globals); ``nested_storage`` enables ``torch.storage._load_from_bytes``
    (top-level ``pickle.dumps`` payloads only, so nesting is one level deep at most). Every
    opcode spends one unit of the decode's budget.
    """

    def __init__(self, context: str, ctx: _Ctx, *,
                 persistent_load: Optional[Callable[[Any, int], Any]] = None,
                 nested_storage: bool = False) -> None:
        self.context, self.ctx, self.where = context, ctx, ctx.where
        self.persistent_load = persistent_load
        self.nested_storage = nested_storage
        self.stack: List[Any] = []
        self.metastack: List[List[Any]] = []
        self.memo: Dict[int, Any] = {}
        self.pos = 0

    # -- errors
    def refuse(self, what: str) -> UnsafeExtraStateError:
        return UnsafeExtraStateError(f"TE extra state ({self.context}): refused {what} "
                                     f"at byte {self.pos}", tensor=self.where)

    # -- stack helpers
    def push(self, value: Any) -> None:
        if len(self.stack) >= MAX_STACK:
            raise self.refuse(f"a pickle stack deeper than {MAX_STACK} items")
        self.stack.append(value)

    def pop(self) -> Any:
        if not self.stack:
            raise self.refuse("an opcode that pops from an empty stack")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.refuse("an opcode that reads an empty stack")
        return self.stack[-1]

    def pop_mark(self) -> List[Any]:
        if not self.metastack:
            raise self.refuse("an opcode that needs a MARK but none is open")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # -- main loop
    def run(self, f: io.BytesIO) -> Any:
        budget = self.ctx.budget
        try:
            for opcode, arg, pos in pickletools.genops(f):
                self.pos = pos if pos is not None else self.pos
                budget.work += 1
                if budget.work > budget.max_work:
                    raise budget.exhausted(self.where)
                name = opcode.name
                if name == "STOP":
                    if self.metastack or len(self.stack) != 1:
                        raise self.refuse("a STOP with unbalanced MARKs or extra stack items")
                    return self.stack.pop()
                handler = _HANDLERS.get(name)
                if handler is None:
                    raise self.refuse(f"opcode {name}")
                handler(self, arg)
        except UnsafeExtraStateError:
            raise
        except RecursionError:
            raise self.refuse("a pickle nested too deeply") from None
        except Exception as exc:  # genops: truncated data, bad lengths, bad UTF-8 ...
            raise UnsafeExtraStateError(
                f"TE extra state ({self.context}): malformed pickle near byte {self.pos}: "
                f"{type(exc).__name__}: {_short(str(exc))}", tensor=self.where) from None
        raise self.refuse("a pickle without STOP")

    # -- opcode handlers
    def op_proto(self, arg):
        if not 0 <= arg <= 5:
            raise self.refuse(f"pickle protocol {arg}")

    def op_nothing(self, arg):
        pass

    def op_mark(self, arg):
        if len(self.metastack) >= MAX_MARKS:
            raise self.refuse(f"more than {MAX_MARKS} nested MARKs")
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self, arg):
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self, arg):
        self.pop_mark()

    def op_dup(self, arg):
        self.push(self.top())

    def op_value(self, arg):  # opcodes whose decoded argument *is* the value
        if type(arg) is int and arg.bit_length() > MAX_INT_BITS:
            raise self.refuse(f"an integer wider than {MAX_INT_BITS} bits")
        stack = self.stack
        if len(stack) >= MAX_STACK:
            raise self.refuse(f"a pickle stack deeper than {MAX_STACK} items")
        stack.append(arg)

    def op_none(self, arg):
        self.push(None)

    def op_true(self, arg):
        self.push(True)

    def op_false(self, arg):
        self.push(False)

    def op_empty_list(self, arg):
        self.push([])

    def op_empty_dict(self, arg):
        self.push({})

    def op_empty_tuple(self, arg):
        self.push(())

    def op_list(self, arg):
        self.push(list(self.pop_mark()))

    def op_tuple(self, arg):
        self.push(tuple(self.pop_mark()))

    def op_tuple1(self, arg):
        self.push((self.pop(),))

    def op_tuple2(self, arg):
        b, a = self.pop(), self.pop()
        self.push((a, b))

    def op_tuple3(self, arg):
        c, b, a = self.pop(), self.pop(), self.pop()
        self.push((a, b, c))

    def op_dict(self, arg):
        items = self.pop_mark()
        if len(items) % 2:
            raise self.refuse("DICT with an odd number of items")
        d: Dict[Any, Any] = {}
        for i in range(0, len(items), 2):
            self.set_item(d, items[i], items[i + 1])
        self.push(d)

    def _list_target(self) -> list:
        target = self.top()
        if type(target) is not list:
            raise self.refuse(f"APPEND to a {_describe(target)}")
        return target

    def op_append(self, arg):
        value = self.pop()
        self._list_target().append(value)

    def op_appends(self, arg):
        items = self.pop_mark()
        self._list_target().extend(items)

    def set_item(self, d: Any, key: Any, value: Any) -> None:
        if type(d) is not dict:
            raise self.refuse(f"SETITEM on a {_describe(d)}")
        _check_key(key, self.refuse)
        d[key] = value

    def op_setitem(self, arg):
        value, key = self.pop(), self.pop()
        self.set_item(self.top(), key, value)

    def op_setitems(self, arg):
        items = self.pop_mark()
        if len(items) % 2:
            raise self.refuse("SETITEMS with an odd number of items")
        d = self.top()
        for i in range(0, len(items), 2):
            self.set_item(d, items[i], items[i + 1])

    def op_put(self, arg):
        if len(self.memo) >= MAX_MEMO and arg not in self.memo:
            raise self.refuse(f"more than {MAX_MEMO} memo entries")
        if not isinstance(arg, int) or arg < 0:
            raise self.refuse(f"memo index {_short(arg)}")
        self.memo[arg] = self.top()

    def op_memoize(self, arg):
        self.op_put(len(self.memo))

    def op_get(self, arg):
        try:
            self.push(self.memo[arg])
        except (KeyError, TypeError):
            raise self.refuse(f"a read of unset memo entry {_short(arg)}") from None

    def op_global(self, arg):
        parts = arg.split(" ") if isinstance(arg, str) else []
        if len(parts) != 2:
            raise self.refuse(f"GLOBAL {_short(arg)}")
        self.push(self.resolve(parts[0], parts[1]))

    def op_stack_global(self, arg):
        name, module = self.pop(), self.pop()
        if type(module) is not str or type(name) is not str:
            raise self.refuse("STACK_GLOBAL of non-string names")
        self.push(self.resolve(module, name))

    def op_reduce(self, arg):
        args, func = self.pop(), self.pop()
        self.push(self.call(func, args))

    def op_newobj(self, arg):
        args, cls = self.pop(), self.pop()
        self.push(self.new(cls, args))

    def op_build(self, arg):
        state = self.pop()
        inst = self.top()
        if not isinstance(inst, _RecipeObj):
            raise self.refuse(f"BUILD of a {_describe(inst)}")
        if inst.fields is not None:
            raise self.refuse(f"a second BUILD of {_describe(inst)}")
        if type(state) is not dict:
            raise self.refuse(f"BUILD of {_describe(inst)} with a {_describe(state)} state "
                              "(only an instance dict with str keys is accepted)")
        bad = [k for k in state if _bad_field_name(k)]
        if bad:
            raise self.refuse(f"BUILD of {_describe(inst)} with field name {_short(bad[0])} "
                              "(recipe fields are identifiers, never dunder names)")
        inst.fields = state

    def op_binpersid(self, arg):
        pid = self.pop()
        if self.persistent_load is None:
            raise self.refuse("a persistent id (BINPERSID) outside a torch.save payload")
        self.push(self.persistent_load(pid, self.pos))

    # -- the only "calls" we understand
    def resolve(self, module: str, name: str) -> _Global:
        qual = f"{module}.{name}"
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _Global(module, name, "rebuild_tensor")
        if module == "torch.storage" and name == "_load_from_bytes" and self.nested_storage:
            return _Global(module, name, "load_from_bytes")
        if module == "collections" and name == "OrderedDict":
            return _Global(module, name, "ordered_dict")
        if module == "torch" and name in _STORAGE_DTYPES and self.persistent_load is not None:
            return _Global(module, name, "storage_type")
        if module == RECIPE_MODULE:
            if name in RECIPE_CLASSES:
                return _Global(module, name, "recipe_class")
            if name in RECIPE_NAMEDTUPLES:
                return _Global(module, name, "namedtuple")
            if name in _RECIPE_ENUMS:
                return _Global(module, name, "enum")
        raise self.refuse(f"GLOBAL {_short(qual)}")

    def call(self, func: Any, args: Any) -> Any:
        if not isinstance(func, _Global):
            raise self.refuse(f"REDUCE of a {_describe(func)}")
        if type(args) is not tuple:
            raise self.refuse(f"REDUCE of {func!r} with a {_describe(args)} argument")
        kind = func.kind
        if kind == "ordered_dict":
            if args:
                raise self.refuse("REDUCE of collections.OrderedDict with arguments")
            return _EmptyHooks()
        if kind == "enum":
            return self.enum_member(func.name, args)
        if kind == "rebuild_tensor":
            return self.rebuild_tensor(args)
        if kind == "load_from_bytes":
            if len(args) != 1 or type(args[0]) is not bytes:
                raise self.refuse("REDUCE of torch.storage._load_from_bytes without one bytes argument")
            return _parse_legacy_torch_save(args[0], self.ctx, expect_storage=True,
                                            context="nested torch.save of a storage")
        raise self.refuse(f"REDUCE of {func!r}")

    def new(self, cls: Any, args: Any) -> Any:
        if not isinstance(cls, _Global) or type(args) is not tuple:
            raise self.refuse(f"NEWOBJ of a {_describe(cls)}")
        if cls.kind == "recipe_class":
            if args:
                raise self.refuse(f"NEWOBJ of {cls!r} with constructor arguments")
            return _RecipeObj(cls.name)
        if cls.kind == "namedtuple":
            fields = RECIPE_NAMEDTUPLES[cls.name]
            if len(args) != len(fields) or not all(type(a) in _SCALARS for a in args):
                raise self.refuse(f"NEWOBJ of {cls!r} with arguments other than "
                                  f"{len(fields)} scalars")
            return _NamedTupleObj(cls.name, args)
        raise self.refuse(f"NEWOBJ of {cls!r}")

    def enum_member(self, cls: str, args: tuple) -> _EnumMember:
        if len(args) == 1:
            value = args[0]
            if isinstance(value, _NamedTupleObj) and value.cls == "_FormatHelper":
                value = value.values
            if type(value) is tuple and len(value) == 2 and all(
                    type(v) in (int, float) for v in value):
                name = _RECIPE_ENUMS[cls].get(value)
                if name is not None:
                    return _EnumMember(cls, name)
                raise self.refuse(f"{RECIPE_MODULE}.{cls} value {_short(value)} (not a known member)")
        raise self.refuse(f"REDUCE of {RECIPE_MODULE}.{cls} with arguments other than a member value")

    def rebuild_tensor(self, args: tuple) -> _TensorSpec:
        if len(args) not in (6, 7):
            raise self.refuse(f"torch._utils._rebuild_tensor_v2 with {len(args)} arguments")
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        if not isinstance(storage, _Storage):
            raise self.refuse(f"torch._utils._rebuild_tensor_v2 of a {_describe(storage)} "
                              "(expected a storage)")
        if len(args) == 7 and not (type(args[6]) is dict and not args[6]):
            raise self.refuse("tensor metadata in torch._utils._rebuild_tensor_v2")
        if not isinstance(hooks, _EmptyHooks):
            raise self.refuse(f"tensor backward hooks that are a {_describe(hooks)}")
        for label, dims in (("size", size), ("stride", stride)):
            if type(dims) is not tuple or len(dims) > MAX_NDIM or not all(
                    type(d) is int and 0 <= d < (1 << 62) for d in dims):
                raise self.refuse(f"tensor {label} {_short(dims)} (dims and strides are "
                                  f"non-negative ints, at most {MAX_NDIM} of them)")
        if len(size) != len(stride):
            raise self.refuse(f"tensor size {size} and stride {stride} of different lengths")
        if type(offset) is not int or not 0 <= offset < (1 << 62):
            raise self.refuse(f"tensor storage offset {_short(offset)}")
        if type(requires_grad) is not bool:
            raise self.refuse(f"tensor requires_grad {_short(requires_grad)}")
        if requires_grad and not storage.dtype.is_floating_point:
            raise self.refuse(f"requires_grad on a {storage.dtype} tensor")
        _check_view(size, stride, offset, storage.numel, self.refuse)
        return _TensorSpec(storage, offset, size, stride, requires_grad)


_HANDLERS: Dict[str, Callable[[_Machine, Any], None]] = {
    "PROTO": _Machine.op_proto, "FRAME": _Machine.op_nothing, "MARK": _Machine.op_mark,
    "POP": _Machine.op_pop, "POP_MARK": _Machine.op_pop_mark, "DUP": _Machine.op_dup,
    "NONE": _Machine.op_none, "NEWTRUE": _Machine.op_true, "NEWFALSE": _Machine.op_false,
    "INT": _Machine.op_value, "BININT": _Machine.op_value, "BININT1": _Machine.op_value,
    "BININT2": _Machine.op_value, "LONG": _Machine.op_value, "LONG1": _Machine.op_value,
    "LONG4": _Machine.op_value, "FLOAT": _Machine.op_value, "BINFLOAT": _Machine.op_value,
    "UNICODE": _Machine.op_value, "BINUNICODE": _Machine.op_value,
    "SHORT_BINUNICODE": _Machine.op_value, "BINUNICODE8": _Machine.op_value,
    "BINBYTES": _Machine.op_value, "SHORT_BINBYTES": _Machine.op_value,
    "BINBYTES8": _Machine.op_value,
    "EMPTY_LIST": _Machine.op_empty_list, "APPEND": _Machine.op_append,
    "APPENDS": _Machine.op_appends, "LIST": _Machine.op_list,
    "EMPTY_TUPLE": _Machine.op_empty_tuple, "TUPLE": _Machine.op_tuple,
    "TUPLE1": _Machine.op_tuple1, "TUPLE2": _Machine.op_tuple2, "TUPLE3": _Machine.op_tuple3,
    "EMPTY_DICT": _Machine.op_empty_dict, "DICT": _Machine.op_dict,
    "SETITEM": _Machine.op_setitem, "SETITEMS": _Machine.op_setitems,
    "PUT": _Machine.op_put, "BINPUT": _Machine.op_put, "LONG_BINPUT": _Machine.op_put,
    "MEMOIZE": _Machine.op_memoize,
    "GET": _Machine.op_get, "BINGET": _Machine.op_get, "LONG_BINGET": _Machine.op_get,
    "GLOBAL": _Machine.op_global, "STACK_GLOBAL": _Machine.op_stack_global,
    "REDUCE": _Machine.op_reduce, "NEWOBJ": _Machine.op_newobj, "BUILD": _Machine.op_build,
    "BINPERSID": _Machine.op_binpersid,
}  # fmt: skip


def _check_key(key: Any, refuse: Callable[[str], Exception], depth: int = 0) -> None:
    """Dict keys: scalars or (shallow) tuples of scalars; never markers or tensors."""
    if type(key) in _SCALARS:
        return
    if type(key) is tuple and depth < 4:
        for k in key:
            _check_key(k, refuse, depth + 1)
        return
    raise refuse(f"a dict key that is a {_describe(key)}")


def _check_view(size: tuple, stride: tuple, offset: int, numel: int,
                refuse: Callable[[str], Exception]) -> None:
    """A strided view must own distinct elements that all lie inside its storage.

    ``size`` / ``stride`` are tuples of ints in [0, 2**62) (checked by the caller). Refused: a
    zero stride on a dimension of size > 1 (the 2**28-element view of one element that ``clone``
    would materialize), overlapping dimensions, element counts or byte spans past the storage
    (Python ints: nothing overflows here, and after these checks nothing can overflow in torch).
    """
    count = 1
    for n in size:
        count *= n
    if count == 0:
        extent = 1
        for n in size:
            extent *= max(n, 1)
        if extent >= (1 << 62):  # torch computes contiguous strides as int64 products
            raise refuse(f"an empty tensor of size {size} whose strides would overflow")
        return
    if count > numel:
        raise refuse(f"a tensor view of {count} elements reaching past its storage of {numel} "
                     "elements")
    span = 1  # elements covered by the dimensions taken so far (by increasing stride)
    for s, n in sorted((s, n) for n, s in zip(size, stride) if n > 1):
        if s < span:
            raise refuse(f"a tensor view with size {size} and stride {stride} whose elements "
                         "overlap (zero or overlapping strides)")
        span += s * (n - 1)
    last = offset + span - 1
    if last >= numel:
        raise refuse(f"a tensor view (offset {offset}, size {size}, stride {stride}) reaching "
                     f"past its storage of {numel} elements")


def _error(msg: str, where: Optional[str]) -> UnsafeExtraStateError:
    return UnsafeExtraStateError(f"TE extra state: {msg}", tensor=where)


# --------------------------------------------------------------------------- torch.save payloads


def _storage_pid(pid: Any, expect_len: int, refuse: Callable[[str], Exception]):
    if type(pid) is not tuple or len(pid) != expect_len or pid[0] != "storage":
        raise refuse(f"persistent id {_short(pid)} (expected a {expect_len}-tuple "
                     "('storage', <torch storage class>, key, location, numel, ...))")
    _, stype, key, location, numel = pid[:5]
    if not (isinstance(stype, _Global) and stype.kind == "storage_type"):
        raise refuse(f"persistent id storage type {_describe(stype)}")
    if type(key) is not str or not 0 < len(key) <= 64:
        raise refuse(f"storage key {_short(key)}")
    if type(location) is not str or not _LOCATION_RE.fullmatch(location):
        raise refuse(f"storage location {_short(location)}")
    dtype = _STORAGE_DTYPES[stype.name]
    if type(numel) is not int or numel < 0 or numel * _elsize(dtype) > MAX_STORAGE_BYTES:
        raise refuse(f"storage of {_short(numel)} {dtype} elements (limit {MAX_STORAGE_BYTES} bytes)")
    return dtype, key, location, numel


def _parse_legacy_torch_save(data: bytes, ctx: _Ctx, *, expect_storage: bool, context: str) -> Any:
    """Parse a legacy (non-zip) ``torch.save`` payload by hand; storages get their bytes filled in."""
    where = ctx.where
    if len(data) > MAX_PAYLOAD_BYTES:
        raise _error(f"{context} of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
    f = io.BytesIO(data)
    magic = _Machine(f"{context}, magic number", ctx).run(f)
    if type(magic) is not int or magic != _LEGACY_MAGIC:
        raise _error(f"{context}: not a legacy torch.save payload (magic {_short(magic)})", where)
    version = _Machine(f"{context}, protocol version", ctx).run(f)
    if type(version) is not int or version != _LEGACY_PROTOCOL_VERSION:
        raise _error(f"{context}: legacy torch.save protocol version {_short(version)}", where)
    sys_info = _Machine(f"{context}, sys info", ctx).run(f)
    if type(sys_info) is not dict or sys_info.get("protocol_version") != _LEGACY_PROTOCOL_VERSION:
        raise _error(f"{context}: bad sys info {_short(sys_info)}", where)

    storages: Dict[str, _Storage] = {}
    machine = _Machine(f"{context}, object", ctx)

    def persistent_load(pid: Any, pos: int) -> _Storage:
        dtype, key, location, numel = _storage_pid(pid, 6, machine.refuse)
        if pid[5] is not None:
            raise machine.refuse("a legacy storage view (view_metadata)")
        known = storages.get(key)
        if known is None:
            known = storages[key] = _Storage(dtype, key, location, numel)
        elif (known.dtype, known.numel) != (dtype, numel):
            raise machine.refuse(f"storage {key!r} declared twice with different dtype/size")
        return known

    machine.persistent_load = persistent_load
    obj = machine.run(f)
    keys = _Machine(f"{context}, storage keys", ctx).run(f)
    if type(keys) is not list or not all(type(k) is str for k in keys) \
            or len(set(keys)) != len(keys) or set(keys) != set(storages):
        raise _error(f"{context}: storage key list {_short(keys)} does not match the "
                     f"storages referenced ({_short(sorted(storages))})", where)
    for key in keys:
        st = storages[key]
        header = f.read(8)
        if len(header) != 8:
            raise _error(f"{context}: storage {key!r} is missing its size header", where)
        numel = int.from_bytes(header, "little", signed=True)
        if numel != st.numel:
            raise _error(f"{context}: storage {key!r} holds {numel} elements but its "
                         f"persistent id declares {st.numel}", where)
        nbytes = numel * _elsize(st.dtype)
        remaining = len(data) - f.tell()
        if nbytes > remaining:
            raise _error(f"{context}: storage {key!r} claims {nbytes} bytes but only "
                         f"{remaining} remain", where)
        ctx.budget.spend_bytes(nbytes, where, f"storage {key!r}")
        st.data = f.read(nbytes)
    if f.tell() != len(data):
        raise _error(f"{context}: {len(data) - f.tell()} unexpected trailing bytes", where)
    if expect_storage and not isinstance(obj, _Storage):
        raise _error(f"{context}: payload is a {_describe(obj)}, expected a storage", where)
    return obj


_ZIP_CDIR = b"PK\x01\x02"
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
               NotImplementedError, RuntimeError, KeyError, IndexError, OverflowError,
               struct.error, UnicodeDecodeError)
"""What :mod:`zipfile` raises for malformed archives (NotImplementedError: an unsupported
"version needed to extract" or compression method; RuntimeError: encryption)."""


def _parse_zip_torch_save(data: bytes, ctx: _Ctx) -> Any:
    """Parse a zip-format ``torch.save`` payload (``<root>/data.pkl`` + ``<root>/data/<key>``).

    Before :mod:`zipfile` sees the archive, the number of central-directory signatures bounds
    the entries it can list (each ``ZipInfo`` costs hundreds of bytes). Entries must be stored
    (``torch.save`` never compresses) and unencrypted.
    """
    context = "torch.save zip payload"
    where = ctx.where
    n_entries = data.count(_ZIP_CDIR)
    if n_entries > MAX_ZIP_ENTRIES:
        raise _error(f"{context}: {n_entries} central directory entries (limit "
                     f"{MAX_ZIP_ENTRIES})", where)
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = {i.filename: i for i in zf.infolist()}
    except _ZIP_ERRORS as exc:
        raise _error(f"{context}: unreadable zip: {type(exc).__name__}: {_short(str(exc))}",
                     where) from None
    for info in infos.values():
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x41:
            raise _error(f"{context}: entry {_short(info.filename)} is compressed or encrypted "
                         "(torch.save stores entries as they are)", where)
    pkls = [n for n in infos if n == "data.pkl" or (n.endswith("/data.pkl") and n.count("/") == 1)]
    if len(pkls) != 1:
        raise _error(f"{context}: expected one <root>/data.pkl, found {_short(pkls)}", where)
    prefix = pkls[0][: -len("data.pkl")]
    total = sum(i.file_size for i in infos.values())
    if total > MAX_PAYLOAD_BYTES + MAX_STORAGE_BYTES:
        raise _error(f"{context}: entries declare {total} bytes", where)

    def read(name: str, expect: Optional[int] = None) -> bytes:
        info = infos.get(name)
        if info is None:
            raise _error(f"{context}: missing entry {_short(name)}", where)
        if info.file_size > (MAX_PAYLOAD_BYTES if expect is None else expect):
            raise _error(f"{context}: entry {_short(name)} declares {info.file_size} bytes"
                         + ("" if expect is None else f", expected {expect}"), where)
        ctx.budget.spend_bytes(info.file_size, where, f"zip entry {_short(name)}")
        try:
            blob = zf.read(info)
        except Exception as exc:  # pylint: disable=broad-except  # CRC, truncation, bad headers
            raise _error(f"{context}: cannot read {_short(name)}: {type(exc).__name__}: "
                         f"{_short(str(exc))}", where) from None
        if expect is not None and len(blob) != expect:
            raise _error(f"{context}: entry {_short(name)} holds {len(blob)} bytes, expected "
                         f"{expect}", where)
        return blob

    byteorder = prefix + "byteorder"
    if byteorder in infos and read(byteorder).strip() != b"little":
        raise _error(f"{context}: big-endian payloads are not supported", where)

    storages: Dict[str, _Storage] = {}
    machine = _Machine(f"{context}, data.pkl", ctx)

    def persistent_load(pid: Any, pos: int) -> _Storage:
        dtype, key, location, numel = _storage_pid(pid, 5, machine.refuse)
        if not _ZIP_KEY_RE.fullmatch(key):
            raise machine.refuse(f"zip storage key {key!r}")
        known = storages.get(key)
        if known is not None:
            if (known.dtype, known.numel) != (dtype, numel):
                raise machine.refuse(f"storage {key!r} declared twice with different dtype/size")
            return known
        st = storages[key] = _Storage(dtype, key, location, numel)
        st.data = read(f"{prefix}data/{key}", numel * _elsize(dtype))
        return st

    machine.persistent_load = persistent_load
    f = io.BytesIO(read(pkls[0]))
    obj = machine.run(f)
    if f.tell() != len(f.getvalue()):
        raise _error(f"{context}: trailing bytes after data.pkl's STOP", where)
    return obj


# --------------------------------------------------------------------------- to plain values


class _Plainer:
    """Markers → plain values; shared objects stay shared, cycles and blow-ups are refused.

    The size of the result counts every value each time it is reachable (what a walk over it,
    or msgpack, would visit); it must stay within :data:`MAX_NODES` and the budget's work."""

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx, self.where = ctx, ctx.where
        budget = ctx.budget
        self.limit = min(MAX_NODES, max(0, budget.max_work - budget.work))
        self.done: Dict[int, Tuple[Any, int]] = {}
        self.active: set = set()
        self.keep: List[Any] = []  # keeps ids in `done` valid

    def too_big(self, size: Any) -> UnsafeExtraStateError:
        if self.limit < MAX_NODES:
            return self.ctx.budget.exhausted(self.where)
        return _error(f"decoded value has {size} nodes (limit {MAX_NODES})", self.where)

    def convert(self, obj: Any, depth: int = 0) -> Any:
        out, size = self._convert(obj, depth)
        if size > self.limit:
            raise self.too_big(size)
        self.ctx.budget.spend(size, self.where)
        return out

    def _convert(self, obj: Any, depth: int) -> Tuple[Any, int]:
        if type(obj) in _SCALARS:
            return obj, 1
        if depth > MAX_DEPTH:
            raise _error(f"value nested deeper than {MAX_DEPTH} levels", self.where)
        key = id(obj)
        hit = self.done.get(key)
        if hit is not None:
            return hit
        if key in self.active:
            raise _error(f"a {_describe(obj)} that contains itself", self.where)
        self.active.add(key)
        try:
            out, size = self._convert_new(obj, depth)
        finally:
            self.active.discard(key)
        if size > self.limit:
            raise self.too_big(f"more than {self.limit}")
        self.done[key] = (out, size)
        self.keep.append(obj)
        return out, size

    def _items(self, items, depth) -> Tuple[list, int]:
        outs, total = [], 1
        for item in items:
            o, s = self._convert(item, depth + 1)
            outs.append(o)
            total += s
            if total > self.limit:
                raise self.too_big(f"more than {self.limit}")
        return outs, total

    def _convert_new(self, obj: Any, depth: int) -> Tuple[Any, int]:
        t = type(obj)
        if t is list:
            return self._items(obj, depth)
        if t is tuple:
            outs, size = self._items(obj, depth)
            return tuple(outs), size
        if t is dict:
            vals, size = self._items(obj.values(), depth)
            return dict(zip(obj.keys(), vals)), size + len(obj)
        if t is _TensorSpec:
            return _materialize(obj, self.ctx), 1
        if t is _RecipeObj:
            fields, size = ({}, 1) if obj.fields is None else self._convert(obj.fields, depth + 1)
            return {"__class__": obj.cls, "fields": fields}, size + 1
        if t is _NamedTupleObj:
            names = RECIPE_NAMEDTUPLES[obj.cls]
            return {"__class__": obj.cls, "fields": dict(zip(names, obj.values))}, 1 + len(names)
        if t is _EnumMember:
            return {"__enum__": obj.cls, "name": obj.name}, 1
        raise _error(f"a {_describe(obj)} where a plain value was expected", self.where)


def _materialize(spec: _TensorSpec, ctx: _Ctx) -> torch.Tensor:
    """A tensor owning exactly the viewed elements; its bytes are charged to the budget first.

    One base tensor per storage (its bytes copied once); a view that is the whole storage gets
    the base itself the first time, every other view a copy of just its elements.
    """
    st, where = spec.storage, ctx.where
    nbytes = st.numel * _elsize(st.dtype)
    if st.data is None or len(st.data) != nbytes:
        raise _error(f"storage {st.key!r} has {0 if st.data is None else len(st.data)} bytes, "
                     f"expected {nbytes}", where)
    count = 1
    for n in spec.size:
        count *= n
    if count == 0:
        t = torch.empty(spec.size, dtype=st.dtype)
    else:
        base = ctx.bases.get(id(st))
        if base is None:
            ctx.budget.spend_bytes(nbytes, where, f"storage {st.key!r}")
            raw = bytearray(st.data)
            if st.dtype == torch.bool and raw.translate(None, b"\x00\x01"):
                raise _error(f"bool storage {st.key!r} holds bytes other than 0 and 1", where)
            base = ctx.bases[id(st)] = torch.frombuffer(raw, dtype=st.dtype)
        t = torch.as_strided(base, spec.size, spec.stride, spec.offset)
        whole = spec.offset == 0 and count == st.numel and t.is_contiguous()
        if whole and id(st) not in ctx.handed_out:
            ctx.handed_out.add(id(st))
        else:
            ctx.budget.spend_bytes(count * _elsize(st.dtype), where, "a tensor view")
            t = t.clone()  # own exactly the viewed elements
    if spec.requires_grad:
        t.requires_grad_(True)
    return t


# --------------------------------------------------------------------------- the decoded state's shape


def _path(link: Any) -> str:
    """A path kept as nested ``(parent, key)`` pairs (built per value without formatting)."""
    keys = []
    while type(link) is tuple:
        link, key = link
        keys.append(str(key))
    keys.append(str(link))
    return ".".join(reversed(keys))


class _Checker:
    """What a decoded extra state may hold (see :func:`check_extra_state`)."""

    def __init__(self, where: Optional[str], tensor_type: Any, budget: Optional[ExtraStateBudget],
                 error: Callable[[str], Exception]) -> None:
        self.where, self.tensor_type, self.budget, self.error = where, tensor_type, budget, error
        self.tensors: List[Any] = []

    def fail(self, msg: str) -> Exception:
        return self.error(f"TE extra state: {msg}")

    def state(self, state: Any) -> None:
        if type(state) is not dict:
            raise self.fail(f"extra state is a {_describe(state)}, expected a dict or None")
        for k in state:
            if type(k) is not str:
                raise self.fail(f"extra state key {_short(k)} is not a str")
        recipe = state.get("recipe")
        if recipe is not None and not (type(recipe) is dict and len(recipe) == 2
                                       and type(recipe.get("__class__")) is str
                                       and recipe["__class__"] in RECIPE_CLASSES
                                       and "fields" in recipe):
            raise self.fail(f"extra state 'recipe' is not a recipe object: {_short(recipe)}")
        for k in DELAYED_SCALING_KEYS:
            if k in state and not isinstance(state[k], self.tensor_type):
                raise self.fail(f"extra state entry {k!r} is a {_describe(state[k])}, expected a "
                                "tensor")
        if "extra_fp8_variables" in state and type(state["extra_fp8_variables"]) is not dict:
            raise self.fail("extra state 'extra_fp8_variables' is not a dict")
        for k, v in state.items():
            self.value(v, k, 1, False)

    def value(self, v: Any, path: Any, depth: int, in_recipe: bool) -> None:
        budget = self.budget
        if budget is not None:
            budget.work += 1
            if budget.work > budget.max_work:
                raise budget.exhausted(self.where)
        t = type(v)
        if t in _SCALAR_SET:
            if t is int and v.bit_length() > MAX_INT_BITS:
                raise self.fail(f"integer at {_path(path)!r} is wider than {MAX_INT_BITS} bits")
            return
        if depth > MAX_DEPTH:
            raise self.fail(f"value at {_path(path)!r} nests deeper than {MAX_DEPTH} levels")
        if isinstance(v, self.tensor_type):
            if in_recipe:
                raise self.fail(f"a tensor inside the recipe, at {_path(path)!r}")
            self.tensors.append(v)
            return
        if t is list or t is tuple:
            if _SCALAR_SET.issuperset(map(type, v)):  # the common (and the bomb's) case, at C speed
                if budget is not None:
                    budget.work += len(v)
                    if budget.work > budget.max_work:
                        raise budget.exhausted(self.where)
                if _widest_int(v) > MAX_INT_BITS:
                    raise self.fail(f"integer in {_path(path)!r} is wider than {MAX_INT_BITS} bits")
                return
            for i, x in enumerate(v):
                self.value(x, (path, i), depth + 1, in_recipe)
            return
        if t is dict:
            if len(v) == 2 and "__class__" in v and "fields" in v:
                return self.recipe_object(v["__class__"], v["fields"], path, depth)
            if len(v) == 2 and "__enum__" in v and "name" in v:
                cls, name = v["__enum__"], v["name"]
                if type(cls) is not str or cls not in _RECIPE_ENUMS or type(name) is not str \
                        or name not in _RECIPE_ENUMS[cls].values():
                    raise self.fail(f"unknown recipe enum member {_short(cls)}.{_short(name)} at "
                                    f"{_path(path)!r}")
                return None
            for k, x in v.items():
                if type(k) is not str and type(k) is not int:
                    raise self.fail(f"dict key {_short(k)} at {_path(path)!r} (only str and int keys)")
                self.value(x, (path, k), depth + 1, in_recipe)
            return None
        raise self.fail(f"a {_describe(v)} at {_path(path)!r} (extra state holds only plain values, "
                        "recipe objects and tensors)")

    def recipe_object(self, cls: Any, fields: Any, path: Any, depth: int) -> None:
        if type(cls) is not str or (cls not in RECIPE_CLASSES and cls not in RECIPE_NAMEDTUPLES):
            raise self.fail(f"unknown recipe class {_short(cls)} at {_path(path)!r}")
        if type(fields) is not dict:
            raise self.fail(f"recipe {cls} at {_path(path)!r}: 'fields' is a {_describe(fields)}, "
                            "not a map")
        if cls in RECIPE_NAMEDTUPLES:
            names = RECIPE_NAMEDTUPLES[cls]
            if tuple(fields) != names or not all(type(x) in _SCALARS for x in fields.values()):
                raise self.fail(f"{cls} at {_path(path)!r} must have the scalar fields {names}")
            for k, x in fields.items():
                self.value(x, (path, k), depth + 1, True)
            return
        for k, x in fields.items():
            if _bad_field_name(k):
                raise self.fail(f"recipe {cls} at {_path(path)!r} has field name {_short(k)} "
                                "(recipe fields are identifiers, never dunder names)")
            self.value(x, (path, k), depth + 1, True)


def check_extra_state(state: Any, *, where: Optional[str] = None, tensor_type: Any = torch.Tensor,
                      budget: Optional[ExtraStateBudget] = None,
                      error: Optional[Callable[[str], Exception]] = None) -> List[Any]:
    """Refuse anything but the shape :func:`decode_te_extra_state` returns; the tensors found.

    ``state`` is ``None`` or a dict with str keys: ``"recipe"`` ``None`` or a recipe object
    (``{"__class__": <one of RECIPE_CLASSES>, "fields": {identifier: value}}``),
    ``scale_fwd`` / ``amax_history_fwd`` / ``scale_bwd`` / ``amax_history_bwd`` tensors,
    ``extra_fp8_variables`` a dict; values anywhere are ``None``/bool/int/float/str/bytes, lists,
    tuples, dicts with str or int keys, recipe objects, recipe namedtuples (their exact fields),
    ``{"__enum__": "Format", "name": <member>}``, and -- outside recipes -- tensors, i.e.
    instances of ``tensor_type`` (``torch.Tensor``; ``TensorRef`` for a manifest's tree). At most
    :data:`MAX_DEPTH` levels; each value spends one unit of ``budget`` if given. Raises
    ``error(message)`` (default :class:`UnsafeExtraStateError` naming ``where``); returns the
    tensors (``tensor_type`` leaves) in the order met.
    """
    if error is None:
        def error(msg: str) -> Exception:
            return UnsafeExtraStateError(msg, tensor=where)
    checker = _Checker(where, tensor_type, budget, error)
    if state is not None:
        try:
            checker.state(state)
        except RecursionError:
            raise error("TE extra state: nests too deeply") from None
    return checker.tensors


# --------------------------------------------------------------------------- public API


def _payload(value: Any, where: Optional[str]) -> Tuple[bytes, str]:
    """(bytes, kind) with kind "pickle" (uint8 tensor / bytes) or "torch.save" (BytesIO)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return b"", "pickle"
        if value.dtype != torch.uint8:
            raise _error(f"extra state tensor has dtype {value.dtype}, expected torch.uint8", where)
        if value.numel() > MAX_PAYLOAD_BYTES:
            raise _error(f"extra state of {value.numel()} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
        if value.device.type == "meta":
            raise _error("extra state tensor is on the meta device (it has no bytes to decode)",
                         where)
        if value.layout != torch.strided:
            raise _error(f"extra state tensor has layout {value.layout}", where)
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        return flat.numpy().tobytes(), "pickle"
    if isinstance(value, io.BytesIO):
        data = value.getbuffer()
        try:
            if len(data) > MAX_PAYLOAD_BYTES:
                raise _error(f"extra state of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
            return bytes(data), "torch.save"
        finally:
            data.release()
    if isinstance(value, (bytes, bytearray, memoryview)):
        if isinstance(value, memoryview) and (value.ndim != 1 or value.itemsize != 1):
            value = value.cast("B") if value.c_contiguous else value.tobytes()
        if len(value) > MAX_PAYLOAD_BYTES:
            raise _error(f"extra state of {len(value)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
        data = bytes(value)
        if data.startswith(b"PK\x03\x04") or data.startswith(_LEGACY_PREFIX):
            return data, "torch.save"
        return data, "pickle"
    raise _error(f"unsupported extra state type {type(value).__name__} (expected a uint8 tensor, "
                 "io.BytesIO or bytes)", where)


def _decode_raw(data: bytes, kind: str, ctx: _Ctx) -> Any:
    where = ctx.where
    if len(data) > MAX_PAYLOAD_BYTES:
        raise _error(f"extra state of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
    if kind == "torch.save":
        if data.startswith(b"PK\x03\x04"):
            return _parse_zip_torch_save(data, ctx)
        if data.startswith(_LEGACY_PREFIX):
            return _parse_legacy_torch_save(data, ctx, expect_storage=False,
                                            context="legacy torch.save payload")
        raise _error("io.BytesIO extra state is neither a zip nor a legacy torch.save payload",
                     where)
    f = io.BytesIO(data)
    obj = _Machine("pickle", ctx, nested_storage=True).run(f)
    if f.tell() != len(data):
        raise _error(f"{len(data) - f.tell()} trailing bytes after the pickle's STOP", where)
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
    (default: a budget of its own for a "checkpoint" the size of the payload; see the module's
    Bounds). Raises :class:`UnsafeExtraStateError` for anything else, and nothing but it.
    """
    if value is None:
        return None
    data, kind = _payload(value, where)
    if not data:
        return None
    if budget is None:
        budget = ExtraStateBudget(len(data))
    ctx = _Ctx(where, budget)
    saved_max = budget.max_work  # one payload also gets at most MAX_PAYLOAD_WORK of it
    budget.max_work = min(saved_max, budget.work + MAX_PAYLOAD_WORK)
    try:
        obj = _decode_raw(data, kind, ctx)
        del data
        if obj is None:
            return None
        if type(obj) is not dict:
            raise _error(f"extra state is a {_describe(obj)}, expected a dict", where)
        if not all(type(k) is str for k in obj):
            raise _error("extra state dict has non-str keys", where)
        plain = _Plainer(ctx).convert(obj)
        out = {"recipe": plain.get("recipe")}
        out.update((k, v) for k, v in plain.items() if k != "recipe")
        check_extra_state(out, where=where)
        return out
    except UnsafeExtraStateError:
        raise
    except RecursionError:
        raise _error("a value nested too deeply", where) from None
    except MemoryError:
        raise _error("a value too large to decode", where) from None
    except Exception as exc:  # pylint: disable=broad-except  # a bug here must not escape as-is
        raise _error(f"undecodable payload: {type(exc).__name__}: {_short(str(exc))}",
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
            if ref is not None and ref[0] == RECIPE_MODULE and ref[1] in _KNOWN_RECIPE_POLICIES:
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
        recipe.get("__class__") in _STATELESS_RECIPES


# --------------------------------------------------------------------------- encoding


def _recipe_module():
    mod = sys.modules.get(RECIPE_MODULE)
    if mod is not None:
        return mod
    try:
        return importlib.import_module(RECIPE_MODULE)
    except Exception as exc:  # pylint: disable=broad-except  # TE missing or its __init__ fails
        raise TEUnavailableError(
            f"cannot encode a TE recipe: {RECIPE_MODULE} is not importable "
            f"({type(exc).__name__}: {exc}); install transformer-engine to write extra state "
            "that holds a recipe", field="recipe") from None


def recipe_to_plain(obj: Any, *, _depth: int = 0) -> Any:
    """A real ``transformer_engine.common.recipe`` object (or a value holding some) → plain data."""
    if _depth > MAX_DEPTH:
        raise UnsupportedValueError(f"recipe value nested deeper than {MAX_DEPTH} levels")
    cls = type(obj)
    if type(obj) in _SCALARS:
        return obj
    if cls.__module__ == RECIPE_MODULE:
        name = cls.__qualname__
        if name in _RECIPE_ENUMS:
            return {"__enum__": name, "name": obj.name}
        if name in RECIPE_NAMEDTUPLES:
            return {"__class__": name, "fields": dict(zip(RECIPE_NAMEDTUPLES[name], obj))}
        if name in RECIPE_CLASSES:
            return {"__class__": name,
                    "fields": {k: recipe_to_plain(v, _depth=_depth + 1) for k, v in vars(obj).items()}}
    if cls is list:
        return [recipe_to_plain(v, _depth=_depth + 1) for v in obj]
    if cls is tuple:
        return tuple(recipe_to_plain(v, _depth=_depth + 1) for v in obj)
    if cls is dict:
        return {k: recipe_to_plain(v, _depth=_depth + 1) for k, v in obj.items()}
    raise UnsupportedValueError(
        f"recipe value of type {cls.__module__}.{cls.__qualname__} cannot be stored without "
        "pickle (a callable amax_compute_algo / qfactory, or a class te-serial does not know)")


class _Realizer:
    """Plain data (as decoded) → the real objects TE's ``get_extra_state`` would pickle.

    Every value spends one unit of the budget's work, every tensor copy its bytes. Tensors on
    the meta device are replaced by zeros of their shape (``meta`` is then set)."""

    def __init__(self, budget: Optional[ExtraStateBudget] = None, where: Optional[str] = None) -> None:
        self.budget, self.where = budget, where
        self.done: Dict[int, Any] = {}
        self.keep: List[Any] = []
        self.mod = None
        self.meta = False
        self.tensor_bytes = 0

    def module(self):
        if self.mod is None:
            self.mod = _recipe_module()
        return self.mod

    def real(self, v: Any, path: str, depth: int = 0) -> Any:
        budget = self.budget
        if budget is not None:
            budget.work += 1
            if budget.work > budget.max_work:
                raise budget.exhausted(self.where)
        if type(v) in _SCALARS:
            if type(v) is int and v.bit_length() > MAX_INT_BITS:
                raise UnsupportedValueError(f"integer at {path!r} is wider than {MAX_INT_BITS} bits",
                                            tensor=self.where)
            return v
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"value at {path!r} nests deeper than {MAX_DEPTH} levels",
                                        tensor=self.where)
        hit = self.done.get(id(v))
        if hit is not None:
            return hit
        out = self._real_new(v, path, depth)
        self.done[id(v)] = out
        self.keep.append(v)
        return out

    def _real_new(self, v: Any, path: str, depth: int) -> Any:
        t = type(v)
        if isinstance(v, torch.Tensor):
            if t not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided:
                raise UnsupportedValueError(f"tensor at {path!r} is a {t.__name__} / {v.layout}; "
                                            "only plain dense tensors are stored", tensor=self.where)
            if v.dtype not in _STORAGE_DTYPES.values():
                raise UnsupportedValueError(f"tensor at {path!r} has dtype {v.dtype}",
                                            tensor=self.where)
            nbytes = v.numel() * v.element_size()
            if nbytes > MAX_STORAGE_BYTES:
                raise UnsupportedValueError(f"tensor at {path!r} has {nbytes} bytes (limit "
                                            f"{MAX_STORAGE_BYTES})", tensor=self.where)
            if self.budget is not None:
                self.budget.spend_bytes(nbytes, self.where, f"tensor {path!r}")
            self.tensor_bytes += nbytes
            src = v.detach()
            if src.device.type == "meta":  # no bytes: zeros stand in (only the length is used)
                self.meta = True
                return torch.zeros(src.shape, dtype=src.dtype)
            dst = torch.empty_like(src, device="cpu")  # what TE's to_cpu does
            dst.copy_(src)
            return dst
        if (t is list or t is tuple) and _SCALAR_SET.issuperset(map(type, v)):
            if self.budget is not None:
                self.budget.spend(len(v), self.where)
            if _widest_int(v) > MAX_INT_BITS:
                raise UnsupportedValueError(f"integer in {path!r} is wider than {MAX_INT_BITS} bits",
                                            tensor=self.where)
            return list(v) if t is list else v
        if t is list:
            return [self.real(x, f"{path}.{i}", depth + 1) for i, x in enumerate(v)]
        if t is tuple:
            return tuple(self.real(x, f"{path}.{i}", depth + 1) for i, x in enumerate(v))
        if t is dict:
            if len(v) == 2 and "__class__" in v and "fields" in v:
                return self.recipe(v["__class__"], v["fields"], path, depth)
            if len(v) == 2 and "__enum__" in v and "name" in v:
                return self.enum(v["__enum__"], v["name"], path)
            out = {}
            for k, x in v.items():
                if type(k) is not str and type(k) is not int:
                    raise UnsupportedValueError(f"dict key {_short(k)} at {path!r}: only str and "
                                                "int keys are stored", tensor=self.where)
                out[k] = self.real(x, f"{path}.{k}", depth + 1)
            return out
        if t.__module__ == RECIPE_MODULE:
            return self.real(recipe_to_plain(v), path, depth)
        raise UnsupportedValueError(f"value at {path!r} of type {t.__module__}.{t.__qualname__} "
                                    "cannot be written as TE extra state", tensor=self.where)

    def enum(self, cls: Any, name: Any, path: str) -> Any:
        if type(cls) is not str or cls not in _RECIPE_ENUMS or type(name) is not str \
                or name not in _RECIPE_ENUMS[cls].values():
            raise UnsupportedValueError(f"unknown recipe enum {_short(cls)}.{_short(name)} at "
                                        f"{path!r}", tensor=self.where)
        try:
            return getattr(self.module(), cls)[name]
        except Exception:  # pylint: disable=broad-except  # AttributeError, KeyError, TE's own
            raise TEUnavailableError(f"{RECIPE_MODULE}.{cls}.{name} (at {path!r}) does not "
                                     "exist in the installed Transformer Engine",
                                     tensor=self.where) from None

    def recipe(self, cls: Any, fields: Any, path: str, depth: int) -> Any:
        if type(cls) is not str or (cls not in RECIPE_CLASSES and cls not in RECIPE_NAMEDTUPLES):
            raise UnsupportedValueError(f"unknown recipe class {_short(cls)} at {path!r}",
                                        tensor=self.where)
        if type(fields) is not dict or any(_bad_field_name(k) for k in fields):
            raise UnsupportedValueError(f"recipe {cls} at {path!r}: 'fields' must map identifiers "
                                        "(never dunder names) to values", tensor=self.where)
        real_cls = getattr(self.module(), cls, None)
        if not isinstance(real_cls, type):
            raise TEUnavailableError(f"{RECIPE_MODULE}.{cls} (at {path!r}) does not exist in "
                                     "the installed Transformer Engine", tensor=self.where)
        vals = {k: self.real(x, f"{path}.{k}", depth + 1) for k, x in fields.items()}
        if cls in RECIPE_NAMEDTUPLES:
            if tuple(vals) != tuple(getattr(real_cls, "_fields", ())):
                raise TEUnavailableError(f"{cls} at {path!r} has fields {tuple(vals)}, the "
                                         f"installed TE expects {getattr(real_cls, '_fields', ())}",
                                         tensor=self.where)
            try:
                return real_cls(**vals)
            except Exception as exc:  # pylint: disable=broad-except  # TE's own code
                raise TEUnavailableError(f"the installed TE's {cls} refuses the values at "
                                         f"{path!r}: {type(exc).__name__}: {_short(str(exc))}",
                                         tensor=self.where) from None
        try:
            obj = real_cls.__new__(real_cls)  # exactly what unpickling does: NEWOBJ, then BUILD
            setstate = getattr(obj, "__setstate__", None)
            if setstate is not None:
                setstate(vals)
            else:
                inst_dict = obj.__dict__
                for k, x in vals.items():
                    inst_dict[sys.intern(k)] = x
        except Exception as exc:  # pylint: disable=broad-except  # TE's own code
            raise TEUnavailableError(f"the installed TE's {cls} cannot be rebuilt from the fields "
                                     f"at {path!r}: {type(exc).__name__}: {_short(str(exc))}",
                                     tensor=self.where) from None
        return obj


def encode_te_extra_state(state: Optional[dict], *, where: Optional[str] = None,
                          budget: Optional[ExtraStateBudget] = None) -> torch.Tensor:
    """Inverse of :func:`decode_te_extra_state`: a uint8 tensor TE's ``set_extra_state`` accepts.

    ``state`` is ``None`` (→ the empty tensor TE writes for stateless modules) or a dict as
    returned by the decoder; its recipe may also be a real TE recipe object. A ``"recipe": None``
    entry is left out (the TE 1.x shape); every other entry keeps its order. Recipes are rebuilt
    as real ``transformer_engine.common.recipe`` objects (TE must be importable, else
    :class:`TEUnavailableError`), tensors are copied to CPU as ``get_extra_state`` does, and the
    dict goes through ``pickle.dumps`` with the default protocol. Tensors on the meta device give
    a meta uint8 tensor of (about) the length the real bytes would have. Work, tensor bytes and
    the payload's bytes are charged to ``budget`` when given; ``where`` is named in errors.
    """
    if state is None:
        return torch.empty(0, dtype=torch.uint8)
    if type(state) is not dict:
        raise UnsupportedValueError(f"TE extra state must be a dict or None, got {type(state).__name__}",
                                    tensor=where)
    realizer = _Realizer(budget, where)
    real: Dict[str, Any] = {}
    try:
        for k, v in state.items():
            if type(k) is not str:
                raise UnsupportedValueError(f"TE extra state key {_short(k)} is not a str", tensor=where)
            if k == "recipe" and v is None:
                continue
            real[k] = realizer.real(v, k)
    except RecursionError:
        raise UnsupportedValueError("TE extra state nests too deeply", tensor=where) from None
    try:
        payload = pickle.dumps(real)
    except Exception as exc:  # pylint: disable=broad-except  # the installed TE's classes pickle themselves
        raise TEUnavailableError(f"pickling TE extra state with the installed Transformer Engine "
                                 f"failed: {type(exc).__name__}: {_short(str(exc))}",
                                 tensor=where) from None
    del real
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise UnsupportedValueError(f"encoded TE extra state is {len(payload)} bytes "
                                    f"(limit {MAX_PAYLOAD_BYTES})", tensor=where)
    if budget is not None:
        budget.spend_bytes(max(0, len(payload) - realizer.tensor_bytes), where, "the encoded payload")
    if realizer.meta:
        return torch.empty(len(payload), dtype=torch.uint8, device="meta")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def recipe_from_plain(plain: Any) -> Any:
    """Rebuild real ``transformer_engine.common.recipe`` objects from decoded plain data."""
    return _Realizer().real(plain, "recipe")
