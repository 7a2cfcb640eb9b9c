"""Exact adapters between Transformer Engine's tensor classes and te-serial's.

``from_te`` reads a TE ``Float8Tensor`` / ``MXFP8Tensor`` / ``Float8BlockwiseQTensor`` /
``NVFP4Tensor`` (or its ``*Storage`` form) by TE's own attribute names and returns the matching
te-serial tensor with the same bytes: shared when TE's layout already is te-serial's, copied
where it must change (swizzled scales are unswizzled, uninitialized scale padding is zeroed,
Blackwell's ``_data``-only columnwise usage gets its transpose). ``to_te`` goes back to TE's
class with TE's quantizer. TE is imported lazily: te-serial works without it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .errors import FormatError, TeSerialError
from .formats import (Float8BlockQuantizer, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer,
                      Float8Quantizer, Float8Tensor, MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer,
                      NVFP4Tensor, QuantizedTensorStorage, unswizzle_scales)
from .formats.base import flatten_2d

#: TE's DType values (transformer_engine/common/include/transformer_engine/transformer_engine.h)
_TE_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
_TORCH_TO_TE = {v: k for k, v in _TE_FP8.items()}

#: TE class name → te-serial format family
_FAMILIES = {
    "Float8Tensor": "float8", "Float8TensorStorage": "float8",
    "MXFP8Tensor": "mxfp8", "MXFP8TensorStorage": "mxfp8",
    "Float8BlockwiseQTensor": "blockwise", "Float8BlockwiseQTensorStorage": "blockwise",
    "NVFP4Tensor": "nvfp4", "NVFP4TensorStorage": "nvfp4",
}


class TransformerEngineUnavailable(TeSerialError, ImportError):
    """Transformer Engine (its PyTorch part) is not importable here."""


def _te_module(name: str):
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


def is_te_tensor(t: Any) -> bool:
    """True for TE's quantized tensor and storage classes (checked by class, without importing TE)."""
    return any(c.__module__.startswith("transformer_engine.") and c.__name__ in _FAMILIES
               for c in type(t).__mro__)


def _family(t: Any) -> str:
    for c in type(t).__mro__:
        if c.__module__.startswith("transformer_engine.") and c.__name__ in _FAMILIES:
            return _FAMILIES[c.__name__]
    raise FormatError(f"{type(t).__name__} is not a TE quantized tensor")


def _fp8_dtype(te_dtype: Any) -> torch.dtype:
    try:
        return _TE_FP8[int(te_dtype)]
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"TE dtype {te_dtype!r} is not an FP8 dtype te-serial reads") from None


