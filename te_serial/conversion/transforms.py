"""Tensor-level conversion: which path each tensor takes, and the buffer transforms behind it.

Exact paths rebuild the target's buffers from the source's bytes, never from dequantized values:

* any format → the same format (other usages too where TE's layout makes them exact: the
  per-tensor FP8 transpose; blockwise 128×128, MXFP8 32×32 and NVFP4 16×16 columnwise copies,
  which are the rowwise values transposed);
* blockwise 128×128 → 1×128: a tile's scale applied to each 1×128 row segment (rowwise) or each
  128×1 column segment (columnwise) gives the same FP8 bytes;
* MXFP8 32×32 → 1×32 and NVFP4 16×16 → 1×16: the same buffers (tile scales are block scales);
* per-tensor FP8 → blockwise (1×128 or 128×128), DeepSeek 128×128 or compressed-tensors
  per-tensor / per-channel: the one scale in every block;
* per-tensor delayed ⇄ current scaling: the same bytes and scale_inv.

Everything else dequantizes the source (fp32) and quantizes again: lossy. Each path is checked
after the fact (:func:`compare`), so a report can say "lossless" only of bit-equal values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from .. import numerics as nx
from ..errors import ConversionError, ShapeError
from ..formats import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, NVFP4Quantizer,
                       Quantizer)
from ..formats.base import QuantizedTensorStorage, flatten_2d
from ..proto import TensorProto
from .targets import layout_fields_equal

ROW, COL = "rowwise", "columnwise"
E4M3 = torch.float8_e4m3fn
PER_TENSOR = ("fp8_delayed_scaling", "fp8_current_scaling")

__all__ = ["Step", "plan_te", "plan_plain", "plan_deepseek", "plan_ct", "plan_keep_external", "execute",
           "values", "usage_view", "compare", "ErrorStats", "deepseek_quantizer", "ct_quantizer"]


def enabled(q: Quantizer) -> list[str]:
    return [u for u, on in ((ROW, q.rowwise), (COL, q.columnwise)) if on]


def with_usages(q: Quantizer, usages: tuple[bool, bool]) -> Quantizer:
    return q.set_usage(rowwise=usages[0], columnwise=usages[1])


def deepseek_quantizer(pow2: bool = False) -> Float8BlockQuantizer:
    """The representation of a DeepSeek-V3 weight: rowwise E4M3 with one fp32 scale per 128×128 tile."""
    return Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=2, force_pow_2_scales=pow2)


def ct_quantizer(strategy: str, pow2: bool = False) -> Quantizer:
    """The representation of a compressed-tensors FP8 weight: per-tensor FP8, or (per channel) a
    rowwise 1×128 blockwise tensor whose blocks in each row share one scale."""
    if strategy == "tensor":
        return Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=False)
    return Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=1, force_pow_2_scales=pow2)


# --- values ------------------------------------------------------------------------------------

def usage_view(t: QuantizedTensorStorage, usage: str) -> QuantizedTensorStorage:
    """The tensor restricted to one usage's buffers (to dequantize that usage)."""
    q = t.quantizer.set_usage(rowwise=usage == ROW, columnwise=usage == COL)
    specs = q.describe_buffers(t.logical_shape)
    bufs = t.buffers()
    return q.storage_class(t.logical_shape, t.fake_dtype, q, **{n: bufs[n] for n in specs})


def values(t: torch.Tensor, usage: str | None = None) -> torch.Tensor:
    """fp32 values of a plain tensor, or of a quantized tensor's ``usage`` (default: rowwise if present)."""
    if isinstance(t, QuantizedTensorStorage):
        if usage is not None:
            t = usage_view(t, usage)
        return t.dequantize(torch.float32)
    return t.to(torch.float32)


@dataclasses.dataclass
class ErrorStats:
    exact: bool
    max_abs_err: float = 0.0
    rel_rmse: float = 0.0
    snr_db: float = math.inf

    def worst(self, other: "ErrorStats") -> "ErrorStats":
        return ErrorStats(self.exact and other.exact, max(self.max_abs_err, other.max_abs_err),
                          max(self.rel_rmse, other.rel_rmse), min(self.snr_db, other.snr_db))


