"""What the serving layouts share: weight schemes, their te-serial representation, and the
buffer moves between a te-serial tensor and a layout's tensors.

A *scheme* is how one layout stores one quantized ``*.weight``:

========== ============================================= ==========================================
scheme     te-serial representation (rowwise only)       what the layouts store
========== ============================================= ==========================================
nvfp4      ``NVFP4Quantizer`` 1×16                        packed E2M1 ``[N, K/2]`` U8, E4M3 block
                                                          scales ``[N, K/16]``, one fp32 global scale
mxfp8      ``MXFP8Quantizer(e4m3)`` 1×32                  E4M3 ``[N, K]``, E8M0 exponents ``[N, K/32]``
mxfp4      ``MXFP4Quantizer`` 1×32                        packed E2M1 ``[N, K/2]`` U8, E8M0 exponents
                                                          ``[N, K/32]`` U8
fp8_tensor ``Float8CurrentScalingQuantizer(e4m3)``        E4M3 ``[N, K]``, one fp32 scale
fp8_channel ``Float8BlockQuantizer`` 1×128, rows share    E4M3 ``[N, K]``, fp32 scale ``[N, 1]``
fp8_block  ``Float8BlockQuantizer`` 128×128               E4M3 ``[N, K]``, fp32 ``[⌈N/128⌉, ⌈K/128⌉]``
========== ============================================= ==========================================

Everything about the te-serial side goes through the formats' protocol (``usage_layout``,
``block_scales``, ``scale_buffer``, ``global_scale_divisor`` …); what is written here is each
layout's own convention. A layout's reader applies the global scale of a two-level format
(NVFP4) with its own formula, which can land a few fp32 ulp away from te-serial's (TE's)
dequantized value: :func:`codes_check` measures that per tensor, from the block scales alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ... import kernel_ops
from ...formats import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP4Quantizer, MXFP8Quantizer,
                        NVFP4Quantizer, Quantizer)
from ...formats.protocol import ROWWISE
from ...formats.tensors import QuantizedTensorStorage

ROW = ROWWISE
E4M3 = torch.float8_e4m3fn
F32 = torch.float32

@dataclasses.dataclass(frozen=True)
class Scheme:
    """One way the serving layouts store a quantized ``*.weight``, declared once: the te-serial
    quantizer (rowwise) whose bytes are what the layouts store, and the form of the stored scale."""

    name: str
    make: Callable[[bool], Quantizer]   # pow2 → the representation (pow2: power-of-two fp32 scales)
    stored: str   # "codes": E4M3 block-scale bytes; "exponents": E8M0 bytes as U8; "tensor": one fp32;
                  # "channel": fp32 [N, 1] (every row's blocks share one); "blocks": the fp32 grid
    two_level: bool = False  # a tensor amax above the block scales (the layouts' global scale)

    def representation(self, pow2: bool = False) -> Quantizer:
        return self.make(pow2)


#: every weight scheme, by name: the layouts' offers (``ExternalLayout.offers``) refer to these
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("nvfp4", lambda pow2: NVFP4Quantizer(rowwise=True, columnwise=False), "codes", two_level=True),
    Scheme("mxfp8", lambda pow2: MXFP8Quantizer(E4M3, rowwise=True, columnwise=False), "exponents"),
    Scheme("mxfp4", lambda pow2: MXFP4Quantizer(rowwise=True, columnwise=False), "exponents"),
    Scheme("fp8_tensor", lambda pow2: Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=False), "tensor"),
    Scheme("fp8_channel", lambda pow2: Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=1,
                                                           force_pow_2_scales=pow2), "channel"),
    Scheme("fp8_block", lambda pow2: Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=2,
                                                         force_pow_2_scales=pow2), "blocks"),
)}

#: how each stored form is cut from a usage's valid scale grid ([row blocks, col blocks])
_STORED: dict[str, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {
    "codes": lambda grid, dt: grid.contiguous().view(dt),                  # E4M3 bytes
    "exponents": lambda grid, dt: grid.contiguous().view(torch.uint8),     # E8M0 exponents as U8
    "tensor": lambda grid, dt: grid.reshape(()).clone(),
    "channel": lambda grid, dt: grid[:, :1].contiguous(),                  # rows share one scale
    "blocks": lambda grid, dt: grid.contiguous(),
}


def representation(scheme: str, pow2: bool = False) -> Quantizer:
    """The te-serial quantizer (rowwise only) whose bytes are what ``scheme`` stores."""
    try:
        return SCHEMES[scheme].representation(pow2)
    except KeyError:
        raise ValueError(f"unknown weight scheme {scheme!r}") from None


def prefix(name: str) -> str:
    """``model.x.weight`` → ``model.x.`` (the module's parameter prefix)."""
    return name[: -len("weight")]


def module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


# --- te-serial tensor ↔ the layout's arrays ----------------------------------------------------

@dataclasses.dataclass
class WeightParts:
    """One weight in a layout's terms: element data, block (or tensor / channel) scales, and for
    two-level formats the tensor amax and its divisor (value = code · scale · amax / divisor)."""

    data: torch.Tensor                 # [N, K] codes, or [N, K/2] packed
    scale: torch.Tensor                # the scheme's scale array, stored dtype
    amax: torch.Tensor | None = None   # fp32 scalar tensor
    divisor: float | None = None


def split(t: QuantizedTensorStorage, scheme: str) -> WeightParts:
    """The rowwise data and scales of ``t`` (a tensor in ``representation(scheme)``'s layout)."""
    q, b = t.quantizer, t.buffers()
    shape = tuple(t.logical_shape)
    lay = q.usage_layout(ROW)
    vals = q.value_dtypes()
    data = b[lay.data].view(vals[lay.data])
    grid = q.block_scales(b, shape, ROW)              # valid region, [row blocks, col blocks]
    scale = _STORED[SCHEMES[scheme].stored](grid, vals.get(lay.scale, grid.dtype))
    amax = b[lay.amax].reshape(()).clone() if lay.amax is not None else None
    return WeightParts(data, scale, amax, q.global_scale_divisor())


def assemble(q: Quantizer, shape: tuple[int, ...], dtype: torch.dtype, data: torch.Tensor, scale: torch.Tensor,
             amax: torch.Tensor | None = None) -> QuantizedTensorStorage:
    """A rowwise te-serial tensor of ``q`` from a layout's data and scale arrays (any shape that
    broadcasts to the scale grid) and, for two-level formats, the tensor amax."""
    lay = q.usage_layout(ROW)
    specs = q.describe_buffers(shape)
    bufs = {lay.data: data.contiguous().view(specs[lay.data].dtype).reshape(specs[lay.data].shape)}
    sdt = specs[lay.scale].dtype
    # byte-coded scales (E4M3, E8M0) move as bits; fp32 scales as values (BF16 → fp32 is exact)
    s = scale.contiguous().view(torch.uint8) if sdt == torch.uint8 else scale.to(sdt)
    bufs[lay.scale] = q.scale_buffer(s if s.dim() else s.reshape(1, 1), shape, ROW)
    if lay.amax is not None:
        bufs[lay.amax] = amax.reshape(specs[lay.amax].shape).to(torch.float32).clone()
    return q.tensor_class(shape, dtype, q, **bufs)


# --- the global scale of a two-level format, in each layout's convention -------------------------

def _next(x: torch.Tensor, toward: float) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(toward, dtype=F32))


