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
from .protocol import (COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, flatten_2d, fp8_short_name, require_divisible,
                       require_fp8_dtype)
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .engine import blocks_amax
from .layout_rules import spread_scales
from .te_adapter import TE_FP8_CODE, TEAdapter, quantizer_from_te_fields, register_te_adapter, te_fp8_dtype

BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE (pytorch/constants.py)


class MXFP8TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """MXFP8 tensor (TE's ``MXFP8Tensor``) with compact scales."""


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8 1×32 blocks (or 32×32 tiles with ``with_2d_quantization``), E8M0 ceil-exponent scales.

    Exact paths: 32×32 → 1×32 (tile scales are block scales) and, in 32×32 mode, either usage
    from the other (both hold the same bytes; a tile's exponent spread over its blocks).
    Slices align to 32 in both dims (the format's shape rule).
    """

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

    # --- rules ------------------------------------------------------------------------------------
    def usage_layout(self, usage):
        tile = (BLOCK, BLOCK) if self.with_2d_quantization else None
        if usage == ROWWISE:
            return UsageLayout("_rowwise_data", "_rowwise_scale_inv", grid=(1, BLOCK), tile=tile)
        return UsageLayout("_columnwise_data", "_columnwise_scale_inv", grid=(BLOCK, 1), tile=tile)

    def layout_key(self):
        return (self.kind, self.fp8_dtype, self.with_2d_quantization)

    def layout_name(self):
        return f"mxfp8{'_2d' if self.with_2d_quantization else ''}_{fp8_short_name(self.fp8_dtype)}"

    def slice_alignment(self):
        return BLOCK, BLOCK

    def exact_output(self, target):
        if not isinstance(target, MXFP8Quantizer):
            return super().exact_output(target)  # MXFP4 where the values are representable
        if target.fp8_dtype != self.fp8_dtype:
            return None
        if target.with_2d_quantization and not self.with_2d_quantization:
            return None
        return dataclasses.replace(self, with_2d_quantization=target.with_2d_quantization,
                                   rowwise=target.rowwise, columnwise=target.columnwise)

    def derivable(self, out, usage):
        if not isinstance(out, MXFP8Quantizer):
            return super().derivable(out, usage)
        return self.has_usage(usage) or self.with_2d_quantization

    def derive(self, buffers, shape, out, usage):
        if not isinstance(out, MXFP8Quantizer):
            return super().derive(buffers, shape, out, usage)
        if self.has_usage(usage):
            return self.usage_buffers(buffers, usage)
        src = ROWWISE if usage == COLUMNWISE else COLUMNWISE
        grid = spread_scales(self.tile_scales(buffers, shape, src), (BLOCK, BLOCK), out.usage_layout(usage).grid,
                             out.grid_shape(shape, usage))
        return self.relayout(buffers, shape, out, usage, src, grid)

    def fusable(self) -> bool:
        return True

    def amax_block(self):
        return BLOCK

    def _quantize_rows(self, xc, given):
        rows, k = xc.shape
        tile = None  # 2-D: the 32×32 tiles' exponents, spread to each usage's blocks
        if self.with_2d_quantization:
            tile = nx.e8m0_from_amax(blocks_amax(xc, BLOCK, BLOCK, given), self.fp8_dtype)
        exps = {u: (tile.repeat_interleave(BLOCK, dim=0 if u == ROWWISE else 1) if tile is not None
                    else nx.e8m0_from_amax(blocks_amax(xc, *self.usage_layout(u).grid, given), self.fp8_dtype))
                for u in self.usages_on()}
        # the exponents once (a compiled graph would redo their integer ops in the padding's loop)
        exps = dict(zip(exps, nx.per_blocks(*exps.values())))
        scales = dict(zip(exps, nx.per_blocks(*(nx.e8m0_quant_scale(e) for e in exps.values()))))
        out = {}
        if self.rowwise and self.columnwise and tile is None:  # both usages from one read of x
            q, qc = nx.scale_and_cast_to_fp8_pair(xc, scales[ROWWISE], scales[COLUMNWISE], self.fp8_dtype, BLOCK)
            return {"_rowwise_data": q, "_rowwise_scale_inv": exps[ROWWISE],
                    "_columnwise_data": qc, "_columnwise_scale_inv": exps[COLUMNWISE]}
        if self.rowwise:
            q = nx.scale_and_cast_to_fp8(xc.reshape(rows, k // BLOCK, BLOCK), scales[ROWWISE][..., None],
                                         self.fp8_dtype)
            # flatten, not reshape(rows, k): a dynamic-shape graph cannot prove K == K // 32 * 32,
            # and would copy the data once more to get there
            out["_rowwise_data"], out["_rowwise_scale_inv"] = q.flatten(1), exps[ROWWISE]
        if self.columnwise:
            if tile is not None and self.rowwise:  # each element has its tile's scale in both: the same codes
                q = out["_rowwise_data"].clone()
            else:
                q = nx.scale_and_cast_to_fp8(xc.reshape(rows // BLOCK, BLOCK, k), scales[COLUMNWISE][:, None, :],
                                             self.fp8_dtype).flatten(0, 1)
            out["_columnwise_data"], out["_columnwise_scale_inv"] = q, exps[COLUMNWISE]
        return out

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        m, k = flatten_2d(tuple(shape))
        if "_rowwise_data" in buffers:
            q = buffers["_rowwise_data"].reshape(m, k // BLOCK, BLOCK)
            s = nx.e8m0_dequant_scale(self.block_scales(buffers, shape, ROWWISE))
            return nx.dequantize_fp8(q, nx.per_block(s)[..., None], self.fp8_dtype).reshape(shape)
        q = buffers["_columnwise_data"].reshape(m // BLOCK, BLOCK, k)
        s = nx.e8m0_dequant_scale(self.block_scales(buffers, shape, COLUMNWISE))
        return nx.dequantize_fp8(q, nx.per_block(s)[:, None, :], self.fp8_dtype).reshape(shape)


class _MXFP8TE(TEAdapter):
    te_module = "tensor.mxfp8_tensor"
    te_tensor = "MXFP8Tensor"
    te_storage = "MXFP8TensorStorage"
    te_quantizers = ("MXFP8Quantizer",)

    def read(self, t, tq, shape):
        q = MXFP8Quantizer(te_fp8_dtype(t._fp8_dtype), rowwise=t._rowwise_data is not None,
                           columnwise=t._columnwise_data is not None,
                           with_2d_quantization=bool(getattr(tq, "with_2d_quantization", False)))
        return q, {n: getattr(t, n) for n in MXFP8TensorStorage.BUFFERS}

    def quantizer_from_fields(self, te_class, fields):
        return quantizer_from_te_fields(MXFP8Quantizer, fields, te_class=te_class, swizzles=True,
                                        convert={"dtype": lambda v: {"fp8_dtype": te_fp8_dtype(v)}})

    def te_quantizer(self, q, te):
        return te.module(self.te_module).MXFP8Quantizer(
            te.DType(TE_FP8_CODE[q.fp8_dtype]), rowwise=q.rowwise, columnwise=q.columnwise,
            with_2d_quantization=q.with_2d_quantization)

    def te_kwargs(self, q, buffers, te):
        return dict(rowwise_data=buffers.get("_rowwise_data"), rowwise_scale_inv=buffers.get("_rowwise_scale_inv"),
                    columnwise_data=buffers.get("_columnwise_data"),
                    columnwise_scale_inv=buffers.get("_columnwise_scale_inv"),
                    fp8_dtype=te.DType(TE_FP8_CODE[q.fp8_dtype]), with_gemm_swizzled_scales=False)


register_te_adapter(_MXFP8TE(), MXFP8Quantizer)
