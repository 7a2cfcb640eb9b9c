"""The encoding entry points: plain data (as decoded) back to real TE recipe objects and the
``pickle.dumps`` bytes TE's ``set_extra_state`` reads, which needs TE's Python package."""

from __future__ import annotations

import importlib
import pickle
import sys
from typing import Any, Dict, List, Optional

import torch

from ...errors import UnsupportedValueError
from .errors import TEUnavailableError, short_repr
from .limits import MAX_DEPTH, MAX_INT_BITS, MAX_PAYLOAD_BYTES, MAX_STORAGE_BYTES, ExtraStateBudget
from .schema import (RECIPE_CLASSES, RECIPE_ENUMS, RECIPE_MODULE, RECIPE_NAMEDTUPLES, SCALARS, SCALAR_SET,
                     STORAGE_DTYPES, bad_field_name, widest_int)


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
    if type(obj) in SCALARS:
        return obj
    if cls.__module__ == RECIPE_MODULE:
        name = cls.__qualname__
        if name in RECIPE_ENUMS:
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

    Every value spends one unit of the budget's work, every tensor copy its bytes. A tensor on the
    meta device is refused: TE's extra state is the tensors' bytes, and a meta tensor has none
    (standing zeros in for them would write values nobody saved, and allocate memory for bytes that
    exist nowhere: many meta tensors cost nothing to make)."""

    def __init__(self, budget: Optional[ExtraStateBudget] = None, where: Optional[str] = None) -> None:
        self.budget, self.where = budget, where
        self.done: Dict[int, Any] = {}
        self.keep: List[Any] = []
        self.mod = None
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
        if type(v) in SCALARS:
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
                                            "only plain dense tensors are stored", tensor=self.where, field=path)
            if v.device.type == "meta":
                raise UnsupportedValueError(f"tensor at {path!r} is on the meta device: TE's extra state holds "
                                            "the tensors' bytes, and a meta tensor has none (load or materialize "
                                            "it first)", tensor=self.where, field=path)
            if v.dtype not in STORAGE_DTYPES.values():
                raise UnsupportedValueError(f"tensor at {path!r} has dtype {v.dtype}",
                                            tensor=self.where, field=path)
            nbytes = v.numel() * v.element_size()
            if nbytes > MAX_STORAGE_BYTES:
                raise UnsupportedValueError(f"tensor at {path!r} has {nbytes} bytes (limit "
                                            f"{MAX_STORAGE_BYTES})", tensor=self.where, field=path)
            if self.budget is not None:
                self.budget.spend_bytes(nbytes, self.where, f"tensor {path!r}")
            self.tensor_bytes += nbytes
            src = v.detach()
            dst = torch.empty_like(src, device="cpu")  # what TE's to_cpu does
            dst.copy_(src)
            return dst
        if (t is list or t is tuple) and SCALAR_SET.issuperset(map(type, v)):
            if self.budget is not None:
                self.budget.spend(len(v), self.where)
            if widest_int(v) > MAX_INT_BITS:
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
                    raise UnsupportedValueError(f"dict key {short_repr(k)} at {path!r}: only str and "
                                                "int keys are stored", tensor=self.where)
                out[k] = self.real(x, f"{path}.{k}", depth + 1)
            return out
        if t.__module__ == RECIPE_MODULE:
            return self.real(recipe_to_plain(v), path, depth)
        raise UnsupportedValueError(f"value at {path!r} of type {t.__module__}.{t.__qualname__} "
                                    "cannot be written as TE extra state", tensor=self.where)

    def enum(self, cls: Any, name: Any, path: str) -> Any:
        if type(cls) is not str or cls not in RECIPE_ENUMS or type(name) is not str \
                or name not in RECIPE_ENUMS[cls].values():
            raise UnsupportedValueError(f"unknown recipe enum {short_repr(cls)}.{short_repr(name)} at "
                                        f"{path!r}", tensor=self.where)
        try:
            return getattr(self.module(), cls)[name]
        except Exception:  # pylint: disable=broad-except  # AttributeError, KeyError, TE's own
            raise TEUnavailableError(f"{RECIPE_MODULE}.{cls}.{name} (at {path!r}) does not "
                                     "exist in the installed Transformer Engine",
                                     tensor=self.where) from None

    def recipe(self, cls: Any, fields: Any, path: str, depth: int) -> Any:
        if type(cls) is not str or (cls not in RECIPE_CLASSES and cls not in RECIPE_NAMEDTUPLES):
            raise UnsupportedValueError(f"unknown recipe class {short_repr(cls)} at {path!r}",
                                        tensor=self.where)
        if type(fields) is not dict or any(bad_field_name(k) for k in fields):
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
                                         f"{path!r}: {type(exc).__name__}: {short_repr(str(exc))}",
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
                                     f"at {path!r}: {type(exc).__name__}: {short_repr(str(exc))}",
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
    dict goes through ``pickle.dumps`` with the default protocol. A tensor on the meta device has
    no bytes to write and is refused (:class:`~te_serial.errors.UnsupportedValueError` naming
    ``where`` and its path in the state as the field). Work, tensor bytes and the payload's bytes
    are charged to ``budget`` when given; ``where`` is named in errors.
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
                raise UnsupportedValueError(f"TE extra state key {short_repr(k)} is not a str", tensor=where)
            if k == "recipe" and v is None:
                continue
            real[k] = realizer.real(v, k)
    except RecursionError:
        raise UnsupportedValueError("TE extra state nests too deeply", tensor=where) from None
    try:
        payload = pickle.dumps(real)
    except Exception as exc:  # pylint: disable=broad-except  # the installed TE's classes pickle themselves
        raise TEUnavailableError(f"pickling TE extra state with the installed Transformer Engine "
                                 f"failed: {type(exc).__name__}: {short_repr(str(exc))}",
                                 tensor=where) from None
    del real
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise UnsupportedValueError(f"encoded TE extra state is {len(payload)} bytes "
                                    f"(limit {MAX_PAYLOAD_BYTES})", tensor=where)
    if budget is not None:
        budget.spend_bytes(max(0, len(payload) - realizer.tensor_bytes), where, "the encoded payload")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def recipe_from_plain(plain: Any) -> Any:
    """Rebuild real ``transformer_engine.common.recipe`` objects from decoded plain data."""
    return _Realizer().real(plain, "recipe")
