"""FP8 blockwise (DeepSeek-style): fp32 scales per 1×128 vector or 128×128 tile.

TE: pytorch/tensor/float8_blockwise_tensor.py, common/transpose/quantize_transpose_*_blockwise.cu.
Rowwise data has the logical shape; columnwise data is the transpose ``(S[-1], *S[:-1])``. In 1-D
mode the two directions are quantized separately (rowwise blocks along K, columnwise along M);
in 2-D mode the columnwise copy is the exact transpose. Partial edge blocks take the amax of the
elements that exist. Scales are stored as TE's ``get_scale_shape`` says, with padding zeroed.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import FormatError
from ..kernel_ops import transpose_bytes
from .protocol import COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, flatten_2d, fp8_short_name, require_fp8_dtype
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .engine import blocks_amax
from .layout_rules import spread_scales
from .te_adapter import TE_FP8_CODE, TEAdapter, quantizer_from_te_fields, register_te_adapter, te_fp8_dtype

BLOCK = 128


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class Float8BlockwiseQTensor(Float8BlockwiseQTensorStorage, QuantizedTensor):
    """Blockwise FP8 tensor (TE's ``Float8BlockwiseQTensor``)."""


def _scaled(x2: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bits of x * (scale of its block) for per-block scales [ceil(M/rows), ceil(K/cols)]."""
    m, k = x2.shape
    blocks, s = _blocks_and_scales(x2, scale, rows, cols)
    mb, _, kb, _ = blocks.shape
    return nx.scale_and_cast_to_fp8(blocks, s, fp8_dtype).reshape(mb * rows, kb * cols)[:m, :k]


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, rows: int, cols: int,
                 fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of FP8 codes [M, K] (uint8) times the scale of their block (per-block scales
    [ceil(M/rows), ceil(K/cols)])."""
    m, k = codes.shape
    blocks, s = _blocks_and_scales(codes, scale, rows, cols)
    mb, _, kb, _ = blocks.shape
    return nx.dequantize_fp8(blocks, s, fp8_dtype).reshape(mb * rows, kb * cols)[:m, :k]


def _scaled_transposed(x2: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, fp8_dtype: torch.dtype,
                       keep_rows: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`_scaled`'s FP8 codes (None without ``keep_rows``) and their transpose [K, M]: from one
    pass where the blocks tile x2 (every real weight), else the codes transposed after."""
    m, k = x2.shape
    blocks, s = _blocks_and_scales(x2, scale, rows, cols)
    if blocks.numel() == x2.numel():
        codes, transposed = nx.scale_and_cast_to_fp8_transposed(blocks, s, fp8_dtype, (m, k), keep_rows)
        return (None if codes is None else codes.reshape(m, k)), transposed
    codes = _scaled(x2, scale, rows, cols, fp8_dtype)
    return (codes if keep_rows else None), transpose_bytes(codes)


def _blocks_and_scales(x2: torch.Tensor, scale: torch.Tensor, rows: int,
                       cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 padded to whole blocks as [M/rows, rows, K/cols, cols], and the per-block scales
    [ceil(M/rows), ceil(K/cols)] as [M/rows, 1, K/cols, 1]."""
    mb, kb = scale.shape
    return nx.pad_to(x2, (mb * rows, kb * cols)).reshape(mb, rows, kb, cols), nx.per_block(scale)[:, None, :, None]


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
    """Blockwise FP8: ``block_scaling_dim`` 1 → 1×128 vectors, 2 → 128×128 tiles.

    Exact paths: 128×128 → either usage (the columnwise copy is the rowwise bytes transposed) and
    → 1×128 (a tile's scale in each of its 1×128 / 128×1 segments); 1×128 → its own usages.
    """

    kind: ClassVar[str] = "fp8_blockwise"
    storage_class: ClassVar[type] = Float8BlockwiseQTensorStorage
    tensor_class: ClassVar[type] = Float8BlockwiseQTensor
    _dtype_fields: ClassVar[tuple[str, ...]] = ("fp8_dtype",)
    block_len: ClassVar[int] = BLOCK

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    amax_epsilon: float = dataclasses.field(default=0.0, kw_only=True)
    force_pow_2_scales: bool = dataclasses.field(default=True, kw_only=True)
    block_scaling_dim: int = dataclasses.field(default=2, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fp8_dtype(self)
        if self.block_scaling_dim not in (1, 2):
            raise FormatError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, got {self.block_scaling_dim}")
        object.__setattr__(self, "amax_epsilon", float(self.amax_epsilon))

    def _buffer_specs(self, shape):
        m, k = flatten_2d(shape)
        mb, kb = nx.ceil_div(m, BLOCK), nx.ceil_div(k, BLOCK)
        if self.block_scaling_dim == 2:
            row_scale, col_scale = (mb, nx.round_up(kb, 4)), (kb, nx.round_up(mb, 4))
        else:
            row_scale, col_scale = (kb, nx.round_up(m, 4)), (mb, nx.round_up(k, 4))
        specs = {}
        if self.rowwise:
            specs["_rowwise_data"] = BufferSpec(shape, torch.uint8)
            specs["_rowwise_scale_inv"] = BufferSpec(row_scale, torch.float32)
        if self.columnwise:
            specs["_columnwise_data"] = BufferSpec((shape[-1], *shape[:-1]), torch.uint8)
            specs["_columnwise_scale_inv"] = BufferSpec(col_scale, torch.float32)
        return specs

    def value_dtypes(self) -> dict[str, torch.dtype]:
        return {"_rowwise_data": self.fp8_dtype, "_rowwise_scale_inv": torch.float32,
                "_columnwise_data": self.fp8_dtype, "_columnwise_scale_inv": torch.float32}

    # --- rules ------------------------------------------------------------------------------------
    def usage_layout(self, usage):
        two_d = self.block_scaling_dim == 2
        if usage == ROWWISE:  # 1-D scales stored transposed: [ceil(K/128), roundup(M, 4)]
            return UsageLayout("_rowwise_data", "_rowwise_scale_inv", grid=(BLOCK, BLOCK) if two_d else (1, BLOCK),
                               scale_transposed=not two_d)
        return UsageLayout("_columnwise_data", "_columnwise_scale_inv", grid=(BLOCK, BLOCK) if two_d else (BLOCK, 1),
                           transposed=True, scale_transposed=two_d)

    def layout_key(self):
        return (self.kind, self.fp8_dtype, self.block_scaling_dim)

    def layout_name(self):
        return f"fp8_block{'_1d' if self.block_scaling_dim == 1 else ''}_{fp8_short_name(self.fp8_dtype)}"

    def exact_output(self, target):
        if not isinstance(target, Float8BlockQuantizer) or target.fp8_dtype != self.fp8_dtype:
            return None
        if target.block_scaling_dim not in (self.block_scaling_dim, 1):
            return None
        return dataclasses.replace(self, block_scaling_dim=target.block_scaling_dim,
                                   rowwise=target.rowwise, columnwise=target.columnwise)

    def derivable(self, out, usage):
        if self.block_scaling_dim == 2:
            return True
        return self.has_usage(usage) and out.block_scaling_dim == 1

    def derive(self, buffers, shape, out, usage):
        if self.has_usage(usage) and out.block_scaling_dim == self.block_scaling_dim:
            return self.usage_buffers(buffers, usage)
        src = usage if self.has_usage(usage) else self.usages_on()[0]  # 128×128 here
        grid = out.usage_layout(usage).grid
        tiles = spread_scales(self.tile_scales(buffers, shape, src), (BLOCK, BLOCK), grid,
                              out.grid_shape(shape, usage))
        return self.relayout(buffers, shape, out, usage, src, tiles)

    def _scale(self, amax: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        return nx.scale_from_amax(amax, nx.fp8_max(self.fp8_dtype),
                                  force_pow_2_scales=self.force_pow_2_scales,
                                  epsilon=self.amax_epsilon,
                                  value_for_inf=torch.finfo(input_dtype).max)

    def fusable(self) -> bool:
        return True

    def amax_block(self):
        return BLOCK

    def _quantize_rows(self, xc, given):
        out = {}
        if self.block_scaling_dim == 2:  # one tile grid for both usages: the columnwise codes are the rowwise ones
            scale = self._scale(blocks_amax(xc, BLOCK, BLOCK, given), xc.dtype)
            scale_inv = nx.reciprocal(scale)
            if self.columnwise:
                codes, out["_columnwise_data"] = _scaled_transposed(xc, scale, BLOCK, BLOCK, self.fp8_dtype,
                                                                    keep_rows=self.rowwise)
                out["_columnwise_scale_inv"] = scale_inv
            else:
                codes = _scaled(xc, scale, BLOCK, BLOCK, self.fp8_dtype)
            if self.rowwise:
                out["_rowwise_data"], out["_rowwise_scale_inv"] = codes, scale_inv
            return out
        if self.rowwise:  # 1×128 along K: grid [R, ceil(K/128)]
            scale = self._scale(blocks_amax(xc, 1, BLOCK, given), xc.dtype)
            out["_rowwise_data"] = _scaled(xc, scale, 1, BLOCK, self.fp8_dtype)
            out["_rowwise_scale_inv"] = nx.reciprocal(scale)
        if self.columnwise:  # 128×1 along M, grid [ceil(R/128), K]: codes in row order, then transposed [K, R]
            scale = self._scale(blocks_amax(xc, BLOCK, 1, given), xc.dtype)
            out["_columnwise_data"] = _scaled_transposed(xc, scale, BLOCK, 1, self.fp8_dtype, keep_rows=False)[1]
            out["_columnwise_scale_inv"] = nx.reciprocal(scale)
        return out

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        rows = BLOCK if self.block_scaling_dim == 2 else 1
        if "_rowwise_data" in buffers:
            q = buffers["_rowwise_data"].view(torch.uint8).reshape(m, k)
            s = self.block_scales(buffers, shape, ROWWISE)
            return _dequantized(q, s, rows, BLOCK, self.fp8_dtype).reshape(shape)
        qt = buffers["_columnwise_data"].view(torch.uint8).reshape(k, m)
        s = self.block_scales(buffers, shape, COLUMNWISE).t()  # on the transposed data [K, M]
        return _dequantized(qt, s, rows, BLOCK, self.fp8_dtype).t().reshape(shape)


class _BlockwiseTE(TEAdapter):
    te_module = "tensor.float8_blockwise_tensor"
    te_tensor = "Float8BlockwiseQTensor"
    te_storage = "Float8BlockwiseQTensorStorage"
    te_quantizers = ("Float8BlockQuantizer",)

    def read(self, t, tq, shape):
        row, col = t._rowwise_data is not None, t._columnwise_data is not None
        q = Float8BlockQuantizer(te_fp8_dtype(t._fp8_dtype), rowwise=row, columnwise=col,
                                 block_scaling_dim=2 if t._is_2D_scaled else 1,
                                 force_pow_2_scales=bool(getattr(tq, "force_pow_2_scales", True)),
                                 amax_epsilon=float(getattr(tq, "amax_epsilon", 0.0)))
        return q, {n: getattr(t, n) for n in Float8BlockwiseQTensorStorage.BUFFERS}

    def quantizer_from_fields(self, te_class, fields):
        return quantizer_from_te_fields(Float8BlockQuantizer, fields, te_class=te_class,
                                        convert={"dtype": lambda v: {"fp8_dtype": te_fp8_dtype(v)}},
                                        te_defaults={"block_len": Float8BlockQuantizer.block_len})

    def te_quantizer(self, q, te):
        return te.module(self.te_module).Float8BlockQuantizer(
            te.DType(TE_FP8_CODE[q.fp8_dtype]), rowwise=q.rowwise, columnwise=q.columnwise,
            amax_epsilon=q.amax_epsilon, force_pow_2_scales=q.force_pow_2_scales,
            block_scaling_dim=q.block_scaling_dim)

    def te_kwargs(self, q, buffers, te):
        return dict(rowwise_data=buffers.get("_rowwise_data"), rowwise_scale_inv=buffers.get("_rowwise_scale_inv"),
                    columnwise_data=buffers.get("_columnwise_data"),
                    columnwise_scale_inv=buffers.get("_columnwise_scale_inv"),
                    fp8_dtype=te.DType(TE_FP8_CODE[q.fp8_dtype]), is_2D_scaled=q.block_scaling_dim == 2)


register_te_adapter(_BlockwiseTE(), Float8BlockQuantizer)
