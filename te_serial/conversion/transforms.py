"""Tensor-level conversion: which path each tensor takes, and the buffer transforms behind it.

Exact paths rebuild the target's buffers from the source's bytes, never from dequantized values.
Each format declares its own (``Quantizer.exact_output`` / ``derivable`` / ``derive`` in
``te_serial/formats``): the same format in other usages where TE's layout makes them exact,
finer blocks from coarser ones, per-tensor FP8 into block layouts, delayed ⇄ current scaling.
DeepSeek and compressed-tensors weights are blockwise / per-tensor FP8 tensors here, so their
exact paths are the same declarations. This module only asks.

Everything else dequantizes the source (fp32) and quantizes again: lossy. Each path is checked
after the fact (:func:`compare`), so a report can say "lossless" only of bit-equal values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch

from .. import numerics as nx
from ..errors import ConversionError, ShapeError
from ..formats import Float8BlockQuantizer, Quantizer, fused
from ..formats.protocol import COLUMNWISE, ROWWISE, flatten_2d
from ..formats.tensors import QuantizedTensorStorage
from ..formats.slicing import slice_quantized
from ..proto import TensorProto
from .layouts.base import representation

ROW, COL = ROWWISE, COLUMNWISE
E4M3 = torch.float8_e4m3fn

_SETTLED = "scale and amax set from this tensor's values"


def enabled(q: Quantizer) -> list[str]:
    return list(q.usages_on())


# --- values ------------------------------------------------------------------------------------

def usage_view(t: QuantizedTensorStorage, usage: str) -> QuantizedTensorStorage:
    """The tensor restricted to one usage's buffers (to dequantize that usage)."""
    q = t.quantizer.set_usage(rowwise=usage == ROW, columnwise=usage == COL)
    specs = q.describe_buffers(t.logical_shape)
    bufs = t.buffers()
    return q.storage_class(t.logical_shape, t.fake_dtype, q, **{n: bufs[n] for n in specs})


