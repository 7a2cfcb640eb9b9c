"""MXFP8: FP8 data with one E8M0 (power-of-two) scale per 32 elements; 32×32 tiles optionally.

TE: pytorch/tensor/mxfp8_tensor.py, common/cast/mxfp8/quantize_mxfp8.cuh. Both usages hold the
data in the logical shape (columnwise is *not* transposed): rowwise blocks run along K, columnwise
blocks along M, each quantized independently from the input. Scales are compact, padded to
[roundup(M,128), roundup(K/32,4)] (rowwise) and [roundup(M/32,4), roundup(K,128)] (columnwise)
with the padding zeroed.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from .base import (BufferSpec, QuantizedTensor, QuantizedTensorStorage, Quantizer, flatten_2d,
                   require_divisible, require_fp8_dtype)

BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE (pytorch/constants.py)


class MXFP8TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """MXFP8 tensor (TE's ``MXFP8Tensor``) with compact scales."""


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8 1×32 blocks (or 32×32 tiles with ``with_2d_quantization``), E8M0 ceil-exponent scales."""

    kind: ClassVar[str] = "mxfp8"
    storage_class: ClassVar[type] = MXFP8TensorStorage
    tensor_class: ClassVar[type] = MXFP8Tensor
    _dtype_fields: ClassVar[tuple[str, ...]] = ("fp8_dtype",)

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    with_2d_quantization: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)

    def check_shape(self, shape):
        super().check_shape(shape)
        require_divisible(shape, BLOCK, "MXFP8")

    def _buffer_specs(self, shape):
        m, k = flatten_2d(shape)
        specs = {}
        if self.rowwise:
            specs["_rowwise_data"] = BufferSpec(shape, torch.uint8)
            specs["_rowwise_scale_inv"] = BufferSpec(
                (nx.round_up(m, 128), nx.round_up(k // BLOCK, 4)), torch.uint8)
        if self.columnwise:
            specs["_columnwise_data"] = BufferSpec(shape, torch.uint8)
            specs["_columnwise_scale_inv"] = BufferSpec(
                (nx.round_up(m // BLOCK, 4), nx.round_up(k, 128)), torch.uint8)
        return specs

    def value_dtypes(self) -> dict[str, torch.dtype]:
        return {"_rowwise_data": self.fp8_dtype, "_rowwise_scale_inv": torch.float8_e8m0fnu,
                "_columnwise_data": self.fp8_dtype, "_columnwise_scale_inv": torch.float8_e8m0fnu}

    def _block_exponents(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """E8M0 exponents: rowwise [M, K/32] and columnwise [M/32, K]."""
        m, k = x2.shape
        if self.with_2d_quantization:
            tile = nx.nan_ignoring_amax(x2.reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK), dim=(1, 3))
            e = nx.e8m0_from_amax(tile, self.fp8_dtype)
            return e.repeat_interleave(BLOCK, dim=0), e.repeat_interleave(BLOCK, dim=1)
        row = nx.nan_ignoring_amax(x2.reshape(m, k // BLOCK, BLOCK), dim=2)
        col = nx.nan_ignoring_amax(x2.reshape(m // BLOCK, BLOCK, k), dim=1)
        return nx.e8m0_from_amax(row, self.fp8_dtype), nx.e8m0_from_amax(col, self.fp8_dtype)

    def _quantize_rows(self, xc, r0, state, out, m):
        rows, k = xc.shape
        r1 = r0 + rows
        e_row, e_col = self._block_exponents(xc)
        if self.rowwise:
            q = nx.scale_and_cast_to_fp8(xc.reshape(rows, k // BLOCK, BLOCK),
                                         nx.e8m0_quant_scale(e_row)[..., None], self.fp8_dtype)
            out["_rowwise_data"].view(m, k)[r0:r1] = q.reshape(rows, k)
            out["_rowwise_scale_inv"][r0:r1, : k // BLOCK] = e_row
        if self.columnwise:
            q = nx.scale_and_cast_to_fp8(xc.reshape(rows // BLOCK, BLOCK, k),
                                         nx.e8m0_quant_scale(e_col)[:, None, :], self.fp8_dtype)
            out["_columnwise_data"].view(m, k)[r0:r1] = q.reshape(rows, k)
            out["_columnwise_scale_inv"][r0 // BLOCK: r1 // BLOCK, :k] = e_col

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        m, k = flatten_2d(tuple(shape))
        if "_rowwise_data" in buffers:
            q = nx.fp8_to_float(buffers["_rowwise_data"], self.fp8_dtype).reshape(m, k // BLOCK, BLOCK)
            s = nx.e8m0_dequant_scale(buffers["_rowwise_scale_inv"][:m, : k // BLOCK])
            return (q * s[..., None]).reshape(shape)
        q = nx.fp8_to_float(buffers["_columnwise_data"], self.fp8_dtype).reshape(m // BLOCK, BLOCK, k)
        s = nx.e8m0_dequant_scale(buffers["_columnwise_scale_inv"][: m // BLOCK, :k])
        return (q * s[:, None, :]).reshape(shape)
