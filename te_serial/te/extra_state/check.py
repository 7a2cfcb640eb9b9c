"""The shape a decoded extra state may have, checked on what the decoder returns, on what the
encoder is given, and on a manifest's tree (where ``TensorRef`` stands in for tensors)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from .errors import UnsafeExtraStateError, short_repr
from .limits import MAX_DEPTH, MAX_INT_BITS, ExtraStateBudget
from .pickle_vm import describe
from .schema import (DELAYED_SCALING_KEYS, RECIPE_CLASSES, RECIPE_ENUMS, RECIPE_NAMEDTUPLES, SCALARS, SCALAR_SET,
                     bad_field_name, widest_int)


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
            raise self.fail(f"extra state is a {describe(state)}, expected a dict or None")
        for k in state:
            if type(k) is not str:
                raise self.fail(f"extra state key {short_repr(k)} is not a str")
        recipe = state.get("recipe")
        if recipe is not None and not (type(recipe) is dict and len(recipe) == 2
                                       and type(recipe.get("__class__")) is str
                                       and recipe["__class__"] in RECIPE_CLASSES
                                       and "fields" in recipe):
            raise self.fail(f"extra state 'recipe' is not a recipe object: {short_repr(recipe)}")
        for k in DELAYED_SCALING_KEYS:
            if k in state and not isinstance(state[k], self.tensor_type):
                raise self.fail(f"extra state entry {k!r} is a {describe(state[k])}, expected a "
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
        if t in SCALAR_SET:
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
            if SCALAR_SET.issuperset(map(type, v)):  # the common (and the bomb's) case, at C speed
                if budget is not None:
                    budget.work += len(v)
                    if budget.work > budget.max_work:
                        raise budget.exhausted(self.where)
                if widest_int(v) > MAX_INT_BITS:
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
                if type(cls) is not str or cls not in RECIPE_ENUMS or type(name) is not str \
                        or name not in RECIPE_ENUMS[cls].values():
                    raise self.fail(f"unknown recipe enum member {short_repr(cls)}.{short_repr(name)} at "
                                    f"{_path(path)!r}")
                return None
            for k, x in v.items():
                if type(k) is not str and type(k) is not int:
                    raise self.fail(f"dict key {short_repr(k)} at {_path(path)!r} (only str and int keys)")
                self.value(x, (path, k), depth + 1, in_recipe)
            return None
        raise self.fail(f"a {describe(v)} at {_path(path)!r} (extra state holds only plain values, "
                        "recipe objects and tensors)")

    def recipe_object(self, cls: Any, fields: Any, path: Any, depth: int) -> None:
        if type(cls) is not str or (cls not in RECIPE_CLASSES and cls not in RECIPE_NAMEDTUPLES):
            raise self.fail(f"unknown recipe class {short_repr(cls)} at {_path(path)!r}")
        if type(fields) is not dict:
            raise self.fail(f"recipe {cls} at {_path(path)!r}: 'fields' is a {describe(fields)}, "
                            "not a map")
        if cls in RECIPE_NAMEDTUPLES:
            names = RECIPE_NAMEDTUPLES[cls]
            if tuple(fields) != names or not all(type(x) in SCALARS for x in fields.values()):
                raise self.fail(f"{cls} at {_path(path)!r} must have the scalar fields {names}")
            for k, x in fields.items():
                self.value(x, (path, k), depth + 1, True)
            return
        for k, x in fields.items():
            if bad_field_name(k):
                raise self.fail(f"recipe {cls} at {_path(path)!r} has field name {short_repr(k)} "
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