def values(t: torch.Tensor, usage: str | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """fp32 values of a plain tensor, or of a quantized tensor's ``usage`` (default: rowwise if
    present); ``rows``: only that block-aligned range of TE's 2-D view, as ``[rows, K]``."""
    if isinstance(t, QuantizedTensorStorage):
        if usage is not None:
            t = usage_view(t, usage)
        if rows is not None:
            t = slice_quantized(t, rows=rows)
        return t.dequantize(torch.float32)
    return rows_of(t, rows).to(torch.float32)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (plain or quantized, same class) with its buffers on ``device``; ``t`` itself if already there."""
    if isinstance(t, QuantizedTensorStorage):
        bufs = t.buffers()
        if all(b.device == device for b in bufs.values()):
            return t
        return t._rebuild({n: b.to(device) for n, b in bufs.items()})
    return t if t.device == device else t.to(device)


def rows_of(x: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows ``rows`` of a plain tensor's 2-D view (leading dims flattened); all of it for None."""
    if rows is None:
        return x
    return x.reshape(flatten_2d(tuple(x.shape)))[rows[0]:rows[1]]


#: how a requantized tensor's error figures are measured: every element, evenly spread row blocks
#: (about 1/16 of the rows), or not at all. Exact paths are always checked in full.
STATS_MODES = ("full", "sample", "none")
#: "sample": row blocks compared, and the share of the rows they cover at least
SAMPLE_WINDOWS, SAMPLE_SHARE = 8, 1 / 16


def _row_align(tensors: tuple[torch.Tensor, ...]) -> int:
    """Rows a range must start on so that every quantized tensor among ``tensors`` can be sliced there."""
    align = 1
    for t in tensors:
        if isinstance(t, QuantizedTensorStorage):
            align = math.lcm(align, t.quantizer.slice_alignment()[0])
    return align


def sample_rows(shape: tuple[int, ...], *tensors: torch.Tensor) -> list[tuple[int, int]] | None:
    """Evenly spread row ranges covering about :data:`SAMPLE_SHARE` of a tensor's 2-D rows, aligned
    to every quantized tensor's slice alignment; None (all rows) for tensors too small to sample."""
    if len(shape) < 2:
        return None
    m, _ = flatten_2d(tuple(shape))
    align = _row_align(tensors)
    height = max(align, math.ceil(m * SAMPLE_SHARE / SAMPLE_WINDOWS / align) * align)
    blocks = m // height
    if blocks <= SAMPLE_WINDOWS:
        return None
    picks = sorted({round(i * (blocks - 1) / (SAMPLE_WINDOWS - 1)) for i in range(SAMPLE_WINDOWS)})
    return [(b * height, (b + 1) * height) for b in picks]


def compare_rows(ref: Callable[[tuple[int, int] | None], torch.Tensor],
                 outs: Sequence[Callable[[tuple[int, int] | None], torch.Tensor]],
                 rows: list[tuple[int, int]] | None) -> list[ErrorStats]:
    """:func:`compare` of each output against one reference over the given row ranges (``ref(r)`` /
    ``out(r)`` give those rows' values), or over the whole tensors when ``rows`` is None; the
    reference's rows are read and widened once for all outputs."""
    cs = [_Comparison() for _ in outs]
    for r in rows if rows is not None else [None]:  # one window at a time: memory is a window's values
        _add_each(cs, ref(r), [out(r) for out in outs])
    return [c.result() for c in cs]


#: "full" statistics of a large tensor dequantize this many fp32 bytes of rows at a time
FULL_WINDOW_BYTES = 16 << 20


def all_rows(shape: tuple[int, ...], *tensors: torch.Tensor) -> list[tuple[int, int]] | None:
    """Row windows covering every row of a tensor, each about :data:`FULL_WINDOW_BYTES` of fp32 and
    aligned to every quantized tensor's slice alignment; None (one piece) when it is small."""
    if len(shape) < 2:
        return None
    m, k = flatten_2d(tuple(shape))
    align = _row_align(tensors)
    height = max(align, FULL_WINDOW_BYTES // (4 * max(k, 1)) // align * align)
    if height >= m:
        return None
    return [(r, min(r + height, m)) for r in range(0, m, height)]


@dataclasses.dataclass
class ErrorStats:
    exact: bool
    max_abs_err: float = 0.0
    rel_rmse: float = 0.0
    snr_db: float = math.inf
    sampled: str = "full"      # over which elements: one of STATS_MODES

    def worst(self, other: "ErrorStats") -> "ErrorStats":
        return ErrorStats(self.exact and other.exact, max(self.max_abs_err, other.max_abs_err),
                          max(self.rel_rmse, other.rel_rmse), min(self.snr_db, other.snr_db), self.sampled)


class _Comparison:
    """Running bit-exactness and error sums over pieces of two tensors (see :func:`compare`)."""

    def __init__(self) -> None:
        self.exact, self.nonfinite_mismatch = True, False
        self.max_abs = self.err2 = self.sig2 = 0.0

    def _settle(self, ref: torch.Tensor, out: torch.Tensor) -> bool:
        """``out`` against ``ref`` (flat, any float dtypes) in one compiled pass, where that settles
        the figures: a finite nonzero difference and finite sums. False otherwise (non-finite
        values, all differences zero, an fp32 overflow: the chunked comparison then looks at the
        bits, or sums in fp64)."""
        got = fused.run(_sums, ("compare", str(ref.dtype), str(out.dtype)), ref, out)
        if got is None:
            return False
        lo, hi, e2, s2 = (float(v) for v in got)
        m = max(-lo, hi)  # NaN propagates: not settled here
        if not (m > 0 and math.isfinite(m) and math.isfinite(e2) and math.isfinite(s2)):
            return False
        self.exact = False
        self.max_abs = max(self.max_abs, m)
        self.err2 += e2
        self.sig2 += s2
        return True

    def _chunk(self, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor,
               shared: tuple[float, bool] | None) -> tuple[float, bool] | None:
        """One chunk (fp32, ``d`` a scratch buffer of its size). ``shared``: Σx² of this chunk and
        whether it overflowed fp32, from another output compared with the same ``x``; returns it
        for the next one (None where this comparison masked ``x``)."""
        d = torch.sub(y, x, out=d)
        lo, hi = torch.aminmax(d) if d.numel() else (torch.zeros(()), torch.zeros(()))
        m = max(-float(lo), float(hi))  # max |d| in one pass (NaN propagates)
        if self.exact:
            if m > 0 and math.isfinite(m):  # a finite nonzero difference settles it
                self.exact = False
            elif not torch.equal(x.view(torch.int32), y.view(torch.int32)):
                # all differences 0 or non-finite: -0.0 vs 0.0 and NaN payloads decide on the bits
                nx_, ny_ = torch.isnan(x), torch.isnan(y)
                self.exact = torch.equal(nx_, ny_) and torch.equal(
                    torch.where(nx_, 0, x.view(torch.int32)), torch.where(ny_, 0, y.view(torch.int32)))
        masked = not math.isfinite(m)
        if masked:  # a non-finite value on either side: compare the finite ones
            fx, fy = torch.isfinite(x), torch.isfinite(y)
            both = fx & fy
            same_nonfinite = (~fx & ~fy) & ((x == y) | (torch.isnan(x) & torch.isnan(y)))
            if bool((~both & ~same_nonfinite).any()):
                self.nonfinite_mismatch = True
            x = torch.where(both, x, 0)
            d = torch.where(both, d, 0)
            m = float(d.abs().max())
        self.max_abs = max(self.max_abs, m)
        e2 = float(torch.dot(d, d))  # fp32 BLAS per chunk, summed in fp64
        if masked or shared is None:
            s2 = float(torch.dot(x, x))
            wide = not math.isfinite(s2)
            if wide:
                s2 = float(torch.sum(x.double() ** 2))
        else:
            s2, wide = shared
        mine = (s2, wide)
        if wide or not math.isfinite(e2):  # either sum overflowing fp32: both in fp64
            e2 = float(torch.sum(d.double() ** 2))
            if not wide:
                s2 = float(torch.sum(x.double() ** 2))
        self.err2 += e2
        self.sig2 += s2
        return shared if masked else mine

    def result(self) -> ErrorStats:
        if self.exact:
            return ErrorStats(True)
        err2, sig2 = self.err2, self.sig2
        rel = math.sqrt(err2 / sig2) if sig2 > 0 else (0.0 if err2 == 0 else math.inf)
        snr = math.inf if err2 == 0 else (10 * math.log10(sig2 / err2) if sig2 > 0 else -math.inf)
        return ErrorStats(False, math.inf if self.nonfinite_mismatch else self.max_abs, rel, snr)


def _add_each(cs: list[_Comparison], ref: torch.Tensor, outs: list[torch.Tensor], chunk: int = 1 << 18) -> None:
    """Add ``outs[i]`` against ``ref`` (same shape) to ``cs[i]`` (any float dtypes, compared as fp32).
    Where the compile policy takes a tensor of this size, one compiled pass per output settles a
    lossy one (:meth:`_Comparison._settle`: max |d|, Σd², Σx² read off at once). The rest go chunk by
    chunk: each chunk of ``ref`` is widened and its Σx² taken once for every output, and one set of
    cache-sized scratch buffers is reused (no fresh pages per chunk)."""
    for o in outs:
        if o.shape != ref.shape:
            raise ConversionError(f"shapes differ: {tuple(ref.shape)} vs {tuple(o.shape)}")
    a = ref.detach().reshape(-1)   # figures, not a graph: a tensor that requires grad is compared as values
    bs = [o.detach().reshape(-1) for o in outs]
    if fused.wants_fused(a.numel(), a.device, True):  # lossy outputs: their figures in one compiled pass
        left = [(c, b) for c, b in zip(cs, bs) if not c._settle(a, b)]
        cs, bs = [c for c, _ in left], [b for _, b in left]
        if not cs:
            return
    n0 = min(chunk, a.numel())
    xs = torch.empty(n0) if a.dtype != torch.float32 else None
    ys = torch.empty(n0) if any(b.dtype != torch.float32 for b in bs) else None
    ds = torch.empty(n0)
    for i in range(0, a.numel(), chunk):
        n = min(chunk, a.numel() - i)
        x = a[i:i + n] if xs is None else xs[:n].copy_(a[i:i + n])
        shared = None
        for c, b in zip(cs, bs):
            y = b[i:i + n] if b.dtype == torch.float32 else ys[:n].copy_(b[i:i + n])
            shared = c._chunk(x, y, ds[:n], shared)


def _sums(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """min and max of d = fp32(y) - fp32(x), Σd² and Σx² (fp32 sums, as the chunks' dot products;
    fp64 ones cost a fifth of the conversion's speed), one pass when compiled."""
    xf, d = x.float(), y.float() - x.float()
    return d.min(), d.max(), (d * d).sum(), (xf * xf).sum()


def compare(ref: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 18) -> ErrorStats:
    """Bit-exactness (NaN-aware) and error figures of ``out`` against ``ref`` (same shape, compared
    as fp32 values).

    Non-finite values must sit at the same places with the same value (inf sign, NaN) or the
    max abs error is inf; the figures cover the finite elements.
    """
    c = _Comparison()
    _add_each([c], ref, [out], chunk)
    return c.result()


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
    tensor_amax: float | None = None  # quantize with this amax (a fused group's shared one: fused_scales)
    #: consumer routes that read the written bytes as other values → the largest change of a value
    #: (an engine requantizing a fused group's member: fused_scales); the report's ``routes``
    routes: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def proto(self, shape) -> TensorProto:
        return TensorProto(shape, self.out_dtype, self.out_q)


def _copy_only(p: Quantizer, out: Quantizer) -> bool:
    return p.same_layout(out) and all(p.has_usage(u) for u in out.conversion_usages())


def plan_te(p: Quantizer | None, q: Quantizer, dtype: torch.dtype, src_dtype: torch.dtype) -> Step:
    """A te-serial recipe target ``q`` (usages chosen) for a source with quantizer ``p``."""
    out = p.exact_output(q) if p is not None else None
    if out is None:
        dd = q.data_dependent
        return Step("quantize" if p is None else "requantize", q, dtype, builder="quantize",
                    data_dependent=dd, note=_SETTLED if dd else "")
    requant = frozenset(u for u in out.conversion_usages() if not p.derivable(out, u))
    data_dep = out.data_dependent and not p.data_dependent
    if requant:
        what = " and ".join(sorted(requant))
        return Step("requantize", out.deterministic(), src_dtype, requant=requant,
                    note=f"{what} usage rebuilt from dequantized values (not derivable from the source's bytes)")
    method = "copy" if _copy_only(p, out) else "relayout"
    note = "scale = 1 / the source's scale_inv" if data_dep else ""
    return Step(method, out, src_dtype, exact=True, data_dependent=data_dep, note=note)


def _exact_into(p: Quantizer | None, rep: Quantizer, src_dtype: torch.dtype) -> Step | None:
    """The exact step from ``p`` into an external layout's representation ``rep`` (rowwise), if any."""
    out = p.exact_output(rep) if p is not None else None
    if out is None or not p.derivable(out, ROW):
        return None
    return Step("copy" if _copy_only(p, out) else "relayout", out, src_dtype, exact=True)


def plan_plain(p: Quantizer | None, src_dtype: torch.dtype, d: torch.dtype) -> Step:
    if p is None:
        if src_dtype == d or not (src_dtype.is_floating_point or src_dtype.is_complex):
            note = "" if src_dtype == d else "not floating point: kept as it is"
            return Step("keep", None, src_dtype, exact=True, builder="keep", note=note)
        return Step("cast", None, d, builder="cast")
    return Step("dequantize", None, d, builder="cast")


_CT_SCHEME = {"tensor": "fp8_tensor", "channel": "fp8_channel"}  # a compressed-tensors FP8 strategy's scheme


def plan_ct(p: Quantizer | None, strategy: str, dtype: torch.dtype, src_dtype: torch.dtype,
            uniform_rows: bool) -> Step:
    rep = representation(_CT_SCHEME[strategy])
    step = _exact_into(p, rep, src_dtype)
    if step is not None:
        if strategy == "tensor" or p.scale_per_tensor:  # one scale: every row's blocks share it
            return step
        if p.same_layout(rep):  # 1×128 blocks: whether each row's share one scale is in the data
            return step if uniform_rows else dataclasses.replace(step, builder="channel_or_requant")
    method = "quantize" if p is None else "requantize"
    if strategy == "tensor":
        return Step(method, representation("fp8_tensor"), dtype, builder="quantize")
    return Step(method, representation("fp8_channel"), dtype, builder="per_channel")


def plan_external(p: Quantizer | None, scheme: str, rep: Quantizer, dtype: torch.dtype, src_dtype: torch.dtype,
                  uniform_rows: bool) -> Step:
    """A serving layout's weight scheme (``rep``: its te-serial representation, rowwise) for a
    source with quantizer ``p``: the exact path when the source's bytes hold the rowwise usage in
    that layout (directly or derivably), else a requantization of the source's values."""
    if scheme in ("fp8_channel", "fp8_tensor"):
        return plan_ct(p, "channel" if scheme == "fp8_channel" else "tensor", dtype, src_dtype, uniform_rows)
    step = _exact_into(p, rep, src_dtype)
    if step is not None:
        return step
    note = ""
    if p is not None and p.exact_output(rep) is not None:
        note = ("the rowwise usage is not derivable from the source's columnwise bytes (quantized along the "
                "other dim, or Hadamard-transformed): requantized; serving layouts hold the rowwise usage only")
    return Step("quantize" if p is None else "requantize", rep, dtype, builder="quantize", note=note)


def plan_keep_external(family: str, p: Quantizer | None, src_dtype: torch.dtype, dtype: torch.dtype,
                       scheme: str | None, uniform_rows: bool, shape: tuple[int, ...], rep: Quantizer | None = None,
                       name: str = "weight") -> Step:
    """"keep" in a plain or serving-layout checkpoint: the source's own values, in that layout when
    it holds them exactly (2-D ``*.weight`` tensors), else plain (dequantized to ``dtype``)."""
    if p is None:
        return Step("keep", None, src_dtype, exact=True, builder="keep")
    if len(shape) == 2 and family != "plain" and scheme is not None and (name == "weight" or name.endswith(".weight")):
        step = plan_external(p, scheme, rep, dtype, src_dtype, uniform_rows)
        if step.exact and step.builder == "exact":
            return step
    return Step("dequantize", None, dtype, builder="cast")


# --- buffer transforms --------------------------------------------------------------------------

def _quantize_input(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    d = q.input_dtype(x.dtype)
    return x if d == x.dtype else x.to(d)


def _per_channel(x: torch.Tensor, q: Float8BlockQuantizer, fake_dtype: torch.dtype) -> QuantizedTensorStorage:
    """Per-output-channel FP8 E4M3 (compressed-tensors strategy "channel"): scale = 448 / amax(row)
    (fp32), q = sat_rne(x · scale), scale_inv = 1 / scale, held as rowwise 1×128 blocks sharing it."""
    shape = tuple(x.shape)
    m, k = flatten_2d(shape)
    x2 = x.reshape(m, k)
    lay = q.usage_layout(ROW)
    data = torch.empty(q.describe_buffers(shape)[lay.data].shape, dtype=torch.uint8)
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
    rs = q.scale_buffer(scale_inv[:, None], shape, ROW)  # each row's blocks share its scale
    return q.tensor_class(shape, fake_dtype, q, **{lay.data: data, lay.scale: rs})


def uniform_rows(t: QuantizedTensorStorage) -> bool:
    """Do all rowwise blocks of each row share one scale?"""
    g = t.quantizer.block_scales(t.buffers(), tuple(t.logical_shape), ROW)
    return bool((g == g[:, :1]).all()) if g.numel() else True


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
                                       out_q=representation("fp8_channel"),
                                       note="row blocks have different scales: requantized per channel")
            q = step.out_q
    if step.builder == "per_channel":
        plain = src if not isinstance(src, QuantizedTensorStorage) else x_fn()
        return _per_channel(plain, q, step.out_dtype), step
    if step.builder == "quantize":
        x = src if not isinstance(src, QuantizedTensorStorage) else x_fn()
        if step.data_dependent:
            q = q.settle(x)
            step = dataclasses.replace(step, out_q=q)
        try:
            return q.quantize(_quantize_input(x, q), fake_dtype=step.out_dtype, tensor_amax=step.tensor_amax), step
        except ShapeError as e:
            raise ConversionError(str(e)) from None
    # exact (possibly with some usages requantized)
    p, bufs = src.quantizer, src.buffers()
    out: dict[str, torch.Tensor] = {}
    for usage in q.conversion_usages():
        if usage not in step.requant:
            got = p.derive(bufs, shape, q, usage)
            if got is None:  # the format's exact rule depends on the bytes, and these break it
                step = dataclasses.replace(step, method="requantize", exact=False, requant=step.requant | {usage},
                                           note=(step.note + "; " if step.note else "") + f"{usage} usage: the "
                                           "source's values are not exactly representable: requantized")
            else:
                out.update(got)
    if step.data_dependent:
        q = q.settle(x_fn(), out)
        step = dataclasses.replace(step, out_q=q)
    if step.requant:
        qq = q.set_usage(rowwise=ROW in step.requant, columnwise=COL in step.requant)
        part = qq.quantize(_quantize_input(x_fn(), qq), fake_dtype=step.out_dtype, tensor_amax=step.tensor_amax)
        out.update(part.buffers())
    q.check_buffers(shape, out, where="converted tensor")
    return q.tensor_class(shape, step.out_dtype, q, **out), step


# --- grouped (MoE) weights: convert(..., grouped="keep" | "split" | "merge") -------------------------
# The rules (names, exact split and merge) are te_serial/formats/grouped.py's; this is the hook.

GROUPED_MODES = ("keep", "split", "merge")


def plan_grouped(mode: str, protos: dict[str, TensorProto], keep: frozenset[str] = frozenset()
                 ) -> dict[str, tuple[list[tuple[str, int | None]], bool]]:
    """Output name → (its sources ``(source name, member index or None)``, whether they are merged),
    in output order: ``split`` gives each expert of a grouped tensor ``<p>.experts.<proj>.<leaf>`` its
    own ``<p>.experts.<i>.<proj>.<leaf>``; ``merge`` packs such per-expert tensors back into one;
    ``keep`` maps every name to itself. Names in ``keep`` are never split."""
    from ..formats.grouped import plan_merge, plan_split
    if mode == "split":
        return {out: ([src], False) for out, src in plan_split(protos, keep).items()}
    if mode == "merge":
        return {out: ([(s, None) for s in srcs], srcs != [out]) for out, srcs in plan_merge(list(protos)).items()}
    if mode == "keep":
        return {name: ([(name, None)], False) for name in protos}
    raise ConversionError(f"grouped must be one of {GROUPED_MODES}, got {mode!r}")


def build_grouped(sources: list[tuple[str, int | None]], merged: bool,
                  load: Callable[[str, int | None], torch.Tensor]) -> torch.Tensor:
    """One output tensor of :func:`plan_grouped` from ``load(name, member)`` (e.g.
    ``Checkpoint.get(name, member=member)``, which reads only that expert): a member, a tensor
    passed through, or (``merged``) the listed experts packed exactly into a grouped tensor."""
    from ..formats.grouped import GroupedTensor
    if merged:
        return GroupedTensor.from_members([load(name, member) for name, member in sources])
    [(name, member)] = sources
    return load(name, member)