def compare(ref: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 20) -> ErrorStats:
    """Bit-exactness (NaN-aware) and error figures of ``out`` against ``ref`` (same shape, compared
    as fp32 values).

    Non-finite values must sit at the same places with the same value (inf sign, NaN) or the
    max abs error is inf; the figures cover the finite elements.
    """
    if ref.shape != out.shape:
        raise ConversionError(f"shapes differ: {tuple(ref.shape)} vs {tuple(out.shape)}")
    a, b = ref.reshape(-1), out.reshape(-1)  # any float dtypes: widened to fp32 chunk by chunk
    exact = True
    max_abs = 0.0
    err2 = sig2 = 0.0
    nonfinite_mismatch = False
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].to(torch.float32), b[i:i + chunk].to(torch.float32)
        if exact and not torch.equal(x.view(torch.int32), y.view(torch.int32)):
            nx_, ny_ = torch.isnan(x), torch.isnan(y)
            exact = torch.equal(nx_, ny_) and torch.equal(
                torch.where(nx_, 0, x.view(torch.int32)), torch.where(ny_, 0, y.view(torch.int32)))
        d = y - x
        m = float(d.abs().max()) if d.numel() else 0.0
        if not math.isfinite(m):  # a non-finite value on either side: compare the finite ones
            fx, fy = torch.isfinite(x), torch.isfinite(y)
            both = fx & fy
            same_nonfinite = (~fx & ~fy) & ((x == y) | (torch.isnan(x) & torch.isnan(y)))
            if bool((~both & ~same_nonfinite).any()):
                nonfinite_mismatch = True
            x = torch.where(both, x, 0)
            d = torch.where(both, d, 0)
            m = float(d.abs().max())
        max_abs = max(max_abs, m)
        e2, s2 = float(torch.dot(d, d)), float(torch.dot(x, x))  # fp32 BLAS per chunk, summed in fp64
        if not (math.isfinite(e2) and math.isfinite(s2)):
            e2 = float(torch.sum(d.double() ** 2))
            s2 = float(torch.sum(x.double() ** 2))
        err2 += e2
        sig2 += s2
    if nonfinite_mismatch:
        max_abs = math.inf
    if exact:
        return ErrorStats(True)
    rel = math.sqrt(err2 / sig2) if sig2 > 0 else (0.0 if err2 == 0 else math.inf)
    snr = math.inf if err2 == 0 else (10 * math.log10(sig2 / err2) if sig2 > 0 else -math.inf)
    return ErrorStats(False, max_abs, rel, snr)


# --- plans -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Step:
    """What happens to one tensor. ``out_q`` None → a plain tensor of ``out_dtype``."""

    method: str                     # keep | copy | relayout | quantize | requantize | dequantize | cast
    out_q: Quantizer | None
    out_dtype: torch.dtype          # nominal dtype of a quantized output, or the plain dtype
    exact: bool = False             # exact by construction (checked after)
    requant: frozenset = frozenset()   # usages rebuilt from dequantized values
    builder: str = "exact"          # exact | quantize | per_channel | channel_or_requant | cast | keep
    note: str = ""
    data_dependent: bool = False    # out_q is finalized from the data (delayed scaling)

    def proto(self, shape) -> TensorProto:
        return TensorProto(shape, self.out_dtype, self.out_q)


def _same_fp8(p: Quantizer, q: Quantizer) -> bool:
    return getattr(p, "fp8_dtype", None) == getattr(q, "fp8_dtype", None)


def _pow2(p: Quantizer) -> bool:
    return bool(getattr(p, "force_pow_2_scales", False))


