"""Adapters between te-serial's formats and Transformer Engine's own tensor classes.

Each format module registers one :class:`TEAdapter` for its quantizer classes: how to read TE's
tensor (which quantizer, which buffers) and how to build TE's quantizer and tensor. What every
format shares is here: buffers reshaped to te-serial's shapes (TE's C++ allocates some flattened
to 2-D), swizzled scales unswizzled, scale padding zeroed. ``te_interop`` finds an adapter by TE
class name or by quantizer and holds no per-format code. TE is never imported here: building TE
objects gets a :class:`TEContext` (TE's modules and ``DType``) from ``te_interop``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Protocol

import torch

from ..errors import FormatError
from .base import Quantizer
from .swizzle import unswizzle_scales

__all__ = ["TEAdapter", "TEContext", "TE_ADAPTERS", "TE_FP8", "TE_FP8_CODE", "register_te_adapter",
           "te_fp8_dtype"]

#: TE's DType values (transformer_engine/common/include/transformer_engine/transformer_engine.h)
TE_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
TE_FP8_CODE = {v: k for k, v in TE_FP8.items()}

#: TE class name (tensor and storage class) → adapter
TE_ADAPTERS: dict[str, "TEAdapter"] = {}


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


def register_te_adapter(adapter: TEAdapter, *quantizers: type[Quantizer]) -> TEAdapter:
    """Register ``adapter`` under TE's class names and as the adapter of ``quantizers``."""
    for name in (adapter.te_tensor, adapter.te_storage):
        if name in TE_ADAPTERS and type(TE_ADAPTERS[name]).__qualname__ != type(adapter).__qualname__:
            raise FormatError(f"TE class {name!r} has two adapters")
        TE_ADAPTERS[name] = adapter
    for cls in quantizers:
        cls.te_adapter = adapter
    return adapter
