"""The machine's markers turned into plain values: recipe objects into dicts, tensor specs into
CPU tensors owning their bytes, with sharing kept and cycles, depth and size bounded."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .errors import UnsafeExtraStateError, unsafe_error
from .limits import MAX_DEPTH, MAX_NODES
from .pickle_vm import Ctx, EnumMember, NamedTupleObj, RecipeObj, TensorSpecObj, describe, elsize
from .schema import RECIPE_NAMEDTUPLES, SCALARS


class Plainer:
    """Markers → plain values; shared objects stay shared, cycles and blow-ups are refused.

    The size of the result counts every value each time it is reachable (what a walk over it,
    or msgpack, would visit); it must stay within :data:`MAX_NODES` and the budget's work."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.where = ctx, ctx.where
        budget = ctx.budget
        self.limit = min(MAX_NODES, max(0, budget.max_work - budget.work))
        self.done: Dict[int, Tuple[Any, int]] = {}
        self.active: set = set()
        self.keep: List[Any] = []  # keeps ids in `done` valid

    def too_big(self, size: Any) -> UnsafeExtraStateError:
        if self.limit < MAX_NODES:
            return self.ctx.budget.exhausted(self.where)
        return unsafe_error(f"decoded value has {size} nodes (limit {MAX_NODES})", self.where)

    def convert(self, obj: Any, depth: int = 0) -> Any:
        out, size = self._convert(obj, depth)
        if size > self.limit:
            raise self.too_big(size)
        self.ctx.budget.spend(size, self.where)
        return out

    def _convert(self, obj: Any, depth: int) -> Tuple[Any, int]:
        if type(obj) in SCALARS:
            return obj, 1
        if depth > MAX_DEPTH:
            raise unsafe_error(f"value nested deeper than {MAX_DEPTH} levels", self.where)
        key = id(obj)
        hit = self.done.get(key)
        if hit is not None:
            return hit
        if key in self.active:
            raise unsafe_error(f"a {describe(obj)} that contains itself", self.where)
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
        if t is TensorSpecObj:
            return _materialize(obj, self.ctx), 1
        if t is RecipeObj:
            fields, size = ({}, 1) if obj.fields is None else self._convert(obj.fields, depth + 1)
            return {"__class__": obj.cls, "fields": fields}, size + 1
        if t is NamedTupleObj:
            names = RECIPE_NAMEDTUPLES[obj.cls]
            return {"__class__": obj.cls, "fields": dict(zip(names, obj.values))}, 1 + len(names)
        if t is EnumMember:
            return {"__enum__": obj.cls, "name": obj.name}, 1
        raise unsafe_error(f"a {describe(obj)} where a plain value was expected", self.where)


def _materialize(spec: TensorSpecObj, ctx: Ctx) -> torch.Tensor:
    """A tensor owning exactly the viewed elements; its bytes are charged to the budget first.

    One base tensor per storage (its bytes copied once); a view that is the whole storage gets
    the base itself the first time, every other view a copy of just its elements.
    """
    st, where = spec.storage, ctx.where
    nbytes = st.numel * elsize(st.dtype)
    if st.data is None or len(st.data) != nbytes:
        raise unsafe_error(f"storage {st.key!r} has {0 if st.data is None else len(st.data)} bytes, "
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
                raise unsafe_error(f"bool storage {st.key!r} holds bytes other than 0 and 1", where)
            base = ctx.bases[id(st)] = torch.frombuffer(raw, dtype=st.dtype)
        t = torch.as_strided(base, spec.size, spec.stride, spec.offset)
        whole = spec.offset == 0 and count == st.numel and t.is_contiguous()
        if whole and id(st) not in ctx.handed_out:
            ctx.handed_out.add(id(st))
        else:
            ctx.budget.spend_bytes(count * elsize(st.dtype), where, "a tensor view")
            t = t.clone()  # own exactly the viewed elements
    if spec.requires_grad:
        t.requires_grad_(True)
    return t