def _compat_out(p: Quantizer, q: Quantizer) -> Quantizer | None:
    """The output quantizer of an exact (or partly exact) path from ``p`` to target ``q``, or None."""
    use = dict(rowwise=q.rowwise, columnwise=q.columnwise)
    if p.kind in PER_TENSOR and q.kind in PER_TENSOR and _same_fp8(p, q):
        if q.kind == p.kind:
            return dataclasses.replace(p, **use)
        if q.kind == "fp8_current_scaling":
            return Float8CurrentScalingQuantizer(p.fp8_dtype, **use)
        return Float8Quantizer(1.0, 0.0, p.fp8_dtype, **use)  # scale / amax filled in from the data
    if p.kind in PER_TENSOR and q.kind == "fp8_blockwise" and _same_fp8(p, q):
        return Float8BlockQuantizer(p.fp8_dtype, block_scaling_dim=q.block_scaling_dim, force_pow_2_scales=_pow2(p),
                                    amax_epsilon=getattr(p, "amax_epsilon", 0.0), **use)
    if p.kind == "fp8_blockwise" and q.kind == "fp8_blockwise" and _same_fp8(p, q):
        if p.block_scaling_dim == q.block_scaling_dim or (p.block_scaling_dim, q.block_scaling_dim) == (2, 1):
            return dataclasses.replace(p, block_scaling_dim=q.block_scaling_dim, **use)
        return None
    if p.kind == "mxfp8" and q.kind == "mxfp8" and _same_fp8(p, q):
        if p.with_2d_quantization or not q.with_2d_quantization:
            return dataclasses.replace(p, with_2d_quantization=q.with_2d_quantization, **use)
        return None
    if p.kind == "nvfp4" and q.kind == "nvfp4":
        if q.with_2d_quantization and not p.with_2d_quantization:
            return None
        out = dataclasses.replace(p, with_2d_quantization=q.with_2d_quantization, **use)
        if q.columnwise and not (p.columnwise and _nvfp4_col_same(p, q)):
            out = dataclasses.replace(out, with_rht=q.with_rht, with_post_rht_amax=q.with_post_rht_amax,
                                      with_random_sign_mask=q.with_random_sign_mask)
        return out
    return None


def _nvfp4_col_same(p: Quantizer, q: Quantizer) -> bool:
    return p.with_rht == q.with_rht and (not p.with_rht or p.with_random_sign_mask == q.with_random_sign_mask)


def _can_exact(p: Quantizer, out: Quantizer, usage: str) -> bool:
    """Can ``usage`` of ``out`` be built from the bytes of a ``p`` tensor?"""
    has = p.rowwise if usage == ROW else p.columnwise
    if p.kind in PER_TENSOR:
        return True  # the transpose is the same bytes; the one scale fits every block
    if p.kind == "fp8_blockwise":
        if p.block_scaling_dim == 2:
            return True
        return has and out.block_scaling_dim == 1
    if p.kind == "mxfp8":
        return has or p.with_2d_quantization
    if p.kind == "nvfp4":
        if usage == ROW:
            return p.rowwise or (p.with_2d_quantization and not p.with_rht)
        if p.columnwise and _nvfp4_col_same(p, out):
            return True
        return p.rowwise and p.with_2d_quantization and not out.with_rht
    return False


def _copy_only(p: Quantizer, out: Quantizer) -> bool:
    return layout_fields_equal(p, out) and all(p.rowwise if u == ROW else p.columnwise for u in enabled(out))


def plan_te(p: Quantizer | None, q: Quantizer, dtype: torch.dtype, src_dtype: torch.dtype) -> Step:
    """A te-serial recipe target ``q`` (usages chosen) for a source with quantizer ``p``."""
    delayed = q.kind == "fp8_delayed_scaling"
    if p is None:
        return Step("quantize", q, dtype, builder="quantize", data_dependent=delayed,
                    note="delayed scaling: scale from the tensor's amax" if delayed else "")
    out = _compat_out(p, q)
    if out is None:
        return Step("requantize", q, dtype, builder="quantize", data_dependent=delayed,
                    note="delayed scaling: scale from the tensor's amax" if delayed else "")
    requant = frozenset(u for u in enabled(out) if not _can_exact(p, out, u))
    data_dep = out.kind == "fp8_delayed_scaling" and p.kind != "fp8_delayed_scaling"
    if requant:
        if getattr(out, "stochastic_rounding", False):  # the rebuilt usage is rounded to nearest
            out = dataclasses.replace(out, stochastic_rounding=False)
        what = " and ".join(sorted(requant))
        return Step("requantize", out, src_dtype, requant=requant,
                    note=f"{what} usage rebuilt from dequantized values (not derivable from the source's bytes)")
    method = "copy" if _copy_only(p, out) else "relayout"
    note = "delayed scaling: scale = 1 / the source's scale_inv" if data_dep else ""
    return Step(method, out, src_dtype, exact=True, data_dependent=data_dep, note=note)


