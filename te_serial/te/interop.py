"""Exact adapters between Transformer Engine's tensor classes and te-serial's.

``from_te`` reads a TE ``Float8Tensor`` / ``MXFP8Tensor`` / ``Float8BlockwiseQTensor`` /
``NVFP4Tensor`` (or its ``*Storage`` form) by TE's own attribute names and returns the matching
te-serial tensor with the same bytes: shared when TE's layout already is te-serial's, copied
where it must change (swizzled scales are unswizzled, uninitialized scale padding is zeroed,
Blackwell's ``_data``-only columnwise usage gets its transpose). ``to_te`` goes back to TE's
class with TE's quantizer. TE's experimental classes (``HybridQuantizedTensor``,
``IdentityTensor``) are refused, never pickled or dequantized. What each format does is its
adapter's (``formats/te_adapter.py``, registered by each format module); this module finds the
adapter and imports TE lazily, so te-serial works without it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import FormatError, TeSerialError
from ..formats import QuantizedTensorStorage
from ..formats.te_adapter import TE_ADAPTERS, TE_EXPERIMENTAL, adapter_for, find_te_adapter


class TransformerEngineUnavailable(TeSerialError, ImportError):
    """Transformer Engine (its PyTorch part) is not importable here."""


def te_module(name: str):
    """``transformer_engine.pytorch.<name>``, or :class:`TransformerEngineUnavailable` saying how to get it."""
    try:
        return importlib.import_module(f"transformer_engine.pytorch.{name}")
    except Exception as e:  # noqa: BLE001 - any import failure means: no usable TE
        raise TransformerEngineUnavailable(
            f"Transformer Engine is needed for this ({type(e).__name__}: {e}); "
            "install te-serial[te]") from None


def _tex():
    try:
        return importlib.import_module("transformer_engine_torch")
    except Exception as e:  # noqa: BLE001
        raise TransformerEngineUnavailable(f"transformer_engine_torch is not importable: {e}") from None


class TEModules:
    """TE's modules and ``DType``, imported on first use (the adapters' :class:`TEContext`)."""

    def __init__(self) -> None:
        self.DType = _tex().DType

    @staticmethod
    def module(name: str) -> Any:
        return te_module(name)


def is_te_tensor(t: Any) -> bool:
    """True for TE's quantized tensor and storage classes, experimental ones included (by class
    name, without importing TE): callers hand ``t`` to :func:`from_te`, which refuses those."""
    return any(c.__module__.startswith("transformer_engine.")
               and (c.__name__ in TE_ADAPTERS or c.__name__ in TE_EXPERIMENTAL) for c in type(t).__mro__)


def from_te(t: Any, *, name: str | None = None) -> QuantizedTensorStorage:
    """The te-serial tensor holding exactly the bytes of a TE quantized tensor or storage; TE's
    experimental classes are refused with an ``UnsupportedValueError`` (``name`` names ``t``)."""
    if isinstance(t, QuantizedTensorStorage):
        return t
    adapter = find_te_adapter(t, name=name)
    if adapter is None:
        raise FormatError(f"{type(t).__name__} is not a TE quantized tensor")
    if isinstance(t, torch.Tensor):
        shape, fake_dtype = tuple(t.shape), t.dtype
    else:  # a bare *Storage: TE keeps the nominal dtype as _dtype
        shape, fake_dtype = tuple(t.size()), getattr(t, "_dtype", None) or torch.float32
    q, bufs = adapter.from_te(t, getattr(t, "_quantizer", None), shape)
    q.check_buffers(shape, bufs, where=type(t).__name__)
    out = q.tensor_class(shape, fake_dtype, q, **{n: b for n, b in bufs.items() if b is not None})
    if bool(getattr(t, "requires_grad", False)):
        out.requires_grad_(True)
    return out


def to_te(t: QuantizedTensorStorage) -> Any:
    """TE's own tensor class for a te-serial tensor (same buffers, TE's quantizer, compact scales)."""
    if is_te_tensor(t):
        return t
    if not isinstance(t, QuantizedTensorStorage):
        raise FormatError(f"to_te needs a te-serial quantized tensor, got {type(t).__name__}")
    q = t.quantizer
    adapter, te = adapter_for(q), TEModules()
    if hasattr(adapter, "to_te"):  # a class TE builds itself (GroupedTensor: formats/grouped.py)
        return adapter.to_te(t, te)
    b = t.buffers()
    cls = getattr(te.module(adapter.te_module), adapter.te_tensor)
    return cls(shape=tuple(t.logical_shape), dtype=t.fake_dtype, quantizer=adapter.te_quantizer(q, te),
               device=next(iter(b.values())).device, requires_grad=bool(getattr(t, "requires_grad", False)),
               **adapter.te_kwargs(q, b, te))
