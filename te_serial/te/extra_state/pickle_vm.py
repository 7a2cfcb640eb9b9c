"""The restricted pickle machine: walks a pickle's opcodes with :func:`pickletools.genops` and
builds inert markers for the few globals and calls TE's payloads use, so nothing is ever executed."""

from __future__ import annotations

import io
import pickletools
from typing import Any, Callable, Dict, List, Optional

import torch

from .errors import UnsafeExtraStateError, short_repr
from .limits import MAX_INT_BITS, MAX_MARKS, MAX_MEMO, MAX_NDIM, MAX_STACK, ExtraStateBudget
from .schema import (RECIPE_CLASSES, RECIPE_ENUMS, RECIPE_MODULE, RECIPE_NAMEDTUPLES, SCALARS, STORAGE_DTYPES,
                     bad_field_name)


# --------------------------------------------------------------------------- inert markers


class Global:
    """An allowed global, never imported: just what it names and what it may be used for."""

    __slots__ = ("module", "name", "kind")

    def __init__(self, module: str, name: str, kind: str) -> None:
        self.module, self.name, self.kind = module, name, kind

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class RecipeObj:
    """``NEWOBJ(recipe_cls, ())`` then ``BUILD(state)``: the class name and its instance dict."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: str) -> None:
        self.cls, self.fields = cls, None


class NamedTupleObj:
    __slots__ = ("cls", "values")

    def __init__(self, cls: str, values: tuple) -> None:
        self.cls, self.values = cls, values


class EnumMember:
    __slots__ = ("cls", "name")

    def __init__(self, cls: str, name: str) -> None:
        self.cls, self.name = cls, name


class _EmptyHooks:
    """``collections.OrderedDict()``: only valid as a tensor's (empty) backward hooks."""

    __slots__ = ()


class Storage:
    __slots__ = ("dtype", "key", "location", "numel", "data")

    def __init__(self, dtype: torch.dtype, key: str, location: str, numel: int) -> None:
        self.dtype, self.key, self.location, self.numel = dtype, key, location, numel
        self.data: Optional[bytes] = None


class TensorSpecObj:
    __slots__ = ("storage", "offset", "size", "stride", "requires_grad")

    def __init__(self, storage, offset, size, stride, requires_grad) -> None:
        self.storage, self.offset, self.size = storage, offset, size
        self.stride, self.requires_grad = stride, requires_grad


def elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def describe(obj: Any) -> str:
    if isinstance(obj, Global):
        return f"global {obj!r}"
    if isinstance(obj, (RecipeObj, NamedTupleObj)):
        return f"{RECIPE_MODULE}.{obj.cls} object"
    if isinstance(obj, EnumMember):
        return f"{RECIPE_MODULE}.{obj.cls}.{obj.name}"
    if isinstance(obj, Storage):
        return "torch storage"
    if isinstance(obj, TensorSpecObj):
        return "tensor"
    if isinstance(obj, _EmptyHooks):
        return "collections.OrderedDict object"
    return type(obj).__name__


class Ctx:
    """One decode: where to name in errors, the budget, and storages already turned into tensors."""

    __slots__ = ("where", "budget", "bases", "handed_out")

    def __init__(self, where: Optional[str], budget: ExtraStateBudget) -> None:
        self.where, self.budget = where, budget
        self.bases: Dict[int, torch.Tensor] = {}
        self.handed_out: set = set()


# --------------------------------------------------------------------------- the stack machine


