"""Independent MXFP4 oracle, written from the formulas (shared/docs/mxfp4.md §0, §6 and TE's
``NVFP4QuantizerRef(pow_2_scales=True, quant_tile_shape=(1, 32))``), not from te-serial's code.

Per block of 32 along the quantized dim: ``a = fp32(max |x|)``; k = the least integer ≥ −127 with
``a ≤ 6 · 2^k`` (capped at 127: an infinite block), found here in float64 by search, not by bit
tricks; the scale byte is k + 127; codes are the E2M1 grid point nearest to ``fl32(x · 2^−k)`` (ties
to the even code, saturating at 6), negative iff that fp32 product is < 0 (−0.0 is +0).
Dequantize: ``LUT[code] · 2^(b − 127)`` in float64, rounded to fp32.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch

from .te_reference import _FP4_GRID, _rne_onto_grid, fp4_pack, fp4_unpack

_F32, _F64 = torch.float32, torch.float64
BLOCK = 32


def block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int64 k per block amax (fp32): least k in [−127, 127] with amax ≤ 6 · 2^k (127 for inf)."""
    a = amax.to(_F64)
    k = torch.full(a.shape, -127, dtype=torch.int64)
    finite = torch.isfinite(a)
    for _ in range(260):  # raise k while 6 · 2^k < a (exact in float64: 6 · 2^k has two bits)
        low = finite & (torch.ldexp(torch.full_like(a, 6.0), k.to(_F64)) < a) & (k < 127)
        if not bool(low.any()):
            break
        k = k + low.to(torch.int64)
    return torch.where(torch.isinf(a), torch.full_like(k, 127), k)


def encode_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [R, C] uint8, scale bytes [R, C/32] uint8) of x2 [R, C] in blocks of 32 along C."""
    r, c = x2.shape
    xf = x2.to(_F32).reshape(r, c // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1)
    k = block_exponent(amax)
    enc = torch.ldexp(torch.ones_like(amax, dtype=_F64), (-k).to(_F64)).to(_F32)  # 2^−k, exact in fp32
    scaled = xf * enc[..., None]  # fp32 product, as the reference rounds it
    mag = _rne_onto_grid(scaled.abs().to(_F64).clamp(max=6.0), _FP4_GRID)
    codes = (mag | torch.where(scaled < 0, 8, 0)).to(torch.uint8).reshape(r, c)
    return codes, (k + 127).to(torch.uint8)


def _padded(grid: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros((rows, cols), dtype=torch.uint8)
    out[: grid.shape[0], : grid.shape[1]] = grid
    return out


def ref_mxfp4(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> Dict[str, torch.Tensor]:
    """MXFP4 buffers of ``x``: rowwise (*S[:-1], K/2) + [round_up(M,128), round_up(K/32,4)];
    columnwise the transposed input quantized along M: (K, M/2) + [round_up(K,128), round_up(M/32,4)]."""
    shape = tuple(x.shape)
    k = shape[-1]
    m = math.prod(shape[:-1])
    x2 = x.reshape(m, k)
    ru = lambda v, n: -(-v // n) * n  # noqa: E731
    out = {}
    if rowwise:
        codes, s = encode_rows(x2)
        out["_rowwise_data"] = fp4_pack(codes).reshape(*shape[:-1], k // 2)
        out["_rowwise_scale_inv"] = _padded(s, ru(m, 128), ru(k // BLOCK, 4))
    if columnwise:
        codes, s = encode_rows(x2.t().contiguous())
        out["_columnwise_data"] = fp4_pack(codes)
        out["_columnwise_scale_inv"] = _padded(s, ru(k, 128), ru(m // BLOCK, 4))
    return out


_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=_F64)


def decode_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 of E2M1 codes [R, C] times 2^(b − 127) per 32 along C (float64, rounded once)."""
    e = scales.to(torch.int64).repeat_interleave(BLOCK, dim=1) - 127
    return torch.ldexp(_LUT[codes.long()], e.to(_F64)).to(_F32)


def ref_dequantize_mxfp4(buffers: Dict[str, torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """fp32 values of MXFP4 buffers (rowwise when present, else columnwise)."""
    shape = tuple(shape)
    k = shape[-1]
    m = math.prod(shape[:-1])
    if buffers.get("_rowwise_data") is not None:
        codes = fp4_unpack(buffers["_rowwise_data"].reshape(m, k // 2))
        return decode_rows(codes, buffers["_rowwise_scale_inv"][:m, : k // BLOCK]).reshape(shape)
    codes = fp4_unpack(buffers["_columnwise_data"].reshape(k, m // 2))
    return decode_rows(codes, buffers["_columnwise_scale_inv"][:k, : m // BLOCK]).t().reshape(shape)
