"""Per-tensor FP8: delayed scaling (``Float8Quantizer``) and current scaling.

TE: pytorch/tensor/float8_tensor.py, pytorch/tensor/storage/float8_tensor_storage.py.
Buffers: ``_data`` (rowwise FP8 bits, shape S), ``_transpose`` (columnwise: the same bytes,
``movedim(-1, 0)``), ``_scale_inv`` (fp32 (1,)). te-serial keeps TE's Hopper layout, where the
columnwise usage is served by the transpose.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import FormatError
from .base import BufferSpec, QuantizedTensor, QuantizedTensorStorage, Quantizer, require_fp8_dtype


class Float8TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_data", "_transpose", "_scale_inv")


class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """Per-tensor-scaled FP8 tensor (TE's ``Float8Tensor``)."""


class _PerTensorFP8:
    """Layout and numerics shared by both per-tensor FP8 quantizers."""

    storage_class: ClassVar[type] = Float8TensorStorage
    tensor_class: ClassVar[type] = Float8Tensor
    _dtype_fields: ClassVar[tuple[str, ...]] = ("fp8_dtype",)

    def _buffer_specs(self, shape):
        specs = {}
        if self.rowwise:
            specs["_data"] = BufferSpec(shape, torch.uint8)
        if self.columnwise:
            specs["_transpose"] = BufferSpec((shape[-1], *shape[:-1]), torch.uint8)
        specs["_scale_inv"] = BufferSpec((1,), torch.float32)
        return specs

    def value_dtypes(self) -> dict[str, torch.dtype]:
        return {"_data": self.fp8_dtype, "_transpose": self.fp8_dtype, "_scale_inv": torch.float32}

    def _scale(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _prepare(self, x2, out):
        scale = self._scale(x2)
        out["_scale_inv"].copy_(nx.reciprocal(scale).reshape(1))
        return scale

    def _quantize_rows(self, xc, r0, scale, out, m):
        rows, k = xc.shape
        q = nx.scale_and_cast_to_fp8(xc, scale, self.fp8_dtype)
        if "_data" in out:
            out["_data"].view(m, k)[r0:r0 + rows] = q
        if "_transpose" in out:
            out["_transpose"].view(k, m)[:, r0:r0 + rows] = q.t()

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        scale_inv = buffers["_scale_inv"]
        if "_data" in buffers:
            return nx.fp8_to_float(buffers["_data"], self.fp8_dtype) * scale_inv
        values = nx.fp8_to_float(buffers["_transpose"], self.fp8_dtype) * scale_inv
        return values.movedim(0, -1).contiguous()


@dataclasses.dataclass(frozen=True)
class Float8CurrentScalingQuantizer(_PerTensorFP8, Quantizer):
    """Per-tensor FP8 with the scale computed from this tensor's amax (``compute_scale_from_amax``)."""

    kind: ClassVar[str] = "fp8_current_scaling"

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    force_pow_2_scales: bool = dataclasses.field(default=False, kw_only=True)
    amax_epsilon: float = dataclasses.field(default=0.0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)
        object.__setattr__(self, "amax_epsilon", float(self.amax_epsilon))

    def _scale(self, x2):
        return nx.scale_from_amax(nx.nan_ignoring_amax(x2), nx.fp8_max(self.fp8_dtype),
                                  force_pow_2_scales=self.force_pow_2_scales,
                                  epsilon=self.amax_epsilon, value_for_inf=nx.FP32_MAX)


def _as_fp32_value(v) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise FormatError(f"Float8Quantizer scale/amax must hold one value, got shape {tuple(v.shape)}")
        v = v.detach().reshape(()).cpu()
    return float(torch.tensor(float(v), dtype=torch.float32))


@dataclasses.dataclass(frozen=True)
class Float8Quantizer(_PerTensorFP8, Quantizer):
    """Delayed scaling: quantizes with a stored ``scale``; carries the recorded ``amax``.

    TE keeps scale and amax as live views of the module's ``fp8_meta``; here they are fp32
    values frozen into the quantizer, so a checkpoint records exactly what was used.
    """

    kind: ClassVar[str] = "fp8_delayed_scaling"

    scale: float = 1.0
    amax: float = 0.0
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)
        object.__setattr__(self, "scale", _as_fp32_value(self.scale))
        object.__setattr__(self, "amax", _as_fp32_value(self.amax))

    def _scale(self, x2):
        return torch.tensor(self.scale, dtype=torch.float32, device=x2.device)
