"""MXFP4: E2M1 data (two per byte, element 2j in the low nibble), one E8M0 scale per 32 elements.

The OCP MX FP4 format (gpt-oss experts, compressed-tensors ``mxfp4-pack-quantized``, ModelOpt,
DeepSeek-V4 experts; shared/docs/mxfp4.md). TE 2.20 has no MXFP4 tensor class or kernel: its only
MXFP4 is the pure-PyTorch ``NVFP4QuantizerRef(pow_2_scales=True, quant_tile_shape=(1, 32))``
(transformer_engine/pytorch/custom_recipes/reference_nvfp4.py), whose numerics this quantizer
follows, so there is no TE adapter (``to_te`` and TE's ``TensorSpec`` refuse it by name).

Buffers (M = prod(S[:-1]), K = S[-1]): rowwise ``_rowwise_data`` uint8 ``(*S[:-1], K/2)`` with
``_rowwise_scale_inv`` uint8 ``[round_up(M, 128), round_up(K/32, 4)]``, one byte per 32 elements
along K; columnwise (training) the transposed input quantized along M as NVFP4 lays it out,
``_columnwise_data`` uint8 ``(K, M/2)`` with ``_columnwise_scale_inv`` ``[round_up(K, 128),
round_up(M/32, 4)]``. Scales are compact, their padding zero; byte b means 2^(b − 127); byte 255
(E8M0 NaN) is never valid and is refused on read and dequantize.

Quantize, per block of 32 (reference_nvfp4.py ``_quantize_blockwise_reference`` with
``pow_2_scales``; its rowwise path cannot run in TE 2.20, ``row_input`` being unbound there):

* ``vec_max = fp32(max |x|)`` over the block; ``decode = 2^clamp(ceil(log2(fl32(vec_max / 6))),
  -127, 127)`` (``cast_to_e8``), stored as the biased byte; ``encode = fl32(1 / decode)`` = 2^−k
  exactly. The ceiling is taken exactly from fp32 bits (:func:`numerics.e8m0_from_fp4_amax`):
  the reference's ``torch.log2`` in fp32 rounds k + ε to k for vec_max / 6 a few ulps above 2^k
  (|k| ≥ 4), picking the exponent one lower and saturating the block maximum to ±6; te-serial
  keeps the exact rule (the same on every device and compiled), which the two agree on elsewhere.
  vec_max 0 → byte 0 (2^−127), the block all +0; ±inf → byte 254.
* codes: ``cast_to_fp4x2(clamp(fl32(x · encode), −6, 6))``: round half to even between the E2M1
  magnitudes (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4), saturated at 6;
  a scaled −0.0 becomes +0 (code 0: ``x >= 0.0`` holds for −0.0), a negative value that rounds
  to zero −0 (code 8).
* NaN inputs are refused (:class:`~te_serial.errors.QuantizationError`): the reference makes the
  block's scale NaN (byte 255), which no MXFP4 reader decodes.

Dequantize: ``LUT[code] · 2^(b − 127)`` in fp32 (exact: 2^−127 is an fp32 subnormal and every
product a representable value, or ±inf past FLT_MAX with byte 254).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import QuantizationError, ShapeError
from ..kernel_ops import transpose_bytes
from ..tracing import tracing
from .base import Quantizer
from .engine import BlockAmax, blocks_amax
from .protocol import COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, flatten_2d
from .tensors import QuantizedTensor, QuantizedTensorStorage

BLOCK = 32  # the OCP MX block (shared/docs/mxfp4.md §0)
#: E8M0's NaN byte: never a valid MXFP4 scale
E8M0_NAN = 0xFF


class MXFP4TensorStorage(QuantizedTensorStorage):
    BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class MXFP4Tensor(MXFP4TensorStorage, QuantizedTensor):
    """MXFP4 tensor (no TE class exists) with compact scales."""


@dataclasses.dataclass(frozen=True)
class MXFP4Quantizer(Quantizer):
    """MXFP4 1×32 blocks, E2M1 codes, E8M0 ceil-exponent scales; rowwise by default (a checkpoint's
    inference weights), columnwise (transposed, blocks along M) for training.

    Slices align to 32 in both dims (K's blocks; the columnwise copy's blocks along M).
    """

    kind: ClassVar[str] = "mxfp4"
    storage_class: ClassVar[type] = MXFP4TensorStorage
    tensor_class: ClassVar[type] = MXFP4Tensor

    columnwise: bool = dataclasses.field(default=False, kw_only=True)

    def check_shape(self, shape):
        super().check_shape(shape)
        m, k = flatten_2d(shape)
        if k % BLOCK or (self.columnwise and m % BLOCK):
            rule = "K % 32 == 0 and, with columnwise, M % 32 == 0" if self.columnwise else "K % 32 == 0"
            raise ShapeError(f"MXFP4 needs {rule} (M = prod(shape[:-1]), K = shape[-1]); got shape "
                             f"{tuple(shape)} with M={m}, K={k}")

    def _buffer_specs(self, shape):
        m, k = flatten_2d(shape)
        specs = {}
        if self.rowwise:
            specs["_rowwise_data"] = BufferSpec((*shape[:-1], k // 2), torch.uint8)
            specs["_rowwise_scale_inv"] = BufferSpec((nx.round_up(m, 128), nx.round_up(k // BLOCK, 4)), torch.uint8)
        if self.columnwise:
            specs["_columnwise_data"] = BufferSpec((k, m // 2), torch.uint8)
            specs["_columnwise_scale_inv"] = BufferSpec((nx.round_up(k, 128), nx.round_up(m // BLOCK, 4)),
                                                        torch.uint8)
        return specs

    def value_dtypes(self) -> dict[str, torch.dtype]:
        # FP4 data stays packed bytes (U8); block scales are E8M0 bits
        return {"_rowwise_data": torch.uint8, "_rowwise_scale_inv": torch.float8_e8m0fnu,
                "_columnwise_data": torch.uint8, "_columnwise_scale_inv": torch.float8_e8m0fnu}

    # --- rules ------------------------------------------------------------------------------------
    def usage_layout(self, usage):
        if usage == ROWWISE:
            return UsageLayout("_rowwise_data", "_rowwise_scale_inv", grid=(1, BLOCK), pack=2)
        return UsageLayout("_columnwise_data", "_columnwise_scale_inv", grid=(BLOCK, 1), transposed=True,
                           scale_transposed=True, pack=2)

    def slice_alignment(self):
        return BLOCK, BLOCK

    def refused_value(self, buffers: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
        for u in self.usages_on():
            name = self.usage_layout(u).scale
            s = buffers.get(name)
            if s is not None and s.numel() and bool((s.view(torch.uint8) == E8M0_NAN).any()):
                return name, "MXFP4 scale byte 0xFF (E8M0 NaN) is never a valid block scale"
        return None

    # --- numerics ---------------------------------------------------------------------------------
    def fusable(self) -> bool:
        return True

    def amax_block(self):
        return BLOCK

    def _prepare(self, x2, args):
        return self._given_amax(args), {}

    def _encode(self, xc: torch.Tensor, along: int, given: BlockAmax | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of 32 along dim ``along`` of xc [R, C]: (codes packed along the blocks, as the usage
        keeps them: [R, C/2], or columnwise [C, R/2]; the E8M0 bytes on the grid [R, C/32] or
        [R/32, C])."""
        r, c = xc.shape
        grid = (1, BLOCK) if along == 1 else (BLOCK, 1)
        e = nx.per_block(nx.e8m0_from_fp4_amax(blocks_amax(xc, *grid, given)))
        enc = nx.per_block(nx.e8m0_quant_scale(e))  # 2^(127 − b) = fl32(1 / 2^(b − 127)), exact
        if along == 1:
            scaled = xc.reshape(r, c // BLOCK, BLOCK).float() * enc[..., None]
        else:
            scaled = xc.reshape(r // BLOCK, BLOCK, c).float() * enc[:, None, :]
        # the reference's scaled −0.0 is +0 (code 0), where the E2M1 cast keeps the sign bit
        scaled = torch.where(scaled == 0, torch.zeros((), dtype=torch.float32, device=xc.device), scaled)
        packed = nx.scale_and_cast_to_fp4(scaled, None, dim=-1 if along == 1 else -2)
        if along == 1:
            return packed.reshape(r, c // 2), e
        return transpose_bytes(packed.reshape(r // 2, c)), e

    def _quantize_rows(self, xc, given):
        if given is None and not tracing() and bool(nx.isnan(xc).any()):
            raise QuantizationError("MXFP4 cannot encode NaN: TE's reference gives its block the E8M0 NaN "
                                    "scale (byte 0xFF), which no MXFP4 reader decodes")
        out = {}
        if self.rowwise:
            out["_rowwise_data"], out["_rowwise_scale_inv"] = self._encode(xc, 1, given)
        if self.columnwise:
            out["_columnwise_data"], out["_columnwise_scale_inv"] = self._encode(xc, 0, given)
        return out

    @staticmethod
    def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 values of E2M1 ``codes`` [R, C] (one per byte) with E8M0 bytes ``scales`` [R, C/32]:
        ``LUT[code] · 2^(b − 127)``, exact."""
        r, c = codes.shape
        q = nx.fp4_codes_to_float(codes).reshape(r, c // BLOCK, BLOCK)
        return (q * nx.e8m0_dequant_scale(scales)[..., None]).reshape(r, c)

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        if "_rowwise_data" in buffers:
            codes = nx.unpack_fp4(buffers["_rowwise_data"].reshape(m, k // 2))
            return self.decode(codes, self.block_scales(buffers, shape, ROWWISE).view(torch.uint8)).reshape(shape)
        codes = nx.unpack_fp4(buffers["_columnwise_data"].reshape(k, m // 2))  # [K, M], blocks along M
        s = self.block_scales(buffers, shape, COLUMNWISE).view(torch.uint8).t()  # [K, M/32]
        return self.decode(codes, s).t().reshape(shape)