def plan_plain(p: Quantizer | None, src_dtype: torch.dtype, d: torch.dtype) -> Step:
    if p is None:
        if src_dtype == d or not (src_dtype.is_floating_point or src_dtype.is_complex):
            note = "" if src_dtype == d else "not floating point: kept as it is"
            return Step("keep", None, src_dtype, exact=True, builder="keep", note=note)
        return Step("cast", None, d, builder="cast")
    return Step("dequantize", None, d, builder="cast")


def plan_deepseek(p: Quantizer | None, dtype: torch.dtype, src_dtype: torch.dtype) -> Step:
    if p is not None and p.kind == "fp8_blockwise" and p.block_scaling_dim == 2 and p.fp8_dtype == E4M3:
        out = dataclasses.replace(p, rowwise=True, columnwise=False)
        return Step("copy" if p.rowwise else "relayout", out, src_dtype, exact=True)
    if p is not None and p.kind in PER_TENSOR and p.fp8_dtype == E4M3:
        return Step("relayout", deepseek_quantizer(_pow2(p)), src_dtype, exact=True)
    return Step("quantize" if p is None else "requantize", deepseek_quantizer(False), dtype, builder="quantize")


def plan_ct(p: Quantizer | None, strategy: str, dtype: torch.dtype, src_dtype: torch.dtype,
            uniform_rows: bool) -> Step:
    if p is not None and p.kind in PER_TENSOR and p.fp8_dtype == E4M3:
        if strategy == "tensor":
            out = dataclasses.replace(p, rowwise=True, columnwise=False)
            return Step("copy" if p.rowwise else "relayout", out, src_dtype, exact=True)
        return Step("relayout", ct_quantizer("channel", _pow2(p)), src_dtype, exact=True)
    if (strategy == "channel" and p is not None and p.kind == "fp8_blockwise" and p.block_scaling_dim == 1
            and p.fp8_dtype == E4M3 and p.rowwise):
        out = dataclasses.replace(p, rowwise=True, columnwise=False)
        if uniform_rows:
            return Step("copy", out, src_dtype, exact=True)
        return Step("copy", out, src_dtype, exact=True, builder="channel_or_requant")
    method = "quantize" if p is None else "requantize"
    if strategy == "tensor":
        return Step(method, ct_quantizer("tensor"), dtype, builder="quantize")
    return Step(method, ct_quantizer("channel"), dtype, builder="per_channel")


def plan_keep_external(family: str, p: Quantizer | None, src_dtype: torch.dtype, dtype: torch.dtype,
                       strategy: str | None, uniform_rows: bool, shape: tuple[int, ...]) -> Step:
    """"keep" in a plain, DeepSeek or compressed-tensors checkpoint: the source's own values, in that
    layout when it holds them exactly, else plain (dequantized to ``dtype``)."""
    if p is None:
        return Step("keep", None, src_dtype, exact=True, builder="keep")
    if len(shape) == 2 and family == "deepseek":
        step = plan_deepseek(p, dtype, src_dtype)
        if step.exact:
            return step
    if len(shape) == 2 and family == "ct":
        step = plan_ct(p, strategy, dtype, src_dtype, uniform_rows)
        if step.exact and step.builder == "exact":
            return step
    return Step("dequantize", None, dtype, builder="cast")


# --- buffer transforms --------------------------------------------------------------------------