class Machine:
    """Interprets one pickle with ``pickletools.genops``; knows only what TE's payloads contain.

    ``persistent_load`` is set only inside ``torch.save`` payloads (it also enables the
    ``torch.*Storage`` globals); ``load_from_bytes`` -- the parser of the legacy ``torch.save``
    of one storage, passed in by the caller so this machine knows no container format -- enables
    ``torch.storage._load_from_bytes`` (top-level ``pickle.dumps`` payloads only, so nesting is one
    level deep at most). Every opcode spends one unit of the decode's budget.
    """

    def __init__(self, context: str, ctx: Ctx, *,
                 persistent_load: Optional[Callable[[Any, int], Any]] = None,
                 load_from_bytes: Optional[Callable[[bytes, Ctx], Any]] = None) -> None:
        self.context, self.ctx, self.where = context, ctx, ctx.where
        self.persistent_load = persistent_load
        self.load_from_bytes = load_from_bytes
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
                f"{type(exc).__name__}: {short_repr(str(exc))}", tensor=self.where) from None
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
            raise self.refuse(f"APPEND to a {describe(target)}")
        return target

    def op_append(self, arg):
        value = self.pop()
        self._list_target().append(value)

    def op_appends(self, arg):
        items = self.pop_mark()
        self._list_target().extend(items)

    def set_item(self, d: Any, key: Any, value: Any) -> None:
        if type(d) is not dict:
            raise self.refuse(f"SETITEM on a {describe(d)}")
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
            raise self.refuse(f"memo index {short_repr(arg)}")
        self.memo[arg] = self.top()

    def op_memoize(self, arg):
        self.op_put(len(self.memo))

    def op_get(self, arg):
        try:
            self.push(self.memo[arg])
        except (KeyError, TypeError):
            raise self.refuse(f"a read of unset memo entry {short_repr(arg)}") from None

    def op_global(self, arg):
        parts = arg.split(" ") if isinstance(arg, str) else []
        if len(parts) != 2:
            raise self.refuse(f"GLOBAL {short_repr(arg)}")
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
        if not isinstance(inst, RecipeObj):
            raise self.refuse(f"BUILD of a {describe(inst)}")
        if inst.fields is not None:
            raise self.refuse(f"a second BUILD of {describe(inst)}")
        if type(state) is not dict:
            raise self.refuse(f"BUILD of {describe(inst)} with a {describe(state)} state "
                              "(only an instance dict with str keys is accepted)")
        bad = [k for k in state if bad_field_name(k)]
        if bad:
            raise self.refuse(f"BUILD of {describe(inst)} with field name {short_repr(bad[0])} "
                              "(recipe fields are identifiers, never dunder names)")
        inst.fields = state

    def op_binpersid(self, arg):
        pid = self.pop()
        if self.persistent_load is None:
            raise self.refuse("a persistent id (BINPERSID) outside a torch.save payload")
        self.push(self.persistent_load(pid, self.pos))

    # -- the only "calls" we understand
    def resolve(self, module: str, name: str) -> Global:
        qual = f"{module}.{name}"
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return Global(module, name, "rebuild_tensor")
        if module == "torch.storage" and name == "_load_from_bytes" and self.load_from_bytes is not None:
            return Global(module, name, "load_from_bytes")
        if module == "collections" and name == "OrderedDict":
            return Global(module, name, "ordered_dict")
        if module == "torch" and name in STORAGE_DTYPES and self.persistent_load is not None:
            return Global(module, name, "storage_type")
        if module == RECIPE_MODULE:
            if name in RECIPE_CLASSES:
                return Global(module, name, "recipe_class")
            if name in RECIPE_NAMEDTUPLES:
                return Global(module, name, "namedtuple")
            if name in RECIPE_ENUMS:
                return Global(module, name, "enum")
        raise self.refuse(f"GLOBAL {short_repr(qual)}")

    def call(self, func: Any, args: Any) -> Any:
        if not isinstance(func, Global):
            raise self.refuse(f"REDUCE of a {describe(func)}")
        if type(args) is not tuple:
            raise self.refuse(f"REDUCE of {func!r} with a {describe(args)} argument")
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
            return self.load_from_bytes(args[0], self.ctx)
        raise self.refuse(f"REDUCE of {func!r}")

    def new(self, cls: Any, args: Any) -> Any:
        if not isinstance(cls, Global) or type(args) is not tuple:
            raise self.refuse(f"NEWOBJ of a {describe(cls)}")
        if cls.kind == "recipe_class":
            if args:
                raise self.refuse(f"NEWOBJ of {cls!r} with constructor arguments")
            return RecipeObj(cls.name)
        if cls.kind == "namedtuple":
            fields = RECIPE_NAMEDTUPLES[cls.name]
            if len(args) != len(fields) or not all(type(a) in SCALARS for a in args):
                raise self.refuse(f"NEWOBJ of {cls!r} with arguments other than "
                                  f"{len(fields)} scalars")
            return NamedTupleObj(cls.name, args)
        raise self.refuse(f"NEWOBJ of {cls!r}")

    def enum_member(self, cls: str, args: tuple) -> EnumMember:
        if len(args) == 1:
            value = args[0]
            if isinstance(value, NamedTupleObj) and value.cls == "_FormatHelper":
                value = value.values
            if type(value) is tuple and len(value) == 2 and all(
                    type(v) in (int, float) for v in value):
                name = RECIPE_ENUMS[cls].get(value)
                if name is not None:
                    return EnumMember(cls, name)
                raise self.refuse(f"{RECIPE_MODULE}.{cls} value {short_repr(value)} (not a known member)")
        raise self.refuse(f"REDUCE of {RECIPE_MODULE}.{cls} with arguments other than a member value")

    def rebuild_tensor(self, args: tuple) -> TensorSpecObj:
        if len(args) not in (6, 7):
            raise self.refuse(f"torch._utils._rebuild_tensor_v2 with {len(args)} arguments")
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        if not isinstance(storage, Storage):
            raise self.refuse(f"torch._utils._rebuild_tensor_v2 of a {describe(storage)} "
                              "(expected a storage)")
        if len(args) == 7 and not (type(args[6]) is dict and not args[6]):
            raise self.refuse("tensor metadata in torch._utils._rebuild_tensor_v2")
        if not isinstance(hooks, _EmptyHooks):
            raise self.refuse(f"tensor backward hooks that are a {describe(hooks)}")
        for label, dims in (("size", size), ("stride", stride)):
            if type(dims) is not tuple or len(dims) > MAX_NDIM or not all(
                    type(d) is int and 0 <= d < (1 << 62) for d in dims):
                raise self.refuse(f"tensor {label} {short_repr(dims)} (dims and strides are "
                                  f"non-negative ints, at most {MAX_NDIM} of them)")
        if len(size) != len(stride):
            raise self.refuse(f"tensor size {size} and stride {stride} of different lengths")
        if type(offset) is not int or not 0 <= offset < (1 << 62):
            raise self.refuse(f"tensor storage offset {short_repr(offset)}")
        if type(requires_grad) is not bool:
            raise self.refuse(f"tensor requires_grad {short_repr(requires_grad)}")
        if requires_grad and not storage.dtype.is_floating_point:
            raise self.refuse(f"requires_grad on a {storage.dtype} tensor")
        _check_view(size, stride, offset, storage.numel, self.refuse)
        return TensorSpecObj(storage, offset, size, stride, requires_grad)