def solve_amax(global_value: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
               guess: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An fp32 amax whose ``forward(amax)`` is ``global_value`` bit for bit, searched within a few
    ulp of ``guess``; (guess, False) when there is none (the layout's number does not come from
    any fp32 amax by its formula)."""
    want = global_value.reshape(()).to(F32)
    cands = [guess.reshape(()).to(F32)]
    lo = hi = cands[0]
    for _ in range(4):
        lo, hi = _next(lo, 0.0), _next(hi, math.inf)
        cands += [lo, hi]
    for c in cands:
        if c > 0 and torch.equal(forward(c).view(torch.int32), want.view(torch.int32)):
            return c, True
    return cands[0], False


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in fp32 ulp (ordered bit patterns), elementwise; equal values (and ±0) are 0 apart."""
    def ordered(x):
        i = x.to(F32).contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


def ulp_histogram(a: torch.Tensor, b: torch.Tensor) -> dict[int, int]:
    """{ulp distance: element count} between two fp32 tensors of the same shape."""
    d = ulp_distance(a.reshape(-1), b.reshape(-1))
    vals, counts = torch.unique(d, return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts)}


@dataclasses.dataclass
class CodesCheck:
    """How a layout reader's values relate to te-serial's for one two-level tensor."""

    ulp_max: int              # the largest distance over the block scales present and every code
    ulp_elements: int         # elements in blocks whose per-block factor differs (zeros there are equal)
    max_abs_err: float        # the largest |difference| over those (scale, code) pairs

    @property
    def exact(self) -> bool:
        return self.ulp_max == 0


