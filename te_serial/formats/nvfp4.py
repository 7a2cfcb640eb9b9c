"""NVFP4: E2M1 data (two per byte), one E4M3 scale per 16 elements, and an fp32 tensor amax.

TE: pytorch/tensor/nvfp4_tensor.py, common/cast/nvfp4/{core_nvfp4,quantize_transpose_nvfp4,
dequantize_nvfp4}.cuh. Rowwise data is ``(*S[:-1], K/2)``; columnwise data is the transposed input
quantized along M, shaped ``(S[-1], *S[:-1])`` with the last dim halved (TE's
``get_columnwise_shape``). With ``with_2d_quantization`` one amax per 16×16 tile sets the scales
of all 16 rows of the tile (TE's weight recipe). The random Hadamard transform (``with_rht``)
applies to the columnwise copy only.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import FormatError, QuantizationError, ShapeError
from .base import (COLUMNWISE, ROWWISE, BufferSpec, QuantizedTensor, QuantizedTensorStorage, Quantizer,
                   UsageLayout, flatten_2d, require_divisible, spread_scales)
from .te_adapter import TEAdapter, register_te_adapter

BLOCK = 16        # NVFP4_BLOCK_SCALING_SIZE (pytorch/constants.py)
E4M3_MAX = 448.0
#: Sign vector of TE's random Hadamard transform (``get_wgrad_sign_vector``).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


class NVFP4TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
               "_amax_rowwise", "_amax_columnwise")


class NVFP4Tensor(NVFP4TensorStorage, QuantizedTensor):
    """NVFP4 tensor (TE's ``NVFP4Tensor``) with compact scales."""


def rht_matrix(with_random_sign_mask: bool = True, device=None) -> torch.Tensor:
    """16×16 fp32 ``diag(signs) @ H16 / 4`` (Sylvester Hadamard), as TE's reference builds it."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    if with_random_sign_mask:
        h = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)[:, None] * h
    return h * 0.25


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448·6 / amax (fp32), capped at FLT_MAX; 1 when amax is 0 or S_enc underflows to 0.

    TE: ``compute_global_encode_scaling_factor_FP4`` (core_nvfp4.cuh).
    """
    s = torch.tensor(E4M3_MAX * nx.FP4_MAX, dtype=torch.float32, device=amax.device) / amax
    s = torch.clamp(s, max=nx.FP32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 1×16 blocks (16×16 tiles with ``with_2d_quantization``), two-level scaling.

    Exact paths: 16×16 → 1×16 (tile scales are block scales) and, in 16×16 mode without the RHT,
    either usage from the other (a nibble transpose, tile scales spread, same amax). Slices
    align to 16 in both dims (the format's shape rule) and keep the parent's tensor amax.
    """

    kind: ClassVar[str] = "nvfp4"
    storage_class: ClassVar[type] = NVFP4TensorStorage
    tensor_class: ClassVar[type] = NVFP4Tensor

    with_rht: bool = dataclasses.field(default=False, kw_only=True)
    with_post_rht_amax: bool = dataclasses.field(default=False, kw_only=True)
    with_random_sign_mask: bool = dataclasses.field(default=True, kw_only=True)
    with_2d_quantization: bool = dataclasses.field(default=False, kw_only=True)
    stochastic_rounding: bool = dataclasses.field(default=False, kw_only=True)

    def check_shape(self, shape):
        super().check_shape(shape)
        require_divisible(shape, BLOCK, "NVFP4")
        if self.columnwise and len(shape) > 2 and shape[-2] % 2:
            raise ShapeError(f"NVFP4 columnwise data packs shape[-2] two per byte; "
                             f"got shape {tuple(shape)} with odd shape[-2]")

    def _buffer_specs(self, shape):
        m, k = flatten_2d(shape)
        specs = {}
        if self.rowwise:
            specs["_rowwise_data"] = BufferSpec((*shape[:-1], k // 2), torch.uint8)
            specs["_rowwise_scale_inv"] = BufferSpec(
                (nx.round_up(m, 128), nx.round_up(nx.ceil_div(k, BLOCK), 4)), torch.uint8)
        if self.columnwise:
            col = (shape[-1], *shape[:-1])
            specs["_columnwise_data"] = BufferSpec((*col[:-1], col[-1] // 2), torch.uint8)
            specs["_columnwise_scale_inv"] = BufferSpec(
                (nx.round_up(k, 128), nx.round_up(nx.ceil_div(m, BLOCK), 4)), torch.uint8)
        if self.rowwise:
            specs["_amax_rowwise"] = BufferSpec((1,), torch.float32)
        if self.columnwise:
            specs["_amax_columnwise"] = BufferSpec((1,), torch.float32)
        return specs

    def value_dtypes(self) -> dict[str, torch.dtype]:
        # FP4 data stays packed bytes (U8); block scales are E4M3 bits.
        return {"_rowwise_data": torch.uint8, "_rowwise_scale_inv": torch.float8_e4m3fn,
                "_columnwise_data": torch.uint8, "_columnwise_scale_inv": torch.float8_e4m3fn,
                "_amax_rowwise": torch.float32, "_amax_columnwise": torch.float32}

    # --- rules ------------------------------------------------------------------------------------
    def usage_layout(self, usage):
        tile = (BLOCK, BLOCK) if self.with_2d_quantization else None
        if usage == ROWWISE:
            return UsageLayout("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise", grid=(1, BLOCK),
                               tile=tile, pack=2)
        return UsageLayout("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise", grid=(BLOCK, 1),
                           tile=tile, transposed=True, scale_transposed=True, pack=2)

    def layout_key(self):
        return (self.kind, self.with_2d_quantization, self.with_rht,
                self.with_rht and self.with_random_sign_mask)  # the sign mask matters only with the RHT

    def layout_name(self):
        return f"nvfp4{'_2d' if self.with_2d_quantization else ''}{'_rht' if self.with_rht else ''}"

    def slice_alignment(self):
        return BLOCK, BLOCK

    def input_dtype(self, dtype):
        return torch.bfloat16 if self.with_rht and self.columnwise else dtype  # TE's RHT cast takes BF16

    def deterministic(self):
        return dataclasses.replace(self, stochastic_rounding=False)

    def global_scale_divisor(self):
        return nx.FP4_MAX * E4M3_MAX  # x' = q · s_b · amax / (6 · 448)

    def _same_columnwise(self, other: "NVFP4Quantizer") -> bool:
        return self.with_rht == other.with_rht and (not self.with_rht
                                                   or self.with_random_sign_mask == other.with_random_sign_mask)

    def exact_output(self, target):
        if not isinstance(target, NVFP4Quantizer):
            return None
        if target.with_2d_quantization and not self.with_2d_quantization:
            return None
        out = dataclasses.replace(self, with_2d_quantization=target.with_2d_quantization,
                                  rowwise=target.rowwise, columnwise=target.columnwise)
        if target.columnwise and not (self.columnwise and self._same_columnwise(target)):
            out = dataclasses.replace(out, with_rht=target.with_rht, with_post_rht_amax=target.with_post_rht_amax,
                                      with_random_sign_mask=target.with_random_sign_mask)
        return out

    def derivable(self, out, usage):
        if usage == ROWWISE:
            return self.rowwise or (self.with_2d_quantization and not self.with_rht)
        if self.columnwise and self._same_columnwise(out):
            return True
        return self.rowwise and self.with_2d_quantization and not out.with_rht

    def derive(self, buffers, shape, out, usage):
        if self.has_usage(usage) and (usage == ROWWISE or self._same_columnwise(out)):
            return self.usage_buffers(buffers, usage)
        src = ROWWISE if usage == COLUMNWISE else COLUMNWISE  # 16×16 tiles without the RHT
        grid = spread_scales(self.tile_scales(buffers, shape, src), (BLOCK, BLOCK), out.usage_layout(usage).grid,
                             out.grid_shape(shape, usage))
        return self.relayout(buffers, shape, out, usage, src, grid)

    def _encode(self, x2: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize rows of x2 [R, C] in blocks of 16 along C: (packed data [R, C/2], scales [R, C/16])."""
        r, c = x2.shape
        blocks = x2.reshape(r, c // BLOCK, BLOCK)
        if self.with_2d_quantization:
            tile = nx.nan_ignoring_amax(x2.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK), dim=(1, 3))
            block_amax = tile.repeat_interleave(BLOCK, dim=0)
        else:
            block_amax = nx.nan_ignoring_amax(blocks, dim=2)
        s_enc = global_encode_scale(amax)
        s_dec = nx.reciprocal(s_enc)
        inv6 = torch.tensor(1.0 / nx.FP4_MAX, dtype=torch.float32, device=x2.device)
        # compute_decoding_scaling_factor: e4m3(block_amax * (S_enc * (1/6)))
        s_b = nx.scale_and_cast_to_fp8(torch.clamp(block_amax * (s_enc * inv6), max=nx.FP32_MAX),
                                       None, torch.float8_e4m3fn)
        s_b_f = nx.fp8_to_float(s_b, torch.float8_e4m3fn)
        enc = torch.clamp(torch.ones_like(s_b_f) / (s_b_f * s_dec), max=nx.FP32_MAX)
        codes = nx.cast_to_fp4_codes(blocks.float() * enc[..., None]).reshape(r, c)
        return nx.pack_fp4(codes), s_b

    def _rht(self, xt: torch.Tensor) -> torch.Tensor:
        """Columnwise RHT: bf16 inputs times ±1/4 (exact), summed in fp32, result rounded to bf16.

        TE: common/hadamard_transform/hadamard_transform_utils.cuh (MMA with fp32 accumulation,
        bf16 output). The sum is formed in float64 (exact here) and rounded once to fp32.
        """
        h = rht_matrix(self.with_random_sign_mask, xt.device).double()
        out = (xt.reshape(-1, BLOCK).double() @ h).float().to(torch.bfloat16)
        return out.reshape(xt.shape)

    def _quantize(self, x):
        if self.with_rht and self.columnwise and (x.dtype != torch.bfloat16 or not self.with_post_rht_amax):
            raise QuantizationError(
                "NVFP4 with_rht needs bfloat16 input and with_post_rht_amax=True, as in TE "
                f"(got input {x.dtype}, with_post_rht_amax={self.with_post_rht_amax})")
        if self.stochastic_rounding:
            raise QuantizationError(
                "NVFP4Quantizer(stochastic_rounding=True) is not reproducible (TE draws Philox "
                "random bits in-kernel); quantize with stochastic_rounding=False")
        return super()._quantize(x)

    def _prepare(self, x2, out):
        amax = nx.nan_ignoring_amax(x2)
        amax_col = amax
        if self.columnwise and self.with_rht:  # post-RHT amax: a pass of its own over the chunks
            step = max(BLOCK, self.CHUNK_BYTES // (4 * x2.shape[1]) // BLOCK * BLOCK)
            parts = [nx.nan_ignoring_amax(self._rht(x2[r:r + step].t().contiguous()))
                     for r in range(0, x2.shape[0], step)]
            amax_col = torch.stack(parts).amax() if parts else amax
        if self.rowwise:
            out["_amax_rowwise"].copy_(amax.reshape(1))
        if self.columnwise:
            out["_amax_columnwise"].copy_(amax_col.reshape(1))
        return amax, amax_col

    def _quantize_rows(self, xc, r0, state, out, m):
        amax, amax_col = state
        rows, k = xc.shape
        r1 = r0 + rows
        if self.rowwise:
            data, s_b = self._encode(xc, amax)
            out["_rowwise_data"].view(m, k // 2)[r0:r1] = data
            out["_rowwise_scale_inv"][r0:r1, : k // BLOCK] = s_b
        if self.columnwise:
            xt = xc.t().contiguous()
            if self.with_rht:
                xt = self._rht(xt)
            data, s_b = self._encode(xt, amax_col)
            out["_columnwise_data"].view(k, m // 2)[:, r0 // 2: r1 // 2] = data
            out["_columnwise_scale_inv"][:k, r0 // BLOCK: r1 // BLOCK] = s_b

    @staticmethod
    def _decode(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, r: int, c: int) -> torch.Tensor:
        """dequantize_nvfp4.cuh: q * (float(e4m3 scale) * amax * (1 / (6 * 448))); ``scale`` is the
        [r, c / 16] block scale grid."""
        codes = nx.unpack_fp4(data.reshape(r, c // 2))
        q = nx.fp4_codes_to_float(codes).reshape(r, c // BLOCK, BLOCK)
        s = nx.fp8_to_float(scale.contiguous(), torch.float8_e4m3fn)
        factor = torch.tensor(1.0 / (nx.FP4_MAX * E4M3_MAX), dtype=torch.float32, device=data.device)
        final = s * amax.float().reshape(()) * factor
        return (q * final[..., None]).reshape(r, c)

    def _inverse_rht(self, values: torch.Tensor) -> torch.Tensor:
        """Undo the RHT on decoded columnwise values [K, M] (groups of 16 along M).

        R = diag(signs) H16 / 4 is orthogonal, so the inverse is Rᵀ: each output is the 16-term
        dot product ``sum_i v[16g + i] * R[j, i]``, formed exactly (float64: the 16 values share
        one block scale, so the sum needs far fewer than 53 bits) and rounded once to fp32.
        """
        h = rht_matrix(self.with_random_sign_mask, values.device).double()
        return (values.reshape(-1, BLOCK).double() @ h.t()).float().reshape(values.shape)

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        if "_rowwise_data" in buffers:
            return self._decode(buffers["_rowwise_data"], self.block_scales(buffers, shape, ROWWISE),
                                buffers["_amax_rowwise"], m, k).reshape(shape)
        values = self._decode(buffers["_columnwise_data"], self.block_scales(buffers, shape, COLUMNWISE).t(),
                              buffers["_amax_columnwise"], k, m)
        if self.with_rht:
            values = self._inverse_rht(values)
        return values.t().reshape(shape)


class _NVFP4TE(TEAdapter):
    te_module = "tensor.nvfp4_tensor"
    te_tensor = "NVFP4Tensor"
    te_storage = "NVFP4TensorStorage"

    def read(self, t, tq, shape):
        if getattr(t, "_row_scaled_nvfp4", False) or getattr(t, "_nvfp4_use_4over6", False):
            raise FormatError("row-scaled and 4over6 NVFP4 tensors are not supported by te-serial yet")
        q = NVFP4Quantizer(rowwise=t._rowwise_data is not None, columnwise=t._columnwise_data is not None,
                           with_rht=bool(getattr(tq, "with_rht", False)),
                           with_post_rht_amax=bool(getattr(tq, "with_post_rht_amax", False)),
                           with_2d_quantization=bool(getattr(tq, "with_2d_quantization", False)),
                           stochastic_rounding=bool(getattr(tq, "stochastic_rounding", False)),
                           with_random_sign_mask=bool(getattr(tq, "rht_matrix_random_sign_mask_t", 1)))
        return q, {n: getattr(t, n) for n in NVFP4TensorStorage.BUFFERS}

    def te_quantizer(self, q, te):
        return te.module(self.te_module).NVFP4Quantizer(
            rowwise=q.rowwise, columnwise=q.columnwise, with_rht=q.with_rht,
            with_post_rht_amax=q.with_post_rht_amax, with_2d_quantization=q.with_2d_quantization,
            stochastic_rounding=q.stochastic_rounding, with_random_sign_mask=q.with_random_sign_mask)

    def te_kwargs(self, q, buffers, te):
        return dict(rowwise_data=buffers.get("_rowwise_data"), rowwise_scale_inv=buffers.get("_rowwise_scale_inv"),
                    columnwise_data=buffers.get("_columnwise_data"),
                    columnwise_scale_inv=buffers.get("_columnwise_scale_inv"),
                    amax_rowwise=buffers.get("_amax_rowwise"), amax_columnwise=buffers.get("_amax_columnwise"),
                    fp4_dtype=te.DType.kFloat4E2M1, with_gemm_swizzled_scales=False)


register_te_adapter(_NVFP4TE(), NVFP4Quantizer)
