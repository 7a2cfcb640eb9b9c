"""Adapters between te-serial's formats and Transformer Engine's own tensor classes.

Each format module registers one :class:`TEAdapter` for its quantizer classes: how to read TE's
tensor (which quantizer, which buffers) and how to build TE's quantizer and tensor. What every
format shares is here: buffers reshaped to te-serial's shapes (TE's C++ allocates some flattened
to 2-D), swizzled scales unswizzled, scale padding zeroed. ``te.interop`` finds an adapter by TE
class name or by quantizer and holds no per-format code. TE is never imported here: building TE
objects gets a :class:`TEContext` (TE's modules and ``DType``) from ``te.interop``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Protocol

import torch

from ..errors import FormatError, UnsupportedValueError
from .base import Quantizer
from .swizzle import unswizzle_scales

#: TE's DType values (transformer_engine/common/include/transformer_engine/transformer_engine.h)
TE_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
TE_FP8_CODE = {v: k for k, v in TE_FP8.items()}

#: TE class name (tensor and storage class) → adapter
TE_ADAPTERS: dict[str, "TEAdapter"] = {}
#: TE quantizer class name → adapter (reads the quantizers of TE's ``TensorSpec``)
TE_QUANTIZER_ADAPTERS: dict[str, "TEAdapter"] = {}

#: TE's classes marked EXPERIMENTAL in TE 2.20 (tensor/hybrid_tensor.py, tensor/identity_tensor.py,
#: tensor/storage/): their layout may change without notice, so te-serial stores none of them
TE_EXPERIMENTAL = frozenset({
    "HybridQuantizedTensor", "HybridQuantizedTensorStorage", "HybridQuantizer",
    "IdentityTensor", "IdentityTensorStorage", "IdentityQuantizer",
})

#: TE quantizer value fields that are run-time options, not part of the tensor's format: a
#: quantized tensor never keeps amax reduction (``Quantizer.quantize`` clears it), and
#: ``internal`` only picks TE's bare storage class over its wrapper (same buffers)
_TE_RUNTIME_FIELDS = frozenset({"internal", "with_amax_reduction"})


class TEContext(Protocol):
    """What building TE objects needs: ``DType`` (``transformer_engine_torch.DType``) and
    ``module(name)`` (``transformer_engine.pytorch.<name>``)."""

    DType: Any

    def module(self, name: str) -> Any: ...


def te_fp8_dtype(te_dtype: Any) -> torch.dtype:
    """torch FP8 dtype of a TE ``DType`` (or its int value)."""
    try:
        return TE_FP8[int(te_dtype)]
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"TE dtype {te_dtype!r} is not an FP8 dtype te-serial reads") from None


def find_te_adapter(obj: Any, table: Mapping[str, "TEAdapter"] | None = None, *,
                    name: str | None = None) -> "TEAdapter | None":
    """The adapter of TE object ``obj``'s class (tensor/storage, or quantizer with
    ``table=TE_QUANTIZER_ADAPTERS``), None if ``obj`` is not TE's; TE's experimental classes are
    refused here (never pickled, dequantized or dropped). ``name`` names ``obj`` in the error."""
    table = TE_ADAPTERS if table is None else table
    for c in type(obj).__mro__:
        if not c.__module__.startswith("transformer_engine."):
            continue
        if c.__name__ in TE_EXPERIMENTAL:
            raise UnsupportedValueError(
                f"{c.__module__}.{c.__name__} is marked experimental in Transformer Engine; te-serial "
                "does not store it (it would have to be pickled or dequantized): quantize with one of "
                "TE's formats (Float8, MXFP8, Float8Block, NVFP4) or pass a plain tensor", tensor=name)
        if c.__name__ in table:
            return table[c.__name__]
    return None


def te_value_fields(tq: Any) -> dict[str, Any] | None:
    """TE quantizer ``tq``'s value fields (``_value_key()``, what torch.compile rebuilds it from),
    or None where TE gives its class no value key (delayed scaling's ``Float8Quantizer``)."""
    value_fields = getattr(tq, "_value_fields", None)
    if value_fields is None or value_fields() is None:
        return None
    return dict(tq._value_key()[1])


def quantizer_from_te_fields(cls: type[Quantizer], fields: Mapping[str, Any], *, te_class: str,
                             convert: Mapping[str, Callable[[Any], dict[str, Any]]] | None = None,
                             te_defaults: Mapping[str, Any] | None = None,
                             swizzles: bool = False) -> Quantizer:
    """``cls`` built from TE value fields: the usages; a field ``cls`` also has, taken as it is
    (``convert`` maps a TE field to our keyword arguments where they differ); a TE field ``cls``
    lacks is accepted only at TE's default (``te_defaults``), else refused, so nothing is dropped.
    ``optimize_for_gemm`` means GEMM-swizzled scales where the format swizzles (``swizzles``):
    refused there (te-serial's buffers hold compact scales), ignored elsewhere as TE does."""
    f = dict(fields)
    kw: dict[str, Any] = {"rowwise": bool(f.pop("rowwise_usage")), "columnwise": bool(f.pop("columnwise_usage"))}
    if f.pop("optimize_for_gemm", False) and swizzles:
        raise FormatError(f"{te_class} with optimize_for_gemm=True describes GEMM-swizzled scales; te-serial "
                          "holds compact scales: read such a tensor with te_serial.from_te, which unswizzles")
    ours = {fl.name for fl in dataclasses.fields(cls)}
    defaults = te_defaults or {}
    for k, v in f.items():
        if k in _TE_RUNTIME_FIELDS:
            continue
        if convert and k in convert:
            kw.update(convert[k](v))
        elif k in ours:
            kw[k] = v
        elif k not in defaults or v != defaults[k]:
            raise FormatError(f"{te_class} field {k}={v!r} has no equivalent in te-serial's {cls.__name__}")
    return cls(**kw)


def _as_shape(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Same bytes in te-serial's shape (TE's C++ allocates some buffers flattened to 2-D)."""
    if t is None or tuple(t.shape) == tuple(shape):
        return t
    if t.numel() != torch.Size(shape).numel():
        raise FormatError(f"TE buffer of shape {tuple(t.shape)} cannot hold shape {tuple(shape)}")
    return t.reshape(shape)


class TEAdapter:
    """One format's mapping to TE: subclasses implement ``read``, ``te_quantizer``, ``te_kwargs``."""

    te_module: ClassVar[str]     # module under transformer_engine.pytorch, e.g. "tensor.mxfp8_tensor"
    te_tensor: ClassVar[str]     # TE's tensor class name
    te_storage: ClassVar[str]    # TE's storage class name
    te_quantizers: ClassVar[tuple[str, ...]] = ()  # TE's quantizer class names it reads (TensorSpec)

    def read(self, t: Any, tq: Any, shape: tuple[int, ...]) -> tuple[Quantizer, dict[str, torch.Tensor | None]]:
        """The te-serial quantizer of TE tensor ``t`` (TE quantizer ``tq``, may be None) and its
        buffers by te-serial name, as TE holds them."""
        raise NotImplementedError

    def te_quantizer(self, q: Quantizer, te: TEContext) -> Any:
        """TE's quantizer with the same fields as ``q``."""
        raise NotImplementedError

    def te_kwargs(self, q: Quantizer, buffers: Mapping[str, torch.Tensor], te: TEContext) -> dict[str, Any]:
        """TE tensor constructor arguments for these buffers (besides shape, dtype, quantizer,
        device, requires_grad), with compact scales."""
        raise NotImplementedError

    def from_te_quantizer(self, tq: Any) -> Quantizer:
        """te-serial's quantizer with TE quantizer ``tq``'s fields, read from TE's value key."""
        fields = te_value_fields(tq)
        if fields is None:
            raise FormatError(f"{type(tq).__name__} has no value key te-serial can read")
        return self.quantizer_from_fields(type(tq).__name__, fields)

    def quantizer_from_fields(self, te_class: str, fields: Mapping[str, Any]) -> Quantizer:
        """te-serial's quantizer for TE quantizer class ``te_class`` with value ``fields``
        (usually :func:`quantizer_from_te_fields` with the format's field mapping)."""
        raise NotImplementedError

    def from_te(self, t: Any, tq: Any, shape: tuple[int, ...]) -> tuple[Quantizer, dict[str, torch.Tensor | None]]:
        """:meth:`read`, then te-serial's shapes, unswizzled scales and zero scale padding."""
        q, bufs = self.read(t, tq, shape)
        specs = q.describe_buffers(shape)
        out = {n: _as_shape(b, specs[n].shape) if n in specs else b for n, b in bufs.items()}
        if getattr(t, "_with_gemm_swizzled_scales", False):
            for u in q.usages_on():
                lay = q.usage_layout(u)
                if lay.grid is not None and out.get(lay.scale) is not None:
                    # TE swizzles [unblocked dim, blocked dim] scales: transpose first if stored the other way
                    columnwise = (lay.grid[0] > 1) != lay.scale_transposed
                    out[lay.scale] = unswizzle_scales(out[lay.scale], columnwise=columnwise)
        return q, q.zero_padding(out, shape)


def adapter_for(q: Quantizer) -> "TEAdapter":
    """The TE adapter of quantizer ``q``'s class; a :class:`FormatError` naming the format where it has
    none (MXFP4: Transformer Engine has no tensor class for it)."""
    adapter = type(q).te_adapter
    if adapter is None:
        why = ("no TE adapter is registered for it" if type(q).has_te_class else
               "Transformer Engine has no tensor class for this format; te-serial keeps it as its own tensor")
        raise FormatError(f"{type(q).__name__} ({q.layout_name()}) has no Transformer Engine equivalent: {why}")
    return adapter


def register_te_adapter(adapter: TEAdapter, *quantizers: type[Quantizer]) -> TEAdapter:
    """Register ``adapter`` under TE's class names and as the adapter of ``quantizers``."""
    for table, names in ((TE_ADAPTERS, (adapter.te_tensor, adapter.te_storage)),
                         (TE_QUANTIZER_ADAPTERS, adapter.te_quantizers)):
        for name in names:
            if name in table and type(table[name]).__qualname__ != type(adapter).__qualname__:
                raise FormatError(f"TE class {name!r} has two adapters")
            table[name] = adapter
    for cls in quantizers:
        cls.te_adapter = adapter
    return adapter
