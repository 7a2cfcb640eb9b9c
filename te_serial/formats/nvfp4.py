"""NVFP4: E2M1 data (two per byte), one E4M3 scale per 16 elements, and an fp32 tensor amax.

TE: pytorch/tensor/nvfp4_tensor.py, common/cast/nvfp4/{core_nvfp4,quantize_transpose_nvfp4,
dequantize_nvfp4}.cuh. Rowwise data is ``(*S[:-1], K/2)``; columnwise data is the transposed input
quantized along M, shaped ``(S[-1], *S[:-1])`` with the last dim halved (TE's
``get_columnwise_shape``). With ``with_2d_quantization`` one amax per 16×16 tile sets the scales
of all 16 rows of the tile (TE's weight recipe). The random Hadamard transform (``with_rht``)
applies to the columnwise copy only.

Two TE 2.20 variants (common/cast/dispatch/quantize.cuh routes them):

* ``row_scaled_nvfp4``: ``_amax_rowwise`` holds one fp32 amax per row ``[M]``, each row's global
  scale its own (quantize_transpose_nvfp4.cuh ``compute_rowwise_amax``, the tuned 1D kernel's
  ``ROW_SCALED_NVFP4`` path). Rowwise only, 1×16, no RHT, no stochastic rounding.
* ``nvfp4_use_4over6`` (quantize_4over6_nvfp4.cuh): each block (16×16 tile in 2-D mode) keeps the
  better of two encodings, map-to-6 (scale ``e4m3(amax_b / 6 · S_enc)``) and map-to-4 (that scale
  ×1.5), by the summed ``nvfp4_4over6_err_mode`` error (MAE or MSE) of its dequantized values;
  ties keep map-to-6. ``nvfp4_e4m3_max`` (448, or 256 to leave the map-to-4 scale headroom) sets
  ``S_enc = 6 · e4m3_max / amax`` and the dequantize divisor ``6 · e4m3_max``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import torch

from .. import numerics as nx
from ..errors import FormatError, QuantizationError, ShapeError
from ..kernel_ops import transpose_bytes
from ..tracing import tracing
from .protocol import COLUMNWISE, ROWWISE, BufferSpec, UsageLayout, flatten_2d, require_divisible
from .engine import BlockAmax, blocks_amax
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .layout_rules import spread_scales
from .te_adapter import TEAdapter, quantizer_from_te_fields, register_te_adapter

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


def global_encode_scale(amax: torch.Tensor, e4m3_max: float = E4M3_MAX) -> torch.Tensor:
    """S_enc = e4m3_max·6 / amax (fp32), capped at FLT_MAX; 1 when amax is 0 or S_enc underflows to 0.

    TE: ``compute_global_encode_scaling_factor_FP4<E4M3_MAX>`` (core_nvfp4.cuh); elementwise, so a
    per-row amax gives per-row scales.
    """
    s = torch.tensor(e4m3_max * nx.FP4_MAX, dtype=torch.float32, device=amax.device) / amax
    s = torch.clamp(s, max=nx.FP32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """E4M3 block-scale bytes of fp32 ``v`` (a compiled cast returns them FP8-typed: viewed here)."""
    return nx.scale_and_cast_to_fp8(v, None, torch.float8_e4m3fn).view(torch.uint8)


def _laid_out(packed: torch.Tensor, scales: torch.Tensor, along: int, r: int,
              transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Data packed two per byte along the blocks of x2 [R, C] in x2's order ([R, C/2] bytes, or
    [R/2, C] for blocks along ``along`` = 0; already [C, R/2] with ``transposed``) and its scales as
    the usage keeps them: rowwise as they are, columnwise transposed ([C, R/2] bytes, scales
    transposed)."""
    if along == 1:
        return packed.reshape(r, -1), scales
    return (packed if transposed else transpose_bytes(packed.reshape(r // 2, -1))), scales.t()


def _packed(codes: torch.Tensor, scales: torch.Tensor, along: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_laid_out` of one-byte codes of x2 [R, C] (any shape in x2's order), packed here:
    per block along the rows (a compiled graph has no K == 16 · (K // 16) to prove), or pairs of
    rows within blocks of 16 rows (no modulo in a compiled graph's indexing)."""
    packed = nx.pack_fp4(codes) if along == 1 else nx.pack_fp4(codes.reshape(r // BLOCK, BLOCK, -1), dim=1)
    return _laid_out(packed, scales, along, r)


def _chosen_scales(pick4: torch.Tensor, s4: torch.Tensor, s6: torch.Tensor, along: int, tile: bool) -> torch.Tensor:
    """4over6's block scales: map-to-4's where ``pick4``, else map-to-6's; a tile's spread to its 16
    blocks along dim ``along``. Tiles are chosen once, then spread down whole rows (columnwise as the
    usage keeps it, [C, R/16], viewed transposed): a graph choosing and spreading in one loop across
    a transposed grid ran scalar."""
    s_b = torch.where(pick4, s4, s6)
    if not tile:
        return s_b
    if along == 1:
        return nx.per_block(s_b).repeat_interleave(BLOCK, dim=0)
    return nx.per_block(s_b.t().contiguous()).repeat_interleave(BLOCK, dim=0).t()


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 1×16 blocks (16×16 tiles with ``with_2d_quantization``), two-level scaling.

    Exact paths: 16×16 → 1×16 (tile scales are block scales) and, in 16×16 mode without the RHT
    or 4over6, either usage from the other (a nibble transpose, tile scales spread, same amax);
    never across ``row_scaled_nvfp4`` or ``nvfp4_e4m3_max`` (other amax, other divisor). Slices
    align to 16 in both dims (the format's shape rule) and keep the parent's tensor amax (a
    per-row amax is sliced with the rows).
    """

    kind: ClassVar[str] = "nvfp4"
    #: format 1.3: a 1.2 reader still reads every NVFP4 tensor that leaves them at their defaults
    FIELD_VERSIONS: ClassVar[Mapping[str, tuple[int, int]]] = {
        f: (1, 3) for f in ("row_scaled_nvfp4", "nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode")}
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset(FIELD_VERSIONS)
    storage_class: ClassVar[type] = NVFP4TensorStorage
    tensor_class: ClassVar[type] = NVFP4Tensor

    with_rht: bool = dataclasses.field(default=False, kw_only=True)
    with_post_rht_amax: bool = dataclasses.field(default=False, kw_only=True)
    with_random_sign_mask: bool = dataclasses.field(default=True, kw_only=True)
    with_2d_quantization: bool = dataclasses.field(default=False, kw_only=True)
    stochastic_rounding: bool = dataclasses.field(default=False, kw_only=True)
    row_scaled_nvfp4: bool = dataclasses.field(default=False, kw_only=True)
    nvfp4_use_4over6: bool = dataclasses.field(default=False, kw_only=True)
    nvfp4_e4m3_max: int = dataclasses.field(default=448, kw_only=True)
    nvfp4_4over6_err_mode: str = dataclasses.field(default="MAE", kw_only=True)

    def __post_init__(self) -> None:
        """TE's rules for the variants (NVFP4Quantizer.__init__, csrc/quantizer.cpp quantize_impl,
        common/cast/dispatch/quantize.cuh), refused here with the field that breaks them; the list is
        schema/README.md §7.4's."""
        super().__post_init__()
        if self.with_rht and not self.with_post_rht_amax:
            raise FormatError("NVFP4Quantizer: with_rht=True needs with_post_rht_amax=True (TE's quantize_impl: "
                              "'Pre-RHT amax is not supported yet')")
        mode = self.nvfp4_4over6_err_mode
        if not isinstance(mode, str) or mode.upper() not in ("MAE", "MSE"):
            raise FormatError(f"NVFP4Quantizer: nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got {mode!r}")
        object.__setattr__(self, "nvfp4_4over6_err_mode", mode.upper())
        e = self.nvfp4_e4m3_max
        if isinstance(e, bool) or e not in (448, 256):
            raise FormatError(f"NVFP4Quantizer: nvfp4_e4m3_max must be 448 or 256, got {e!r}")
        object.__setattr__(self, "nvfp4_e4m3_max", int(e))
        if e == 256 and not self.nvfp4_use_4over6:
            raise FormatError("NVFP4Quantizer: nvfp4_e4m3_max=256 needs nvfp4_use_4over6=True (TE: 'Non-4over6 "
                              "NVFP4 quantization requires E4M3 max 448')")
        for flag, variant in (("nvfp4_use_4over6", "4over6"), ("row_scaled_nvfp4", "row-scaled")):
            if not getattr(self, flag):
                continue
            for other in ("with_rht", "stochastic_rounding"):
                if getattr(self, other):
                    raise FormatError(f"NVFP4Quantizer: {flag}=True with {other}=True: TE's {variant} NVFP4 "
                                      f"kernels support no {other.replace('with_', '').replace('_', ' ')}")
        if self.row_scaled_nvfp4:
            if self.with_2d_quantization:
                raise FormatError("NVFP4Quantizer: row_scaled_nvfp4=True with with_2d_quantization=True: TE's "
                                  "row-scaled NVFP4 has 1x16 blocks only")
            if self.columnwise or not self.rowwise:
                raise FormatError("NVFP4Quantizer: row_scaled_nvfp4=True is rowwise only (rowwise=True, "
                                  f"columnwise=False), got rowwise={self.rowwise}, columnwise={self.columnwise}: "
                                  "TE's row-scaled kernels make no columnwise copy")

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
            specs["_amax_rowwise"] = BufferSpec((m,) if self.row_scaled_nvfp4 else (1,), torch.float32)
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
                               tile=tile, pack=2, amax_rows=self.row_scaled_nvfp4)
        return UsageLayout("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise", grid=(BLOCK, 1),
                           tile=tile, transposed=True, scale_transposed=True, pack=2)

    def layout_key(self):
        # the sign mask matters only with the RHT; 4over6 and its error mode only chose the scales
        return (self.kind, self.with_2d_quantization, self.with_rht, self.with_rht and self.with_random_sign_mask,
                self.row_scaled_nvfp4, self.nvfp4_e4m3_max)

    def layout_name(self):
        four = f"_4over6{'_mse' if self.nvfp4_4over6_err_mode == 'MSE' else ''}" if self.nvfp4_use_4over6 else ""
        return (f"nvfp4{'_2d' if self.with_2d_quantization else ''}{'_rht' if self.with_rht else ''}"
                f"{'_row_scaled' if self.row_scaled_nvfp4 else ''}{four}"
                f"{'_e4m3max256' if self.nvfp4_e4m3_max == 256 else ''}")

    def slice_alignment(self):
        return BLOCK, BLOCK

    def input_dtype(self, dtype):
        return torch.bfloat16 if self.with_rht and self.columnwise else dtype  # TE's RHT cast takes BF16

    def deterministic(self):
        return dataclasses.replace(self, stochastic_rounding=False)

    def global_scale_divisor(self):
        return nx.FP4_MAX * self.nvfp4_e4m3_max  # x' = q · s_b · amax / (6 · e4m3_max); row-scaled: that row's amax

    def _same_columnwise(self, other: "NVFP4Quantizer") -> bool:
        return self.with_rht == other.with_rht and (not self.with_rht
                                                   or self.with_random_sign_mask == other.with_random_sign_mask)

    def _usages_transposed(self) -> bool:
        """Is either usage a nibble transpose of the other? 16×16 tiles without the RHT, and without
        4over6 (its rowwise and columnwise tiles sum their errors in other orders, so a near tie
        can pick another candidate in each)."""
        return self.with_2d_quantization and not self.with_rht and not self.nvfp4_use_4over6

    def exact_output(self, target):
        if not isinstance(target, NVFP4Quantizer):
            return super().exact_output(target)  # MXFP4 where the values are representable
        if target.with_2d_quantization and not self.with_2d_quantization:
            return None
        if (self.row_scaled_nvfp4, self.nvfp4_e4m3_max) != (target.row_scaled_nvfp4, target.nvfp4_e4m3_max):
            return None  # a per-row amax is no tensor amax; 6 · e4m3_max divides every value
        kw = dict(with_2d_quantization=target.with_2d_quantization, rowwise=target.rowwise,
                  columnwise=target.columnwise, nvfp4_use_4over6=target.nvfp4_use_4over6,
                  nvfp4_4over6_err_mode=target.nvfp4_4over6_err_mode)
        rht = dict(with_rht=target.with_rht, with_post_rht_amax=target.with_post_rht_amax,
                   with_random_sign_mask=target.with_random_sign_mask)
        if target.columnwise and not (self.columnwise and self._same_columnwise(target)):
            kw.update(rht)
        try:
            return dataclasses.replace(self, **kw)
        except FormatError:  # the source's RHT (columnwise only, not kept) or stochastic rounding with the
            # target's 4over6: the kept bytes mean the same values under the target's choices
            return dataclasses.replace(self, **kw, **rht, stochastic_rounding=target.stochastic_rounding)

    def serving_form(self, rep):
        if not isinstance(rep, NVFP4Quantizer) or self.row_scaled_nvfp4 or rep.row_scaled_nvfp4 \
                or self.nvfp4_e4m3_max == rep.nvfp4_e4m3_max:
            return rep
        return dataclasses.replace(rep, nvfp4_e4m3_max=self.nvfp4_e4m3_max, nvfp4_use_4over6=self.nvfp4_use_4over6,
                                   nvfp4_4over6_err_mode=self.nvfp4_4over6_err_mode)

    def derivable(self, out, usage):
        if not isinstance(out, NVFP4Quantizer):
            return super().derivable(out, usage)
        if usage == ROWWISE:
            return self.rowwise or self._usages_transposed()
        if self.columnwise and self._same_columnwise(out):
            return True
        return self.rowwise and self._usages_transposed() and not out.with_rht

    def derive(self, buffers, shape, out, usage):
        if not isinstance(out, NVFP4Quantizer):
            return super().derive(buffers, shape, out, usage)
        if self.has_usage(usage) and (usage == ROWWISE or self._same_columnwise(out)):
            return self.usage_buffers(buffers, usage)
        src = ROWWISE if usage == COLUMNWISE else COLUMNWISE  # 16×16 tiles without the RHT
        grid = spread_scales(self.tile_scales(buffers, shape, src), (BLOCK, BLOCK), out.usage_layout(usage).grid,
                             out.grid_shape(shape, usage))
        return self.relayout(buffers, shape, out, usage, src, grid)

    def _encode(self, x2: torch.Tensor, amax: torch.Tensor, args: Mapping[str, torch.Tensor] | None = None,
                along: int = 1, given: BlockAmax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize x2 [R, C] in blocks of 16 along dim ``along`` with the tensor amax (row-scaled:
        one per row, [R]). ``along=1`` (rowwise): (packed data [R, C/2], scales [R, C/16]);
        ``along=0`` (columnwise, blocks down the columns): the same for x2ᵀ, (packed [C, R/2],
        scales [C, R/16]), read in x2's own order and transposed once as packed bytes (a compiled
        graph then loads contiguously; a transposed read of the input ran scalar). ``args``:
        ``_kernel_args``; ``given``: x2's block maxima, taken ahead of a compiled graph."""
        if self.nvfp4_use_4over6:  # codes chosen block by block between two candidates
            _, _, block_amax, amax, s_enc = self._blocks(x2, amax, along, given, spread=False)
            data, s_b = self._select_4over6(x2, block_amax, amax, s_enc, args or self._kernel_args(x2.device), along)
            return _laid_out(data, s_b, along, x2.shape[0], transposed=True)
        blocks, enc, s_b = self._scaled_blocks(x2, amax, along, given)
        data = nx.scale_and_cast_to_fp4(blocks, enc, dim=-1 if along == 1 else -2)  # packed along the blocks
        return _laid_out(data, s_b, along, x2.shape[0])

    def _scaled_blocks(self, x2: torch.Tensor, amax: torch.Tensor, along: int, given: BlockAmax | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x2 as blocks ([R, C/16, 16], or [R/16, 16, C] for ``along`` = 0), each block's encoding
        scale broadcastable to them, and the E4M3 block scales [R, C/16] or [R/16, C] (not 4over6).
        compute_decoding_scaling_factor: s_b = e4m3(block_amax · (S_enc · (1/6))); the data is
        e2m1(x · min(1 / (s_b · (1 / S_enc)), FLT_MAX))."""
        blocks, bd, block_amax, amax, s_enc = self._blocks(x2, amax, along, given)
        s_dec = nx.reciprocal(s_enc)
        inv6 = torch.tensor(1.0 / nx.FP4_MAX, dtype=torch.float32, device=x2.device)
        s_b = _e4m3_bytes(torch.clamp(block_amax * (s_enc * inv6), max=nx.FP32_MAX))
        s_b_f = nx.fp8_to_float(s_b, torch.float8_e4m3fn)
        enc = torch.clamp(torch.ones_like(s_b_f) / (s_b_f * s_dec), max=nx.FP32_MAX)
        return blocks, nx.per_block(enc).unsqueeze(bd), s_b

    def _blocks(self, x2: torch.Tensor, amax: torch.Tensor, along: int, given: BlockAmax | None,
                spread: bool = True) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x2 as blocks, the dim of a block's 16 elements in them, the block maxima, the amax as
        [1, 1] or [R, 1], S_enc) for blocks along dim ``along``; 2-D, the 16×16 tiles' maxima spread to
        their blocks, or per tile ([R/16, C/16]) without ``spread``."""
        r, c = x2.shape
        bd = 2 if along == 1 else 1
        blocks = x2.reshape(r, c // BLOCK, BLOCK) if along == 1 else x2.reshape(r // BLOCK, BLOCK, c)
        if self.with_2d_quantization:
            block_amax = blocks_amax(x2, BLOCK, BLOCK, given)
            if spread:
                block_amax = block_amax.repeat_interleave(BLOCK, dim=1 - along)
        else:
            block_amax = blocks_amax(x2, 1, BLOCK, given) if along == 1 else blocks_amax(x2, BLOCK, 1, given)
        amax = amax.float().reshape(-1, 1)  # [1, 1], or [R, 1] per row (rowwise only)
        return blocks, bd, block_amax, amax, global_encode_scale(amax, self.nvfp4_e4m3_max)

    def _block_codes(self, x2: torch.Tensor, amax: torch.Tensor, args: Mapping[str, torch.Tensor] | None,
                     along: int, given: BlockAmax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_encode` before packing, not 4over6: (codes, one byte each, in x2's order as
        [R, C/16, 16] or [R/16, 16, C], scales [R, C/16] or [R/16, C])."""
        blocks, enc, s_b = self._scaled_blocks(x2, amax, along, given)
        return nx.cast_to_fp4_codes(blocks.float() * enc), s_b

    def _kernel_args(self, device):
        # 4over6 divides by 6 and by 6 · e4m3_max: kernel inputs, so that a compiled graph keeps them
        # true divisions (inductor may turn x / constant into x * (1 / constant))
        if not self.nvfp4_use_4over6:
            return {}
        f32 = dict(dtype=torch.float32, device=device)
        return {"fp4_max": torch.tensor(nx.FP4_MAX, **f32),
                "err_denom": torch.tensor(nx.FP4_MAX * self.nvfp4_e4m3_max, **f32)}

    def _4over6_candidates(self, block_amax: torch.Tensor, s_enc: torch.Tensor, args: Mapping[str, torch.Tensor]
                           ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """4over6's two candidates (quantize_4over6_nvfp4.cuh, default error math) for blocks (or
        tiles) of maxima ``block_amax``: map-to-4, then map-to-6, each (E4M3 scale bytes, encoding
        scale, decoding scale as fp32), the scales ``e4m3(min(b · 1.5, 448))`` and ``e4m3(min(b, 448))``,
        ``b = amax_b / 6 · S_enc``, and encoding ``min(1 / (s · (1 / S_enc)), FLT_MAX)``; grids row-major."""
        f32 = dict(dtype=torch.float32, device=block_amax.device)
        base = block_amax / args["fp4_max"] * s_enc
        s_dec = nx.reciprocal(s_enc)
        fp8_max = nx.fp8_max(torch.float8_e4m3fn)
        cands = []
        for b in (base * torch.tensor(1.5, **f32), base):  # map-to-4, map-to-6
            s_b = _e4m3_bytes(torch.clamp(b, max=fp8_max))
            sf = nx.fp8_to_float(s_b, torch.float8_e4m3fn)
            enc = torch.clamp(torch.ones_like(sf) / (sf * s_dec), max=nx.FP32_MAX)
            cands.append((s_b, enc, sf))
        (s4, enc4, sf4), (s6, enc6, sf6) = cands
        # row-major grids, as the C loop reads them (a graph would keep a transposed grid's strides)
        enc4, sf4, enc6, sf6 = nx.per_blocks(*(t.contiguous() for t in (enc4, sf4, enc6, sf6)))
        return (s4, enc4, sf4), (s6, enc6, sf6)

    def _select_4over6(self, x2: torch.Tensor, block_amax: torch.Tensor, amax: torch.Tensor,
                       s_enc: torch.Tensor, args: Mapping[str, torch.Tensor],
                       along: int) -> tuple[torch.Tensor, torch.Tensor]:
        """4over6: (data packed along the blocks as the usage keeps it, columnwise transposed;
        per-block scales) of the better of :meth:`_4over6_candidates` for each block of x2 along dim
        ``along`` (2-D: each tile, ``block_amax`` given per tile): ``numerics.scale_and_cast_to_fp4_4over6``,
        its error over ``((q · s) · amax) / (6 · e4m3_max) − x``."""
        (s4, enc4, sf4), (s6, enc6, sf6) = self._4over6_candidates(block_amax, s_enc, args)
        tile = self.with_2d_quantization  # the grids are per tile: the choice is the tile's
        data, pick4 = nx.scale_and_cast_to_fp4_4over6(x2, enc4, sf4, enc6, sf6, amax, args["err_denom"],
                                                      self.nvfp4_4over6_err_mode == "MSE", along, tile)
        return data, _chosen_scales(pick4, s4, s6, along, tile)

    def _tiles_4over6(self, xc: torch.Tensor, amax: torch.Tensor, args: Mapping[str, torch.Tensor],
                      given: BlockAmax | None) -> dict[str, torch.Tensor]:
        """Both usages of 2-D 4over6 from one pass (``numerics.scale_and_cast_to_fp4_4over6_pair``): a
        tile's candidates are the same in each, only its error sums' order differs."""
        args = args or self._kernel_args(xc.device)
        _, _, tiles, amax, s_enc = self._blocks(xc, amax, 1, given, spread=False)
        (s4, enc4, sf4), (s6, enc6, sf6) = self._4over6_candidates(tiles, s_enc, args)
        rows, pick_r, cols, pick_c = nx.scale_and_cast_to_fp4_4over6_pair(
            xc, enc4, sf4, enc6, sf6, amax, args["err_denom"], self.nvfp4_4over6_err_mode == "MSE")
        r = xc.shape[0]
        data, s_b = _laid_out(rows, _chosen_scales(pick_r, s4, s6, 1, True), 1, r)
        data_c, s_c = _laid_out(cols, _chosen_scales(pick_c, s4, s6, 0, True), 0, r, transposed=True)
        return {"_rowwise_data": data, "_rowwise_scale_inv": s_b,
                "_columnwise_data": data_c, "_columnwise_scale_inv": s_c.t()}

    def _rht(self, xt: torch.Tensor) -> torch.Tensor:
        """Columnwise RHT: bf16 inputs times ±1/4 (exact), summed in fp32, result rounded to bf16.

        TE: common/hadamard_transform/hadamard_transform_utils.cuh (MMA with fp32 accumulation,
        bf16 output). The sum is formed in float64 (exact here) and rounded once to fp32.
        """
        h = rht_matrix(self.with_random_sign_mask, xt.device).double()
        out = (xt.reshape(-1, BLOCK).double() @ h).float().to(torch.bfloat16)
        return out.reshape(xt.shape)

    def _quantize(self, x, tensor_amax=None):
        if self.with_rht and self.columnwise and (x.dtype != torch.bfloat16 or not self.with_post_rht_amax):
            raise QuantizationError(
                "NVFP4 with_rht needs bfloat16 input and with_post_rht_amax=True, as in TE "
                f"(got input {x.dtype}, with_post_rht_amax={self.with_post_rht_amax})")
        if self.stochastic_rounding:
            raise QuantizationError(
                "NVFP4Quantizer(stochastic_rounding=True) is not reproducible (TE draws Philox "
                "random bits in-kernel); quantize with stochastic_rounding=False")
        return super()._quantize(x, tensor_amax)

    def takes_tensor_amax(self) -> bool:
        return not self.row_scaled_nvfp4  # row-scaled: one amax per row, nothing tensor-wide to share

    def shares_fused_scale(self) -> bool:
        # vLLM and SGLang take the members' largest global scale for the fused GEMM and requantize
        # nothing: a member keeping its own global scale is served with wrong values
        return self.takes_tensor_amax()

    def recorded_tensor_amax(self, buffers):
        if self.row_scaled_nvfp4:
            return None
        if self.rowwise:
            return buffers["_amax_rowwise"].reshape(()).float()
        # the columnwise amax is the tensor's own, unless taken after the Hadamard transform
        return None if self.with_rht else buffers["_amax_columnwise"].reshape(()).float()

    def fusable(self) -> bool:
        # the RHT's float64 sums and their double rounding (fp64 → fp32 → bf16) stay eager
        return not (self.with_rht and self.columnwise)

    def amax_block(self):
        return BLOCK

    def _prepare(self, x2, args):
        given = self._given_amax(args)  # x2's block maxima, where the compiled path took them
        if self.row_scaled_nvfp4:  # compute_rowwise_amax: one amax per row, taken with its rows
            return (None, None, args, given), {}
        amax = self._tensor_amax(x2, args)
        amax_col = amax
        if self.columnwise and self.with_rht:  # post-RHT amax: a pass of its own over the chunks
            step = max(BLOCK, self.CHUNK_BYTES // (4 * x2.shape[1]) // BLOCK * BLOCK)
            parts = [nx.nan_ignoring_amax(self._rht(x2[r:r + step].t().contiguous()))
                     for r in range(0, x2.shape[0], step)]
            amax_col = torch.stack(parts).amax() if parts else amax
        whole = {}
        if self.rowwise:
            whole["_amax_rowwise"] = amax.reshape(1)
        if self.columnwise:
            whole["_amax_columnwise"] = amax_col.reshape(1)
        return (amax, amax_col, args, given), whole

    def _quantize_rows(self, xc, state):
        amax, amax_col, args, given = state
        out = {}
        if self.row_scaled_nvfp4:  # rowwise only; each row's amax is its global amax
            amax = given.rows.amax(dim=1) if given is not None else nx.nan_ignoring_amax(xc, dim=1)
            out["_rowwise_data"], out["_rowwise_scale_inv"] = self._encode(xc, amax, args, given=given)
            out["_amax_rowwise"] = amax
            return out
        if self.rowwise and self.columnwise and self._usages_transposed() and not tracing():
            # one set of codes, packed both ways (compiled, each usage casts on its own: the C loop
            # reads the input twice faster than the graph packs one set of codes twice)
            codes, s_b = self._block_codes(xc, amax, args, 1, given)
            out["_rowwise_data"], out["_rowwise_scale_inv"] = _packed(codes, s_b, 1, xc.shape[0])
            grid = s_b[::BLOCK].repeat_interleave(BLOCK, dim=1)  # the tiles' scales spread down the columns
            out["_columnwise_data"], out["_columnwise_scale_inv"] = _packed(codes, grid, 0, xc.shape[0])[0], grid
            return out
        if self.rowwise and self.columnwise and self.with_2d_quantization and self.nvfp4_use_4over6 \
                and not self.with_rht:
            return self._tiles_4over6(xc, amax, args, given)
        if self.rowwise:
            out["_rowwise_data"], out["_rowwise_scale_inv"] = self._encode(xc, amax, args, given=given)
        if self.columnwise:
            if self.with_rht:  # the transform mixes 16 elements of a column: on the transposed copy
                data, s_b = self._encode(self._rht(xc.t().contiguous()), amax_col, args)
            else:
                data, s_b = self._encode(xc, amax_col, args, along=0, given=given)
            out["_columnwise_data"], out["_columnwise_scale_inv"] = data, s_b.t()  # grid [R / 16, K]
        return out

    @staticmethod
    def _decode(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, r: int, c: int,
                e4m3_max: int = 448) -> torch.Tensor:
        """dequantize_nvfp4.cuh: q * (float(e4m3 scale) * amax * (1.0f / (6 * e4m3_max))); ``scale``
        is the [r, c / 16] block scale grid, ``amax`` one value or one per row ([r])."""
        codes = nx.unpack_fp4(data.reshape(r, c // 2))
        q = nx.fp4_codes_to_float(codes).reshape(r, c // BLOCK, BLOCK)
        s = nx.fp8_to_float(scale.contiguous(), torch.float8_e4m3fn)
        f32 = dict(dtype=torch.float32, device=data.device)
        factor = torch.tensor(1.0, **f32) / torch.tensor(nx.FP4_MAX * e4m3_max, **f32)
        final = s * amax.float().reshape(-1, 1) * factor
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
                                buffers["_amax_rowwise"], m, k, self.nvfp4_e4m3_max).reshape(shape)
        values = self._decode(buffers["_columnwise_data"], self.block_scales(buffers, shape, COLUMNWISE).t(),
                              buffers["_amax_columnwise"], k, m, self.nvfp4_e4m3_max)
        if self.with_rht:
            values = self._inverse_rht(values)
        return values.t().reshape(shape)


class _NVFP4TE(TEAdapter):
    te_module = "tensor.nvfp4_tensor"
    te_tensor = "NVFP4Tensor"
    te_storage = "NVFP4TensorStorage"
    te_quantizers = ("NVFP4Quantizer",)

    @staticmethod
    def _fp4(te_dtype) -> dict:
        if int(te_dtype) != 10:  # kFloat4E2M1 (transformer_engine.h)
            raise FormatError(f"NVFP4Quantizer with dtype {te_dtype!r}: te-serial reads kFloat4E2M1 only")
        return {}

    def quantizer_from_fields(self, te_class, fields):
        return quantizer_from_te_fields(
            NVFP4Quantizer, fields, te_class=te_class, swizzles=True,
            convert={"dtype": self._fp4,
                     "rht_matrix_random_sign_mask_t": lambda v: {"with_random_sign_mask": v != 0}})

    def read(self, t, tq, shape):
        # the tensor's flags say what its bytes are; the error mode lives on TE's quantizer only
        row_scaled = bool(getattr(t, "_row_scaled_nvfp4", False))
        if row_scaled and t._columnwise_data is not None:
            raise FormatError(
                "TE NVFP4 tensor is row-scaled and holds a columnwise copy (with one amax per column): "
                "te-serial holds row-scaled NVFP4 rowwise only; drop the columnwise usage first "
                "(update_usage(columnwise_usage=False))")
        q = NVFP4Quantizer(rowwise=t._rowwise_data is not None, columnwise=t._columnwise_data is not None,
                           with_rht=bool(getattr(tq, "with_rht", False)),
                           with_post_rht_amax=bool(getattr(tq, "with_post_rht_amax", False)),
                           with_2d_quantization=bool(getattr(tq, "with_2d_quantization", False)),
                           stochastic_rounding=bool(getattr(tq, "stochastic_rounding", False)),
                           with_random_sign_mask=bool(getattr(tq, "rht_matrix_random_sign_mask_t", 1)),
                           row_scaled_nvfp4=row_scaled,
                           nvfp4_use_4over6=bool(getattr(t, "_nvfp4_use_4over6", False)),
                           nvfp4_e4m3_max=int(getattr(t, "_nvfp4_e4m3_max", 448)),
                           nvfp4_4over6_err_mode=str(getattr(tq, "nvfp4_4over6_err_mode", "MAE")))
        return q, {n: getattr(t, n) for n in NVFP4TensorStorage.BUFFERS}

    def te_quantizer(self, q, te):
        return te.module(self.te_module).NVFP4Quantizer(
            rowwise=q.rowwise, columnwise=q.columnwise, with_rht=q.with_rht,
            with_post_rht_amax=q.with_post_rht_amax, with_2d_quantization=q.with_2d_quantization,
            stochastic_rounding=q.stochastic_rounding, with_random_sign_mask=q.with_random_sign_mask,
            row_scaled_nvfp4=q.row_scaled_nvfp4, nvfp4_use_4over6=q.nvfp4_use_4over6,
            nvfp4_e4m3_max=q.nvfp4_e4m3_max, nvfp4_4over6_err_mode=q.nvfp4_4over6_err_mode)

    def te_kwargs(self, q, buffers, te):
        return dict(rowwise_data=buffers.get("_rowwise_data"), rowwise_scale_inv=buffers.get("_rowwise_scale_inv"),
                    columnwise_data=buffers.get("_columnwise_data"),
                    columnwise_scale_inv=buffers.get("_columnwise_scale_inv"),
                    amax_rowwise=buffers.get("_amax_rowwise"), amax_columnwise=buffers.get("_amax_columnwise"),
                    fp4_dtype=te.DType.kFloat4E2M1, with_gemm_swizzled_scales=False,
                    row_scaled_nvfp4=q.row_scaled_nvfp4, nvfp4_use_4over6=q.nvfp4_use_4over6,
                    nvfp4_e4m3_max=q.nvfp4_e4m3_max)


register_te_adapter(_NVFP4TE(), NVFP4Quantizer)