def codes_check(t: QuantizedTensorStorage, reader: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | tuple]
                ) -> CodesCheck:
    """Compare te-serial's dequantized values of the rowwise two-level tensor ``t`` with a layout
    reader's, ``reader(codes [256, C] uint8, block scale bytes [256, 1] uint8) -> fp32 values`` (or a
    tuple of them: the formulas the layout's consumers use, the worst counted), for every (block
    scale byte present in ``t``, element code) pair. A value depends on nothing else, so one
    histogram of the block scales (no pass over the elements) bounds the whole tensor."""
    q, b = t.quantizer, t.buffers()
    shape = tuple(t.logical_shape)
    lay = q.usage_layout(ROW)
    grid = q.block_scales(b, shape, ROW)                       # [M, K/B] scale bytes
    counts = kernel_ops.byte_histogram(grid)                   # how many blocks have each scale byte
    block = lay.grid[1]
    # te-serial's value of every (scale byte, code): a [256, width] tensor of q's own format,
    # row s holding every code under block scale byte s, with t's tensor amax
    n_codes = 1 << (8 // lay.pack)
    width = max(block, n_codes)
    probe = (256, width)
    codes = torch.arange(n_codes, dtype=torch.uint8).repeat(256, width // n_codes)
    pq = q.set_usage(rowwise=True, columnwise=False)
    scale_bytes = torch.arange(256, dtype=torch.uint8)[:, None]
    bufs = {lay.data: pq.data_buffer(codes, probe, ROW), lay.scale: pq.scale_buffer(scale_bytes, probe, ROW)}
    if lay.amax is not None:
        bufs[lay.amax] = b[lay.amax].clone()
    te_vals = pq.storage_class(probe, F32, pq, **bufs).dequantize(F32)[:, :n_codes]
    got = reader(codes[:, :n_codes], scale_bytes)
    d = diff = None
    for r_vals in (got if isinstance(got, tuple) else (got,)):
        r_vals = r_vals.to(F32)
        ok = torch.isfinite(te_vals) & torch.isfinite(r_vals)     # NaN scale bytes: no such blocks in practice
        dd = torch.where(ok, ulp_distance(te_vals, r_vals), 0)
        ee = torch.where(ok, (te_vals - r_vals).abs(), 0)
        d, diff = (dd, ee) if d is None else (torch.maximum(d, dd), torch.maximum(diff, ee))
    use = counts > 0
    if not bool(use.any()):
        return CodesCheck(0, 0, 0.0)
    bad_rows = (d > 0).any(dim=1)
    return CodesCheck(int(d[use].max()), int(counts[use & bad_rows].sum()) * block, float(diff[use].max()))
