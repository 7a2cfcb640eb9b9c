"""Exact conversion between te-serial's ``TensorProto`` and TE's ``TensorSpec``.

TE 2.20's ``transformer_engine.pytorch.dynamo.TensorSpec`` is the same data-free prototype
(shape, dtype, quantizer, requires_grad, device; ``inner_names``, ``create_tensor``,
``assemble``), so the two convert field by field. TE's quantizer is built by the format's TE
adapter (``te_quantizer``, as ``to_te`` does) and read back from TE's value key, the fields
``register_value_opaque_quantizer`` declares (``from_te_quantizer``); this module holds no
per-format code and imports TE lazily.

Where the two differ, by design:

- **Delayed scaling** (``Float8Quantizer``): TE gives it no value key (its scale and amax are
  live tensors) and no ``inner_tensor_specs``, so TE's ``TensorSpec`` holding it cannot list or
  allocate its buffers. ``to_te_spec`` still builds the spec with a real TE ``Float8Quantizer``
  (scale and amax as one-element fp32 tensors) and ``from_te_spec`` reads them back exactly;
  the buffers come from te-serial's proto.
- **Per-tensor FP8 columnwise on Blackwell** (``is_non_tn_fp8_gemm_supported()``): TE's spec
  then lists ``_data`` where te-serial's proto lists ``_transpose`` (te-serial keeps the Hopper
  layout); read such a tensor's bytes with ``from_te``, which derives the transpose.
- **GEMM-swizzled scales** (``optimize_for_gemm`` on an MXFP8 / NVFP4 quantizer) are refused:
  te-serial's buffers hold compact scales (``from_te`` unswizzles a tensor's).
- Fields that do not change the stored tensor are not kept: ``with_amax_reduction`` and
  ``internal`` (TE's bare storage class instead of its wrapper; the same buffers).
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ..formats.base import Quantizer
from ..formats.te_adapter import TE_QUANTIZER_ADAPTERS, adapter_for, find_te_adapter
from ..proto import TensorProto
from .interop import TEModules, te_module


def to_te_spec(proto: TensorProto) -> Any:
    """TE's ``TensorSpec`` for ``proto``: same shape, dtype, requires_grad, device, and TE's
    quantizer with the same fields (made by the format's TE adapter)."""
    if not isinstance(proto, TensorProto):
        raise FormatError(f"to_te_spec needs a TensorProto, got {type(proto).__name__}")
    tensor_spec = te_module("dynamo.tensor_spec")
    q = proto.quantizer
    tq = None if q is None else adapter_for(q).te_quantizer(q, TEModules())
    return tensor_spec.TensorSpec(shape=proto.shape, dtype=proto.dtype, quantizer=tq,
                                  requires_grad=proto.requires_grad, device=proto.device)


def from_te_spec(spec: Any) -> TensorProto:
    """te-serial's ``TensorProto`` for TE's ``TensorSpec`` (its quantizer's fields read from TE's
    value key); TE's experimental quantizers and fields te-serial cannot hold are refused."""
    try:
        shape, dtype, tq = tuple(spec.shape), spec.dtype, spec.quantizer
        requires_grad, device = bool(spec.requires_grad), spec.device
    except (AttributeError, TypeError):
        raise FormatError(f"from_te_spec needs TE's TensorSpec, got {type(spec).__name__}") from None
    q = tq
    if tq is not None and not isinstance(tq, Quantizer):
        adapter = find_te_adapter(tq, TE_QUANTIZER_ADAPTERS)
        if adapter is None:
            raise FormatError(f"TensorSpec quantizer {type(tq).__name__} is not one te-serial reads")
        q = adapter.from_te_quantizer(tq)
    return TensorProto(shape, dtype, q, requires_grad, device)
