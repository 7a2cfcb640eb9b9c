"""Per-tensor FP8: delayed scaling (``Float8Quantizer``) and current scaling.

TE: pytorch/tensor/float8_tensor.py, pytorch/tensor/storage/float8_tensor_storage.py.
Buffers: ``_data`` (rowwise FP8 bits, shape S), ``_transpose`` (columnwise: the same bytes,
``movedim(-1, 0)``), ``_scale_inv`` (fp32 (1,)). te-serial keeps TE's Hopper layout, where the
columnwise usage is served by the transpose.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import FormatError
from .protocol import COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, fp8_short_name, require_fp8_dtype
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .blockwise import Float8BlockQuantizer
from .te_adapter import (TE_FP8_CODE, TEAdapter, TEContext, quantizer_from_te_fields, register_te_adapter,
                         te_fp8_dtype, te_value_fields)


class Float8TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_data", "_transpose", "_scale_inv")


class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """Per-tensor-scaled FP8 tensor (TE's ``Float8Tensor``)."""


class _PerTensorFP8:
    """Layout, rules and numerics shared by both per-tensor FP8 quantizers.

    Exact paths out of per-tensor FP8 (same FP8 dtype): the other per-tensor scaling (same bytes
    and scale_inv), the transpose (same bytes), and blockwise 1×128 / 128×128 (the one scale in
    every block), which also gives DeepSeek and compressed-tensors layouts.
    """

    storage_class: ClassVar[type] = Float8TensorStorage
    tensor_class: ClassVar[type] = Float8Tensor
    _dtype_fields: ClassVar[tuple[str, ...]] = ("fp8_dtype",)
    _name: ClassVar[str]

    def usage_layout(self, usage):
        if usage == ROWWISE:
            return UsageLayout("_data", "_scale_inv")
        return UsageLayout("_transpose", "_scale_inv", transposed=True)

    def layout_key(self):
        return (self.kind, self.fp8_dtype)

    def layout_name(self):
        return f"{self._name}_{fp8_short_name(self.fp8_dtype)}"

    def exact_output(self, target):
        if getattr(target, "fp8_dtype", None) != self.fp8_dtype:
            return None
        use = dict(rowwise=target.rowwise, columnwise=target.columnwise)
        if type(target) is type(self):
            return dataclasses.replace(self, **use)
        if isinstance(target, Float8CurrentScalingQuantizer):
            return Float8CurrentScalingQuantizer(self.fp8_dtype, **use)
        if isinstance(target, Float8Quantizer):
            return Float8Quantizer(1.0, 0.0, self.fp8_dtype, **use)  # scale / amax settled from the data
        if isinstance(target, Float8BlockQuantizer):
            return Float8BlockQuantizer(self.fp8_dtype, block_scaling_dim=target.block_scaling_dim,
                                        force_pow_2_scales=getattr(self, "force_pow_2_scales", False),
                                        amax_epsilon=getattr(self, "amax_epsilon", 0.0), **use)
        return None

    def derivable(self, out, usage):
        return True  # the transpose is the same bytes; the one scale fits every block

    def derive(self, buffers, shape, out, usage):
        src = usage if self.has_usage(usage) else next(u for u in self.usages_on())
        if out.scale_per_tensor and src == usage:
            return self.usage_buffers(buffers, usage)
        return self.relayout(buffers, shape, out, usage, src)

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

    def _scale(self, x2: torch.Tensor, args: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The quantization scale for ``x2`` (``args``: ``_kernel_args``, made here when None)."""
        raise NotImplementedError

    def fusable(self) -> bool:
        return True

    def _prepare(self, x2, args):
        scale = self._scale(x2, args)
        return scale, {"_scale_inv": nx.reciprocal(scale).reshape(1)}

    def _quantize_rows(self, xc, scale):
        if not self.columnwise:
            return {"_data": nx.scale_and_cast_to_fp8(xc, scale, self.fp8_dtype)}
        # one scale for every element: the transpose is the same codes, moved
        codes, transposed = nx.scale_and_cast_to_fp8_transposed(xc, scale, self.fp8_dtype, xc.shape,
                                                                keep_rows=self.rowwise)
        return {"_data": codes, "_transpose": transposed} if self.rowwise else {"_transpose": transposed}

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        scale_inv = buffers["_scale_inv"]
        if "_data" in buffers:
            return nx.dequantize_fp8(buffers["_data"], scale_inv, self.fp8_dtype)
        values = nx.dequantize_fp8(buffers["_transpose"], scale_inv, self.fp8_dtype)
        return values.movedim(0, -1).contiguous()


@dataclasses.dataclass(frozen=True)
class Float8CurrentScalingQuantizer(_PerTensorFP8, Quantizer):
    """Per-tensor FP8 with the scale computed from this tensor's amax (``compute_scale_from_amax``)."""

    kind: ClassVar[str] = "fp8_current_scaling"
    _name: ClassVar[str] = "fp8_current"

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    force_pow_2_scales: bool = dataclasses.field(default=False, kw_only=True)
    amax_epsilon: float = dataclasses.field(default=0.0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)
        object.__setattr__(self, "amax_epsilon", float(self.amax_epsilon))

    def takes_tensor_amax(self) -> bool:
        return True

    def shares_fused_scale(self) -> bool:
        # vLLM and SGLang requantize a fused group's members to the largest per-tensor scale at load
        # (requantize_with_max_scale), as ModelOpt's and llm-compressor's exports need: a copied
        # member keeps its own scale
        return False

    def _scale(self, x2, args=None):
        return nx.scale_from_amax(self._tensor_amax(x2, args), nx.fp8_max(self.fp8_dtype),
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
    data_dependent: ClassVar[bool] = True
    _name: ClassVar[str] = "fp8_delayed"

    scale: float = 1.0
    amax: float = 0.0
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)
        object.__setattr__(self, "scale", _as_fp32_value(self.scale))
        object.__setattr__(self, "amax", _as_fp32_value(self.amax))

    def _kernel_args(self, device):
        return {"scale": torch.tensor(self.scale, dtype=torch.float32, device=device)}

    def _scale(self, x2, args=None):
        return (args or self._kernel_args(x2.device))["scale"]

    def settle(self, x, buffers=None):
        """As TE settles after seeing ``x``: amax = max|x| and, unless ``buffers`` already hold a
        scale_inv to keep, scale = fp8_max / amax (margin 0)."""
        amax = nx.nan_ignoring_amax(x)
        if buffers is not None:
            scale = nx.reciprocal(buffers["_scale_inv"].reshape(()))
        else:
            scale = nx.scale_from_amax(amax, nx.fp8_max(self.fp8_dtype), force_pow_2_scales=False,
                                       epsilon=0.0, value_for_inf=nx.FP32_MAX)
        return dataclasses.replace(self, scale=float(scale), amax=float(amax))


class _Float8TE(TEAdapter):
    """TE's ``Float8Tensor``: a ``_data``-only tensor whose quantizer asks for the columnwise usage
    (Blackwell) gets its transpose, as te-serial keeps TE's Hopper layout; a tensor without a
    quantizer (TE's pickles drop it) reads as current scaling."""

    te_module = "tensor.float8_tensor"
    te_tensor = "Float8Tensor"
    te_storage = "Float8TensorStorage"
    te_quantizers = ("Float8Quantizer", "Float8CurrentScalingQuantizer")

    def read(self, t, tq, shape):
        fp8 = te_fp8_dtype(t._fp8_dtype)
        data, transpose = t._data, getattr(t, "_transpose", None)
        if getattr(t, "_transpose_invalid", False):
            transpose = None
        derive_col = (tq is not None and bool(getattr(tq, "columnwise_usage", False))
                      and transpose is None and data is not None)
        row, col = data is not None, transpose is not None or derive_col
        if tq is not None and not bool(getattr(tq, "rowwise_usage", True)) and col:
            row = False
        kind = type(tq).__name__ if tq is not None else None
        if kind == "Float8Quantizer":  # delayed scaling: the quantizer's scale and amax are state
            q = Float8Quantizer(tq.scale, tq.amax, fp8, rowwise=row, columnwise=col)
        elif kind in (None, "Float8CurrentScalingQuantizer"):
            q = Float8CurrentScalingQuantizer(fp8, rowwise=row, columnwise=col,
                                              force_pow_2_scales=bool(getattr(tq, "force_pow_2_scales", False)),
                                              amax_epsilon=float(getattr(tq, "amax_epsilon", 0.0)))
        else:
            raise FormatError(f"Float8 tensor with quantizer {kind} is not supported")
        bufs = {"_data": data if row else None, "_transpose": transpose, "_scale_inv": t._scale_inv.reshape(1)}
        if derive_col:
            src = q.set_usage(rowwise=True, columnwise=False)
            bufs.update(src.derive({"_data": data, "_scale_inv": bufs["_scale_inv"]}, shape, q, COLUMNWISE))
        return q, bufs

    def from_te_quantizer(self, tq):
        if te_value_fields(tq) is not None:
            return super().from_te_quantizer(tq)
        # delayed scaling: TE gives Float8Quantizer no value key (scale and amax are live tensors)
        return Float8Quantizer(tq.scale, tq.amax, te_fp8_dtype(tq.dtype), rowwise=bool(tq.rowwise_usage),
                               columnwise=bool(tq.columnwise_usage))

    def quantizer_from_fields(self, te_class, fields):
        if te_class != "Float8CurrentScalingQuantizer":
            raise FormatError(f"{te_class} is not a Float8 quantizer te-serial reads from a value key")
        return quantizer_from_te_fields(Float8CurrentScalingQuantizer, fields, te_class=te_class,
                                        convert={"dtype": lambda v: {"fp8_dtype": te_fp8_dtype(v)}})

    def te_quantizer(self, q, te: TEContext) -> Any:
        mod, dt = te.module(self.te_module), te.DType(TE_FP8_CODE[q.fp8_dtype])
        usage = dict(rowwise=q.rowwise, columnwise=q.columnwise)
        if isinstance(q, Float8Quantizer):
            return mod.Float8Quantizer(torch.tensor([q.scale]), torch.tensor([q.amax]), dt, **usage)
        return mod.Float8CurrentScalingQuantizer(dt, torch.device("cpu"), **usage,
                                                 force_pow_2_scales=q.force_pow_2_scales,
                                                 amax_epsilon=q.amax_epsilon)

    def te_kwargs(self, q, buffers, te):
        return dict(data=buffers.get("_data"), fp8_scale_inv=buffers["_scale_inv"],
                    fp8_dtype=te.DType(TE_FP8_CODE[q.fp8_dtype]), data_transpose=buffers.get("_transpose"))


register_te_adapter(_Float8TE(), Float8Quantizer, Float8CurrentScalingQuantizer)
