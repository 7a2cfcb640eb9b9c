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
from ..kernel_ops import map_byte_pairs, transpose_bytes
from ..tracing import tracing
from .base import Quantizer
from .engine import BlockAmax, blocks_amax
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .protocol import COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, flatten_2d
from .tensors import QuantizedTensor, QuantizedTensorStorage

BLOCK = 32  # the OCP MX block (shared/docs/mxfp4.md §0)
#: E8M0's NaN byte: never a valid MXFP4 scale
E8M0_NAN = 0xFF
E4M3 = torch.float8_e4m3fn
#: the E4M3 byte of each E2M1 code (shared/docs/mxfp4.md §6): ``s<<7 | (e+6)<<3 | m<<2``, 0.5 → 0x30,
#: ±0 → 0x00 / 0x80; the same value, so a block keeps its E8M0 byte
E2M1_TO_E4M3 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C, 0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC)
#: a packed byte's two codes (low nibble first) as their two E4M3 bytes
E2M1_PAIRS_TO_E4M3 = tuple((E2M1_TO_E4M3[b & 0xF], E2M1_TO_E4M3[b >> 4]) for b in range(256))
#: NVFP4 keeping the codes: the largest spread of block exponents (E4M3 scales 2^−9 … 2^8), and the
#: largest E8M0 byte. shared/docs/mxfp4.md §6 says 251 (amax = 2688 · 2^g finite), but TE's dequantize
#: forms (scale · amax) first, 2688 · 2^e_b, which overflows fp32 past e_b = 116: byte 243
NVFP4_MAX_SPREAD, NVFP4_MAX_BYTE = 17, 243


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
    has_te_class: ClassVar[bool] = False
    #: format 1.5 added the kind: a 1.4 reader refuses it by name (an unknown quantizer kind)
    KIND_VERSION: ClassVar[tuple[int, int]] = (1, 5)

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

    # --- exact conversions (shared/docs/mxfp4.md §6) -----------------------------------------------
    takes_exact_values: ClassVar[bool] = True

    @staticmethod
    def _keeps_codes(target: Quantizer) -> bool:
        """MXFP8 E4M3 in 1×32 blocks, or NVFP4 in 1×16 blocks with one tensor amax and TE's divisor:
        formats that hold MXFP4's codes and scales as they are (some only for some bytes)."""
        if isinstance(target, MXFP8Quantizer):
            return target.fp8_dtype == E4M3 and not target.with_2d_quantization
        return (isinstance(target, NVFP4Quantizer) and not target.with_2d_quantization
                and not target.row_scaled_nvfp4 and target.nvfp4_e4m3_max == 448)

    def exact_output(self, target):
        if self._keeps_codes(target):
            return target
        return super().exact_output(target)

    def derivable(self, out, usage):
        if isinstance(out, NVFP4Quantizer):  # the rowwise codes verbatim; NVFP4's columnwise is 1×16 along M
            return usage == ROWWISE and self.rowwise
        return isinstance(out, (MXFP8Quantizer, MXFP4Quantizer))  # other blocks: where the values allow

    def derive(self, buffers, shape, out, usage):
        if isinstance(out, MXFP4Quantizer):
            if self.has_usage(usage):
                return self.usage_buffers(buffers, usage)
            return out.exact_from_values(self.usage_values(buffers, shape, usage), usage)
        if isinstance(out, NVFP4Quantizer):
            return self._into_nvfp4(buffers, shape, out)
        if self.has_usage(usage):  # MXFP8 blocks of the same 32 elements: each code's E4M3 byte, the same scale
            src, lay = self.usage_layout(usage), out.usage_layout(usage)
            m, k = flatten_2d(tuple(shape))
            rows, cols = (k, m) if src.transposed else (m, k)
            data = buffers[src.data].reshape(rows, cols // 2)   # each byte two codes, as stored
            e4m3 = map_byte_pairs(data, torch.tensor(E2M1_PAIRS_TO_E4M3, dtype=torch.uint8, device=data.device))
            return {lay.data: out.data_buffer(e4m3.t() if src.transposed else e4m3, shape, usage),
                    lay.scale: out.scale_buffer(self.block_scales(buffers, shape, usage), shape, usage)}
        return self._reblocked_mxfp8(buffers, shape, out, usage)

    def derives_by_table(self, out, usage):
        # MXFP8 E4M3 from the same usage: each code's E4M3 byte of the same value (E2M1_TO_E4M3) under the
        # same E8M0 byte, so every element keeps its value whatever the bytes
        return self.has_usage(usage) and isinstance(out, MXFP8Quantizer) and self._keeps_codes(out)

    def _element_exponents(self, buffers: Mapping[str, torch.Tensor], shape, usage: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [M, K], each element's block exponent b − 127 as int32 [M, K]) of ``usage``."""
        codes = self.codes(buffers, shape, usage)
        e = self.block_scales(buffers, shape, usage).to(torch.int32) - 127
        e = e.repeat_interleave(BLOCK, dim=1 if usage == ROWWISE else 0)
        return codes, e

    def _reblocked_mxfp8(self, buffers, shape, out: MXFP8Quantizer, usage: str) -> dict[str, torch.Tensor] | None:
        """MXFP8 ``usage`` from this tensor's other usage: each MXFP8 block of 32 crosses 32 MXFP4
        blocks; its exponent is the largest of theirs (over codes of nonzero magnitude) less 6
        (6 · 2^6 ≤ 448), at least −127, and the block is exact when every code fits E4M3 there
        (a spread of at most 14). None where one does not: the tensor is requantized."""
        src = ROWWISE if usage == COLUMNWISE else COLUMNWISE
        codes, e = self._element_exponents(buffers, shape, src)
        m, k = codes.shape
        live = torch.where((codes & 0x7) != 0, e, torch.full_like(e, -127))
        blocks = live.reshape(m, k // BLOCK, BLOCK).amax(2) if usage == ROWWISE else \
            live.reshape(m // BLOCK, BLOCK, k).amax(1)
        col = torch.clamp(blocks - 6, min=-127)  # the MXFP8 block exponents, on its grid
        spread = col.repeat_interleave(BLOCK, dim=1 if usage == ROWWISE else 0)
        values = self.decode(codes, self.block_scales(buffers, shape, src)) if src == ROWWISE else \
            self.decode(codes.t().contiguous(), self.block_scales(buffers, shape, src).t()).t()
        byte = (spread + 127).to(torch.uint8)
        q8 = nx.scale_and_cast_to_fp8(values * nx.e8m0_quant_scale(byte), None, E4M3)
        if not torch.equal((nx.fp8_to_float(q8, E4M3) * nx.e8m0_dequant_scale(byte)).view(torch.int32),
                           values.view(torch.int32)):
            return None
        lay = out.usage_layout(usage)
        return {lay.data: out.data_buffer(q8, shape, usage),
                lay.scale: out.scale_buffer((col + 127).to(torch.uint8), shape, usage)}

    def _into_nvfp4(self, buffers, shape, out: NVFP4Quantizer) -> dict[str, torch.Tensor] | None:
        """NVFP4's rowwise usage keeping the codes: each 32-block two 16-blocks of E4M3 scale
        2^(e_b − g), tensor amax 2688 · 2^g (g = max e_b − 8), over the blocks holding a code of
        nonzero magnitude; exact iff their exponents spread by ≤ 17 and none has byte > 243 (None
        otherwise; the values are checked too). Blocks of zeros get scale 0."""
        m, k = flatten_2d(tuple(shape))
        data = buffers["_rowwise_data"].reshape(m, k // 2)
        b = self.block_scales(buffers, shape, ROWWISE).to(torch.int32)  # [M, K/32]
        live = ((nx.unpack_fp4(data) & 0x7) != 0).reshape(m, k // BLOCK, BLOCK).any(2)
        if bool(live.any()):
            lo, hi = int(b[live].min()), int(b[live].max())
            if hi - lo > NVFP4_MAX_SPREAD or hi > NVFP4_MAX_BYTE:
                return None
        else:
            lo = hi = 127
        g = hi - 127 - 8
        d = torch.clamp(b - 127 - g, min=-9)  # the block scale 2^d: E4M3 normal (d + 7) << 3, or 2^-7 .. 2^-9
        sub = torch.tensor([0x01, 0x02, 0x04], dtype=torch.int32, device=b.device)
        s = torch.where(d >= -6, (d + 7) << 3, sub[torch.clamp(d + 9, 0, 2)])
        s = torch.where(live, s, torch.zeros_like(s)).to(torch.uint8).repeat_interleave(2, dim=1)
        amax = torch.tensor([nx.FP4_MAX * 448 * 2.0 ** g], dtype=torch.float32, device=b.device)
        lay = out.usage_layout(ROWWISE)
        got = {lay.data: data.reshape(out.describe_buffers(shape)[lay.data].shape).clone(),
               lay.scale: out.scale_buffer(s, shape, ROWWISE), lay.amax: amax}
        want = self.usage_values(buffers, shape, ROWWISE)
        have = out.set_usage(rowwise=True, columnwise=False).dequantize_buffers(got, shape, torch.float32)
        return got if torch.equal(have.view(torch.int32), want.view(torch.int32)) else None

    def exact_from_values(self, values, usage):
        """MXFP4 holds ``values`` where each 32-block of ``usage`` is E2M1 codes times one 2^e
        (−127 ≤ e ≤ 127): quantizing them then finds that e (the least with max|x| ≤ 6 · 2^e, and
        E2M1 is closed under doubling up to 6) and casts without rounding; −0.0 keeps its sign."""
        if bool(nx.isnan(values).any()):
            return None
        shape = tuple(values.shape)
        q = self.set_usage(rowwise=usage == ROWWISE, columnwise=usage != ROWWISE)
        bufs = q.quantize(values, internal=True).buffers()
        lay = q.usage_layout(usage)
        neg_zero = (values == 0) & (values.view(torch.int32) < 0)
        if bool(neg_zero.any()):
            m, k = flatten_2d(shape)
            codes = q.codes(bufs, shape, usage) | (neg_zero.reshape(m, k).to(torch.uint8) << 3)
            bufs[lay.data] = q.data_buffer(codes, shape, usage)
        back = q.dequantize_buffers(bufs, shape, torch.float32)
        return bufs if torch.equal(back.view(torch.int32), values.view(torch.int32)) else None

    # --- numerics ---------------------------------------------------------------------------------
    def fusable(self) -> bool:
        return True

    def amax_block(self):
        return BLOCK

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