def _fill(spec, region: tuple[int, int], value: torch.Tensor) -> torch.Tensor:
    """A zeroed scale buffer of ``spec`` with ``value`` (broadcast) in its valid ``region``."""
    out = torch.zeros(spec.shape, dtype=spec.dtype)
    r, c = region
    out[:r, :c] = value
    return out


def _f8_row(b, shape):
    return b["_data"] if "_data" in b else b["_transpose"].movedim(0, -1).contiguous()


def _f8_col(b, shape):
    return b["_transpose"] if "_transpose" in b else b["_data"].movedim(-1, 0).contiguous()


def _bw_row(b):
    return b["_rowwise_data"] if "_rowwise_data" in b else b["_columnwise_data"].movedim(0, -1).contiguous()


def _bw_col(b):
    return b["_columnwise_data"] if "_columnwise_data" in b else b["_rowwise_data"].movedim(-1, 0).contiguous()


def _tiles_2d(p: Quantizer, b, m: int, k: int) -> torch.Tensor:
    """The [ceil(M/128), ceil(K/128)] tile scales of a blockwise 128×128 tensor."""
    mb, kb = nx.ceil_div(m, 128), nx.ceil_div(k, 128)
    if "_rowwise_scale_inv" in b:
        return b["_rowwise_scale_inv"][:mb, :kb]
    return b["_columnwise_scale_inv"][:kb, :mb].t()