def _shape_and_dtype(t: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    return tuple(t.size()), getattr(t, "_dtype", None) or torch.float32


def _usage(q: Any, default_row: bool, default_col: bool) -> tuple[bool, bool]:
    if q is None:
        return default_row, default_col
    return bool(getattr(q, "rowwise_usage", default_row)), bool(getattr(q, "columnwise_usage", default_col))


def _zero_padding(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The compact scale with everything outside [:rows, :cols] zero (TE leaves padding uninitialized)."""
    if scale.shape[0] == rows and scale.shape[1] == cols:
        return scale
    pad = scale.clone()
    pad[rows:] = 0
    pad[:, cols:] = 0
    if torch.equal(pad.view(torch.uint8), scale.view(torch.uint8)):
        return scale  # already zero: share TE's buffer
    return pad


def _as_shape(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """TE's C++ allocates some columnwise buffers flattened to 2-D; same bytes, te-serial's shape."""
    if t is None or tuple(t.shape) == tuple(shape):
        return t
    if t.numel() != torch.Size(shape).numel():
        raise FormatError(f"TE buffer of shape {tuple(t.shape)} cannot hold shape {tuple(shape)}")
    return t.reshape(shape)


def from_te(t: Any) -> QuantizedTensorStorage:
    """The te-serial tensor holding exactly the bytes of a TE quantized tensor or storage."""
    if isinstance(t, QuantizedTensorStorage):
        return t
    family = _family(t)
    shape, fake_dtype = _shape_and_dtype(t)
    tq = getattr(t, "_quantizer", None)
    requires_grad = bool(getattr(t, "requires_grad", False))
    if family == "float8":
        out = _from_te_float8(t, tq, shape, fake_dtype)
    elif family == "mxfp8":
        out = _from_te_mxfp8(t, tq, shape, fake_dtype)
    elif family == "blockwise":
        out = _from_te_blockwise(t, tq, shape, fake_dtype)
    else:
        out = _from_te_nvfp4(t, tq, shape, fake_dtype)
    out.quantizer.check_buffers(shape, out.buffers(), where=type(t).__name__)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _from_te_float8(t, tq, shape, fake_dtype) -> Float8Tensor:
    fp8 = _fp8_dtype(t._fp8_dtype)
    data, transpose = t._data, getattr(t, "_transpose", None)
    if getattr(t, "_transpose_invalid", False):
        transpose = None
    row, col = data is not None, transpose is not None
    if tq is not None and bool(getattr(tq, "columnwise_usage", False)) and transpose is None and data is not None:
        transpose = data.movedim(-1, 0).contiguous()  # Blackwell: _data serves both; te-serial keeps TE's Hopper layout
        col = True
    if tq is not None and not bool(getattr(tq, "rowwise_usage", True)) and transpose is not None:
        data, row = None, False
    kind = type(tq).__name__ if tq is not None else None
    if kind == "Float8Quantizer":  # delayed scaling: the quantizer's scale and amax are state
        q = Float8Quantizer(tq.scale, tq.amax, fp8, rowwise=row, columnwise=col)
    elif kind in (None, "Float8CurrentScalingQuantizer"):
        q = Float8CurrentScalingQuantizer(fp8, rowwise=row, columnwise=col,
                                          force_pow_2_scales=bool(getattr(tq, "force_pow_2_scales", False)),
                                          amax_epsilon=float(getattr(tq, "amax_epsilon", 0.0)))
    else:
        raise FormatError(f"Float8 tensor with quantizer {kind} is not supported")
    return Float8Tensor(shape, fake_dtype, q, _data=data, _transpose=transpose,
                        _scale_inv=t._scale_inv.reshape(1))


def _from_te_mxfp8(t, tq, shape, fake_dtype) -> MXFP8Tensor:
    fp8 = _fp8_dtype(t._fp8_dtype)
    row, col = t._rowwise_data is not None, t._columnwise_data is not None
    q = MXFP8Quantizer(fp8, rowwise=row, columnwise=col,
                       with_2d_quantization=bool(getattr(tq, "with_2d_quantization", False)))
    m, k = flatten_2d(shape)
    swizzled = bool(getattr(t, "_with_gemm_swizzled_scales", False))
    bufs = {}
    if row:
        s = t._rowwise_scale_inv
        s = unswizzle_scales(s) if swizzled else s
        bufs.update(_rowwise_data=t._rowwise_data, _rowwise_scale_inv=_zero_padding(s, m, k // 32))
    if col:
        s = t._columnwise_scale_inv
        s = unswizzle_scales(s, columnwise=True) if swizzled else s
        bufs.update(_columnwise_data=t._columnwise_data, _columnwise_scale_inv=_zero_padding(s, m // 32, k))
    return MXFP8Tensor(shape, fake_dtype, q, **bufs)


def _from_te_blockwise(t, tq, shape, fake_dtype) -> Float8BlockwiseQTensor:
    fp8 = _fp8_dtype(t._fp8_dtype)
    row, col = t._rowwise_data is not None, t._columnwise_data is not None
    dim = 2 if t._is_2D_scaled else 1
    q = Float8BlockQuantizer(fp8, rowwise=row, columnwise=col, block_scaling_dim=dim,
                             force_pow_2_scales=bool(getattr(tq, "force_pow_2_scales", True)),
                             amax_epsilon=float(getattr(tq, "amax_epsilon", 0.0)))
    specs = q.describe_buffers(shape)
    m, k = flatten_2d(shape)
    mb, kb = -(-m // 128), -(-k // 128)
    valid = {"_rowwise_scale_inv": (mb, kb) if dim == 2 else (kb, m),
             "_columnwise_scale_inv": (kb, mb) if dim == 2 else (mb, k)}
    bufs = {}
    for name in specs:
        b = _as_shape(getattr(t, name), specs[name].shape)
        bufs[name] = _zero_padding(b, *valid[name]) if name in valid else b
    return Float8BlockwiseQTensor(shape, fake_dtype, q, **bufs)


def _from_te_nvfp4(t, tq, shape, fake_dtype) -> NVFP4Tensor:
    if getattr(t, "_row_scaled_nvfp4", False) or getattr(t, "_nvfp4_use_4over6", False):
        raise FormatError("row-scaled and 4over6 NVFP4 tensors are not supported by te-serial yet")
    row, col = t._rowwise_data is not None, t._columnwise_data is not None
    q = NVFP4Quantizer(rowwise=row, columnwise=col,
                       with_rht=bool(getattr(tq, "with_rht", False)),
                       with_post_rht_amax=bool(getattr(tq, "with_post_rht_amax", False)),
                       with_2d_quantization=bool(getattr(tq, "with_2d_quantization", False)),
                       stochastic_rounding=bool(getattr(tq, "stochastic_rounding", False)),
                       with_random_sign_mask=bool(getattr(tq, "rht_matrix_random_sign_mask_t", 1)))
    specs = q.describe_buffers(shape)
    m, k = flatten_2d(shape)
    swizzled = bool(getattr(t, "_with_gemm_swizzled_scales", False))
    valid = {"_rowwise_scale_inv": (m, -(-k // 16)), "_columnwise_scale_inv": (k, -(-m // 16))}
    bufs = {}
    for name in specs:
        b = _as_shape(getattr(t, name), specs[name].shape)
        if name in valid:
            b = unswizzle_scales(b, columnwise=False) if swizzled else b  # NVFP4 columnwise scales are already [K, M/16]
            b = _zero_padding(b, *valid[name])
        bufs[name] = b
    return NVFP4Tensor(shape, fake_dtype, q, **bufs)


# --- te-serial → TE ------------------------------------------------------------------------------

def to_te_quantizer(q) -> Any:
    """TE's quantizer with the same fields as a te-serial quantizer."""
    tex = _tex()
    usage = dict(rowwise=q.rowwise, columnwise=q.columnwise)
    if isinstance(q, Float8Quantizer):
        mod = _te_module("tensor.float8_tensor")
        return mod.Float8Quantizer(torch.tensor([q.scale]), torch.tensor([q.amax]),
                                   tex.DType(_TORCH_TO_TE[q.fp8_dtype]), **usage)
    if isinstance(q, Float8CurrentScalingQuantizer):
        mod = _te_module("tensor.float8_tensor")
        return mod.Float8CurrentScalingQuantizer(tex.DType(_TORCH_TO_TE[q.fp8_dtype]), torch.device("cpu"),
                                                 **usage, force_pow_2_scales=q.force_pow_2_scales,
                                                 amax_epsilon=q.amax_epsilon)
    if isinstance(q, MXFP8Quantizer):
        mod = _te_module("tensor.mxfp8_tensor")
        return mod.MXFP8Quantizer(tex.DType(_TORCH_TO_TE[q.fp8_dtype]), **usage,
                                  with_2d_quantization=q.with_2d_quantization)
    if isinstance(q, Float8BlockQuantizer):
        mod = _te_module("tensor.float8_blockwise_tensor")
        return mod.Float8BlockQuantizer(tex.DType(_TORCH_TO_TE[q.fp8_dtype]), **usage,
                                        amax_epsilon=q.amax_epsilon, force_pow_2_scales=q.force_pow_2_scales,
                                        block_scaling_dim=q.block_scaling_dim)
    if isinstance(q, NVFP4Quantizer):
        mod = _te_module("tensor.nvfp4_tensor")
        return mod.NVFP4Quantizer(**usage, with_rht=q.with_rht, with_post_rht_amax=q.with_post_rht_amax,
                                  with_2d_quantization=q.with_2d_quantization,
                                  stochastic_rounding=q.stochastic_rounding,
                                  with_random_sign_mask=q.with_random_sign_mask)
    raise FormatError(f"no TE quantizer for {type(q).__name__}")


def to_te(t: QuantizedTensorStorage) -> Any:
    """TE's own tensor class for a te-serial tensor (same buffers, TE's quantizer, compact scales)."""
    if is_te_tensor(t):
        return t
    if not isinstance(t, QuantizedTensorStorage):
        raise FormatError(f"to_te needs a te-serial quantized tensor, got {type(t).__name__}")
    tex = _tex()
    q = t.quantizer
    tq = to_te_quantizer(q)
    b = t.buffers()
    common = dict(shape=tuple(t.logical_shape), dtype=t.fake_dtype, quantizer=tq,
                  device=next(iter(b.values())).device,
                  requires_grad=bool(getattr(t, "requires_grad", False)))
    if isinstance(t, Float8Tensor):
        mod = _te_module("tensor.float8_tensor")
        return mod.Float8Tensor(data=b.get("_data"), fp8_scale_inv=b["_scale_inv"],
                                fp8_dtype=tex.DType(_TORCH_TO_TE[q.fp8_dtype]),
                                data_transpose=b.get("_transpose"), **common)
    if isinstance(t, MXFP8Tensor):
        mod = _te_module("tensor.mxfp8_tensor")
        return mod.MXFP8Tensor(rowwise_data=b.get("_rowwise_data"), rowwise_scale_inv=b.get("_rowwise_scale_inv"),
                               columnwise_data=b.get("_columnwise_data"),
                               columnwise_scale_inv=b.get("_columnwise_scale_inv"),
                               fp8_dtype=tex.DType(_TORCH_TO_TE[q.fp8_dtype]),
                               with_gemm_swizzled_scales=False, **common)
    if isinstance(t, Float8BlockwiseQTensor):
        mod = _te_module("tensor.float8_blockwise_tensor")
        return mod.Float8BlockwiseQTensor(rowwise_data=b.get("_rowwise_data"),
                                          rowwise_scale_inv=b.get("_rowwise_scale_inv"),
                                          columnwise_data=b.get("_columnwise_data"),
                                          columnwise_scale_inv=b.get("_columnwise_scale_inv"),
                                          fp8_dtype=tex.DType(_TORCH_TO_TE[q.fp8_dtype]),
                                          is_2D_scaled=q.block_scaling_dim == 2, **common)
    if isinstance(t, NVFP4Tensor):
        mod = _te_module("tensor.nvfp4_tensor")
        return mod.NVFP4Tensor(rowwise_data=b.get("_rowwise_data"), rowwise_scale_inv=b.get("_rowwise_scale_inv"),
                               columnwise_data=b.get("_columnwise_data"),
                               columnwise_scale_inv=b.get("_columnwise_scale_inv"),
                               amax_rowwise=b.get("_amax_rowwise"), amax_columnwise=b.get("_amax_columnwise"),
                               fp4_dtype=tex.DType.kFloat4E2M1, with_gemm_swizzled_scales=False, **common)
    raise FormatError(f"no TE class for {type(t).__name__}")