_HANDLERS: Dict[str, Callable[[Machine, Any], None]] = {
    "PROTO": Machine.op_proto, "FRAME": Machine.op_nothing, "MARK": Machine.op_mark,
    "POP": Machine.op_pop, "POP_MARK": Machine.op_pop_mark, "DUP": Machine.op_dup,
    "NONE": Machine.op_none, "NEWTRUE": Machine.op_true, "NEWFALSE": Machine.op_false,
    "INT": Machine.op_value, "BININT": Machine.op_value, "BININT1": Machine.op_value,
    "BININT2": Machine.op_value, "LONG": Machine.op_value, "LONG1": Machine.op_value,
    "LONG4": Machine.op_value, "FLOAT": Machine.op_value, "BINFLOAT": Machine.op_value,
    "UNICODE": Machine.op_value, "BINUNICODE": Machine.op_value,
    "SHORT_BINUNICODE": Machine.op_value, "BINUNICODE8": Machine.op_value,
    "BINBYTES": Machine.op_value, "SHORT_BINBYTES": Machine.op_value,
    "BINBYTES8": Machine.op_value,
    "EMPTY_LIST": Machine.op_empty_list, "APPEND": Machine.op_append,
    "APPENDS": Machine.op_appends, "LIST": Machine.op_list,
    "EMPTY_TUPLE": Machine.op_empty_tuple, "TUPLE": Machine.op_tuple,
    "TUPLE1": Machine.op_tuple1, "TUPLE2": Machine.op_tuple2, "TUPLE3": Machine.op_tuple3,
    "EMPTY_DICT": Machine.op_empty_dict, "DICT": Machine.op_dict,
    "SETITEM": Machine.op_setitem, "SETITEMS": Machine.op_setitems,
    "PUT": Machine.op_put, "BINPUT": Machine.op_put, "LONG_BINPUT": Machine.op_put,
    "MEMOIZE": Machine.op_memoize,
    "GET": Machine.op_get, "BINGET": Machine.op_get, "LONG_BINGET": Machine.op_get,
    "GLOBAL": Machine.op_global, "STACK_GLOBAL": Machine.op_stack_global,
    "REDUCE": Machine.op_reduce, "NEWOBJ": Machine.op_newobj, "BUILD": Machine.op_build,
    "BINPERSID": Machine.op_binpersid,
}  # fmt: skip


def _check_key(key: Any, refuse: Callable[[str], Exception], depth: int = 0) -> None:
    """Dict keys: scalars or (shallow) tuples of scalars; never markers or tensors."""
    if type(key) in SCALARS:
        return
    if type(key) is tuple and depth < 4:
        for k in key:
            _check_key(k, refuse, depth + 1)
        return
    raise refuse(f"a dict key that is a {describe(key)}")


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