def _exact_usage(p: Quantizer, t: QuantizedTensorStorage, out: Quantizer, usage: str) -> dict[str, torch.Tensor]:
    """``usage``'s buffers of the ``out`` tensor, built from the bytes of ``t`` (``_can_exact`` holds)."""
    b = t.buffers()
    shape = tuple(t.logical_shape)
    m, k = flatten_2d(shape)
    specs = out.describe_buffers(shape)
    row = usage == ROW
    if p.kind in PER_TENSOR:
        s = b["_scale_inv"]
        if out.kind in PER_TENSOR:
            data = {"_data": _f8_row(b, shape)} if row else {"_transpose": _f8_col(b, shape)}
            return {**data, "_scale_inv": s}
        # blockwise: the one scale in every block
        mb, kb = nx.ceil_div(m, 128), nx.ceil_div(k, 128)
        if out.block_scaling_dim == 2:
            region = (mb, kb) if row else (kb, mb)
        else:
            region = (kb, m) if row else (mb, k)
        if row:
            return {"_rowwise_data": _f8_row(b, shape), "_rowwise_scale_inv": _fill(specs["_rowwise_scale_inv"], region, s)}
        return {"_columnwise_data": _f8_col(b, shape), "_columnwise_scale_inv": _fill(specs["_columnwise_scale_inv"], region, s)}
    if p.kind == "fp8_blockwise":
        has = p.rowwise if row else p.columnwise
        if has and p.block_scaling_dim == out.block_scaling_dim:
            names = ("_rowwise_data", "_rowwise_scale_inv") if row else ("_columnwise_data", "_columnwise_scale_inv")
            return {n: b[n] for n in names}
        tiles = _tiles_2d(p, b, m, k)  # p is 128×128 here
        mb, kb = tiles.shape
        if out.block_scaling_dim == 2:
            if row:
                return {"_rowwise_data": _bw_row(b), "_rowwise_scale_inv": _fill(specs["_rowwise_scale_inv"], (mb, kb), tiles)}
            return {"_columnwise_data": _bw_col(b),
                    "_columnwise_scale_inv": _fill(specs["_columnwise_scale_inv"], (kb, mb), tiles.t())}
        if row:  # 1×128 along K: scale [kb, m] = tile[m // 128, kb]
            rs = tiles.repeat_interleave(128, dim=0)[:m].t()
            return {"_rowwise_data": _bw_row(b), "_rowwise_scale_inv": _fill(specs["_rowwise_scale_inv"], (kb, m), rs)}
        cs = tiles.repeat_interleave(128, dim=1)[:, :k]  # 128 along M: scale [mb, k] = tile[mb, k // 128]
        return {"_columnwise_data": _bw_col(b), "_columnwise_scale_inv": _fill(specs["_columnwise_scale_inv"], (mb, k), cs)}
    if p.kind == "mxfp8":
        has = p.rowwise if row else p.columnwise
        if has:
            names = ("_rowwise_data", "_rowwise_scale_inv") if row else ("_columnwise_data", "_columnwise_scale_inv")
            return {n: b[n] for n in names}
        # 32×32 tiles: both usages hold the same bytes; scales are the tile exponents spread out
        if row:
            tiles = b["_columnwise_scale_inv"][: m // 32, : k : 32]
            rs = tiles.repeat_interleave(32, dim=0)
            return {"_rowwise_data": b["_columnwise_data"],
                    "_rowwise_scale_inv": _fill(specs["_rowwise_scale_inv"], (m, k // 32), rs)}
        tiles = b["_rowwise_scale_inv"][: m : 32, : k // 32]
        cs = tiles.repeat_interleave(32, dim=1)
        return {"_columnwise_data": b["_rowwise_data"],
                "_columnwise_scale_inv": _fill(specs["_columnwise_scale_inv"], (m // 32, k), cs)}
    if p.kind == "nvfp4":
        if row and p.rowwise:
            return {n: b[n] for n in ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")}
        if not row and p.columnwise and _nvfp4_col_same(p, out):
            return {n: b[n] for n in ("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise")}
        # 16×16 tiles without the RHT: columnwise = the rowwise codes transposed, tile scales transposed
        if row:
            codes = nx.unpack_fp4(b["_columnwise_data"].reshape(k, m // 2)).t().contiguous()
            tiles = b["_columnwise_scale_inv"][: k : 16, : m // 16].t()
            return {"_rowwise_data": nx.pack_fp4(codes).reshape(specs["_rowwise_data"].shape),
                    "_rowwise_scale_inv": _fill(specs["_rowwise_scale_inv"], (m, k // 16),
                                                tiles.repeat_interleave(16, dim=0)),
                    "_amax_rowwise": b["_amax_columnwise"].clone()}
        codes = nx.unpack_fp4(b["_rowwise_data"].reshape(m, k // 2)).t().contiguous()
        tiles = b["_rowwise_scale_inv"][: m : 16, : k // 16].t()
        return {"_columnwise_data": nx.pack_fp4(codes).reshape(specs["_columnwise_data"].shape),
                "_columnwise_scale_inv": _fill(specs["_columnwise_scale_inv"], (k, m // 16),
                                               tiles.repeat_interleave(16, dim=0)),
                "_amax_columnwise": b["_amax_rowwise"].clone()}
    raise ConversionError(f"no exact path from {p.kind} to {out.kind}")


def _quantize_input(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    if isinstance(q, NVFP4Quantizer) and q.with_rht and q.columnwise and x.dtype != torch.bfloat16:
        return x.to(torch.bfloat16)  # TE's RHT cast takes BF16 input
    return x


def _delayed_for(x: torch.Tensor, q: Quantizer) -> Quantizer:
    """Delayed scaling as TE settles after seeing this tensor: scale = fp8_max / amax (margin 0)."""
    amax = nx.nan_ignoring_amax(x)
    scale = nx.scale_from_amax(amax, nx.fp8_max(q.fp8_dtype), force_pow_2_scales=False, epsilon=0.0,
                               value_for_inf=nx.FP32_MAX)
    return Float8Quantizer(float(scale), float(amax), q.fp8_dtype, rowwise=q.rowwise, columnwise=q.columnwise)


def _per_channel(x: torch.Tensor, q: Float8BlockQuantizer, fake_dtype: torch.dtype) -> QuantizedTensorStorage:
    """Per-output-channel FP8 E4M3 (compressed-tensors strategy "channel"): scale = 448 / amax(row)
    (fp32), q = sat_rne(x · scale), scale_inv = 1 / scale, held as rowwise 1×128 blocks sharing it."""
    shape = tuple(x.shape)
    m, k = flatten_2d(shape)
    x2 = x.reshape(m, k)
    specs = q.describe_buffers(shape)
    data = torch.empty(specs["_rowwise_data"].shape, dtype=torch.uint8)
    d2 = data.view(m, k)
    scale_inv = torch.empty(m, dtype=torch.float32)
    step = max(1, (1 << 20) // max(k, 1))
    for r in range(0, m, step):
        xc = x2[r:r + step]
        amax = nx.nan_ignoring_amax(xc, dim=1)
        scale = nx.scale_from_amax(amax, nx.fp8_max(E4M3), force_pow_2_scales=False, epsilon=0.0,
                                   value_for_inf=nx.FP32_MAX)
        d2[r:r + step] = nx.scale_and_cast_to_fp8(xc, scale[:, None], E4M3)
        scale_inv[r:r + step] = nx.reciprocal(scale)
    kb = nx.ceil_div(k, 128)
    rs = _fill(specs["_rowwise_scale_inv"], (kb, m), scale_inv[None, :])
    return q.tensor_class(shape, fake_dtype, q, _rowwise_data=data, _rowwise_scale_inv=rs)


def uniform_rows(t: QuantizedTensorStorage) -> bool:
    """Do all 1×128 blocks of each row of a rowwise blockwise-1D tensor share one scale?"""
    shape = tuple(t.logical_shape)
    m, k = flatten_2d(shape)
    kb = nx.ceil_div(k, 128)
    s = t.buffers()["_rowwise_scale_inv"][:kb, :m]
    return bool((s == s[:1]).all()) if kb else True


def execute(step: Step, src: torch.Tensor, x_fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Step]:
    """Run ``step`` on the source tensor; ``x_fn()`` gives its fp32 values (for requantizing).

    Returns the output tensor and the step as it ran (delayed-scaling quantizers filled in, a
    per-channel copy that had to requantize marked so)."""
    shape = tuple(src.shape)
    if step.builder == "keep":
        return src, step
    if step.builder == "cast":
        if isinstance(src, QuantizedTensorStorage):
            return src.dequantize(step.out_dtype), step
        return src.to(step.out_dtype), step
    q = step.out_q
    if step.builder == "channel_or_requant":
        if uniform_rows(src):
            step = dataclasses.replace(step, builder="exact")
        else:
            step = dataclasses.replace(step, method="requantize", exact=False, builder="per_channel",
                                       out_q=ct_quantizer("channel"),
                                       note="row blocks have different scales: requantized per channel")
            q = step.out_q
    if step.builder == "per_channel":
        plain = src if not isinstance(src, QuantizedTensorStorage) else x_fn()
        return _per_channel(plain, q, step.out_dtype), step
    if step.builder == "quantize":
        x = src if not isinstance(src, QuantizedTensorStorage) else x_fn()
        if q.kind == "fp8_delayed_scaling" and step.data_dependent:
            q = _delayed_for(x, q)
            step = dataclasses.replace(step, out_q=q)
        try:
            return q.quantize(_quantize_input(x, q), fake_dtype=step.out_dtype), step
        except ShapeError as e:
            raise ConversionError(str(e)) from None
    # exact (possibly with some usages requantized)
    p = src.quantizer
    if step.data_dependent and q.kind == "fp8_delayed_scaling":
        s_inv = src.buffers()["_scale_inv"].reshape(())
        vals = x_fn()
        q = Float8Quantizer(float(nx.reciprocal(s_inv)), float(nx.nan_ignoring_amax(vals)), q.fp8_dtype,
                            rowwise=q.rowwise, columnwise=q.columnwise)
        step = dataclasses.replace(step, out_q=q)
    out: dict[str, torch.Tensor] = {}
    for usage in enabled(q):
        if usage not in step.requant:
            out.update(_exact_usage(p, src, q, usage))
    if step.requant:
        qq = q.set_usage(rowwise=ROW in step.requant, columnwise=COL in step.requant)
        part = qq.quantize(_quantize_input(x_fn(), qq), fake_dtype=step.out_dtype)
        out.update(part.buffers())
    q.check_buffers(shape, out, where="converted tensor")
    return q.tensor_class(shape, step.out_dtype, q, **out), step
