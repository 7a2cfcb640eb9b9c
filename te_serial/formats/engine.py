"""The quantize engine every format runs: a format's numerics (``_prepare``, ``_quantize_rows``,
``_dequantize``) over the whole tensor, compiled where ``formats/fused.py`` says so, else eager over
chunks of whole 128-row groups placed into preallocated buffers; the dequantize, the same two ways."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, NamedTuple

import torch

from .. import numerics as nx
from ..errors import FormatError
from . import fused
from .protocol import USAGES, UsageLayout, first_buffer, flatten_2d
from .tensors import QuantizedTensorStorage

if TYPE_CHECKING:  # pragma: no cover
    from .base import Quantizer


class BlockAmax(NamedTuple):
    """|x| maxima (fp32) taken ahead of a compiled graph with its NaN check (``fused.nan_free_amaxes``):
    of the 1×b blocks ([M, K/b]) and the b×1 blocks ([M/b, K]) of the 2-D input."""
    rows: torch.Tensor
    cols: torch.Tensor
    b: int

    def of(self, rows: int, cols: int) -> torch.Tensor:
        """The maxima of the (1 × b), (b × 1) or (b × b) blocks."""
        if (rows, cols) == (1, self.b):
            return self.rows
        if (rows, cols) == (self.b, 1):
            return self.cols
        if (rows, cols) != (self.b, self.b):
            raise ValueError(f"no maxima of {rows}x{cols} blocks from {self.b}-element ones")
        m, kb = self.rows.shape
        return self.rows.reshape(m // self.b, self.b, kb).amax(dim=1)


def blocks_amax(x2: torch.Tensor, rows: int, cols: int, given: BlockAmax | None = None) -> torch.Tensor:
    """|x| maxima (fp32, NaN ignored) of the (rows × cols) blocks of a 2-D tensor,
    [ceil(M/rows), ceil(K/cols)], edge blocks over the elements that exist; from ``given`` where the
    compiled path took them ahead of its graph."""
    if given is not None:
        return given.of(rows, cols)
    m, k = x2.shape
    mb, kb = nx.ceil_div(m, rows), nx.ceil_div(k, cols)
    padded = nx.pad_to(x2, (mb * rows, kb * cols))  # zero padding never raises an amax
    return nx.nan_ignoring_amax(padded.reshape(mb, rows, kb, cols), dim=(1, 3))


class QuantizeEngine:
    """Quantize and dequantize from a format's numerics (mixed into ``Quantizer``)."""

    #: rows per chunk are a multiple of this (lcm of every format's block heights)
    ROW_GROUP: ClassVar[int] = 128
    #: target fp32 bytes of one chunk
    CHUNK_BYTES: ClassVar[int] = 1 << 20

    def fusable(self) -> bool:
        """Whether this quantizer's numerics are pure tensor functions that ``formats/fused.py`` may
        compile (bit-exactly); formats opt in."""
        return False

    def _kernel_args(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Fields that vary from tensor to tensor (delayed scaling's scale) as tensors, handed to
        ``_prepare``: inputs of a compiled kernel rather than constants that would recompile it."""
        return {}

    @staticmethod
    def _tensor_amax(x2: torch.Tensor, args: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """max|x2| (NaN ignored) as fp32: the one the compiled path took with its NaN check, handed
        in through ``args``, else computed here."""
        given = (args or {}).get(fused.TENSOR_AMAX)
        return given if given is not None else nx.nan_ignoring_amax(x2)

    def amax_block(self) -> int | None:
        """b where this format's numerics take the |x| maxima of 1×b and b×1 blocks: the compiled
        path then takes them ahead of its graph, with the NaN check, in one pass (``fused``), and
        hands them to ``_prepare`` in ``args`` (:meth:`_given_amax`)."""
        return None

    def _given_amax(self, args: Mapping[str, torch.Tensor] | None) -> BlockAmax | None:
        """The block maxima in ``args``, where the compiled path took them (else None: the format
        reduces its blocks itself)."""
        rows = (args or {}).get(fused.ROW_BLOCK_AMAX)
        return None if rows is None else BlockAmax(rows, args[fused.COL_BLOCK_AMAX], self.amax_block())

    def _prepare(self, x2: torch.Tensor, args: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Tensor-wide pass over the 2-D input [M, K] before the rows: (state for ``_quantize_rows``,
        whole-tensor buffers such as a per-tensor ``scale_inv`` or ``amax``, in their spec shapes).
        By default the state is the block maxima the compiled path took (:meth:`_given_amax`), if any."""
        return self._given_amax(args), {}

    def _quantize_rows(self, xc: torch.Tensor, state: Any) -> dict[str, torch.Tensor]:
        """Quantize whole 128-row groups ``xc`` [R, K] (a pure function): per enabled usage (see
        ``usage_layout``) its data, [R, K / pack] or if ``transposed`` [K, R / pack], and for a
        block-scaled usage its scale grid [R / grid rows, K / grid cols], never transposed; an
        ``amax_rows`` amax as [R]."""
        raise NotImplementedError

    def _parts(self) -> dict[str, tuple[str, UsageLayout]]:
        """Buffer name → (role, usage layout) for what ``_quantize_rows`` returns."""
        out = {}
        for u in self.usages_on():
            lay = self.usage_layout(u)
            out[lay.data] = ("data", lay)
            if lay.grid is not None:
                out[lay.scale] = ("scale", lay)
            if lay.amax is not None and lay.amax_rows:
                out[lay.amax] = ("amax", lay)
        return out

    def _quantize_2d(self, x2: torch.Tensor, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensor in one pass (what ``fused`` compiles): 2-D data, zero-padded scales."""
        specs = self.describe_buffers(tuple(x2.shape))
        state, out = self._prepare(x2, args)
        roles = self._parts()
        for name, part in self._quantize_rows(x2, state).items():
            role, lay = roles[name]
            if role == "scale":
                g = part.t() if lay.scale_transposed else part
                rows, cols = specs[name].shape
                part = nx.pad_to(g, specs[name].shape)
            out[name] = part.contiguous()
        return out

    def _place_rows(self, out: dict[str, torch.Tensor], parts: Mapping[str, torch.Tensor], r0: int,
                    m: int, k: int) -> None:
        """Write one chunk's ``_quantize_rows`` output (rows from ``r0``) into the buffers."""
        roles = self._parts()
        for name, part in parts.items():
            role, lay = roles[name]
            if role == "data":
                if lay.transposed:
                    n = part.shape[1]
                    out[name].view(k, m // lay.pack)[:, r0 // lay.pack: r0 // lay.pack + n] = part
                else:
                    out[name].view(m, k // lay.pack)[r0:r0 + part.shape[0]] = part
            elif role == "amax":
                out[name][r0:r0 + part.shape[0]] = part
            else:
                g0, (gr, gc) = r0 // lay.grid[0], part.shape
                if lay.scale_transposed:
                    out[name][:gc, g0:g0 + gr] = part.t()
                else:
                    out[name][g0:g0 + gr, :gc] = part

    def _quantize(self, x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers of ``x``: compiled over the whole tensor where ``fused`` says so, else eager
        over chunks of whole 128-row groups (cache-sized intermediates) into preallocated buffers.
        ``tensor_amax``: the amax to scale with in place of max|x| (:meth:`takes_tensor_amax`)."""
        shape = tuple(x.shape)
        m, k = flatten_2d(shape)
        specs = self.describe_buffers(shape)
        x2 = x.reshape(m, k)
        args = self._kernel_args(x.device)
        if tensor_amax is not None:
            args[fused.TENSOR_AMAX] = tensor_amax
        ahead = fused.nan_free_amaxes(x2, self.amax_block()) if fused.wants_fused(x.numel(), x.device,
                                                                                   self.fusable()) else None
        if ahead is not None:
            # detach: no view of x, whose strides would be guarded; a given amax stands
            got = fused.run(_quantize_whole, ("quantize", self.kind, x.device.type, x.dtype),
                            self, _blocked(x2.detach(), self.slice_alignment()), {**ahead, **args})
            if got is not None:  # FP8 data comes back typed (fast stores): the same bytes, viewed
                return {n: got[n].view(specs[n].dtype).reshape(specs[n].shape) for n in specs}
        out = {}
        for name, spec in specs.items():
            make = torch.empty if name.endswith(("_data", "_transpose")) else torch.zeros
            out[name] = make(spec.shape, dtype=spec.dtype, device=x.device)
        state, whole = self._prepare(x2, args)
        for name, t in whole.items():
            out[name].copy_(t)
        rows = max(self.ROW_GROUP, self.CHUNK_BYTES // (4 * max(k, 1)) // self.ROW_GROUP * self.ROW_GROUP)
        for r0 in range(0, m, rows):
            self._place_rows(out, self._quantize_rows(x2[r0:r0 + rows], state), r0, m, k)
        return out

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """fp32 values of ``shape`` from the buffers (a pure function; ``fused`` may compile it)."""
        raise NotImplementedError

    def dequantize_buffers(self, buffers: Mapping[str, torch.Tensor], shape, dtype: torch.dtype, *,
                           eager: bool | None = None) -> torch.Tensor:
        """The values the buffers hold, as ``dtype`` (fp32 math, as TE): compiled where ``fused``
        says so, else eager."""
        shape = torch.Size(shape)
        bad = self.refused_value(buffers)
        if bad is not None:
            raise FormatError(f"{self.layout_name()} tensor of shape {tuple(shape)}: buffer {bad[0]}: {bad[1]}")
        device = first_buffer(buffers).device
        if fused.wants_fused(math.prod(shape), device, self.fusable(), eager):
            m, k = flatten_2d(tuple(shape))
            (a, b), blocked = self.slice_alignment(), False
            flat = dict(buffers)  # data as 2-D [M, K / pack] or [K, M / pack]: one graph for any rank
            for u in USAGES:
                lay = self.usage_layout(u)
                if lay.data in flat:
                    rows, cols, ra, ca = (k, m, b, a) if lay.transposed else (m, k, a, b)
                    d = flat[lay.data].reshape(rows, cols // lay.pack).detach()
                    flat[lay.data] = _blocked(d, (ra, max(1, ca // lay.pack)))
                    blocked = blocked or flat[lay.data].dim() == 4
            got = fused.run(_dequantize_whole, ("dequantize", self.kind, device.type, dtype),
                            self, flat, None if blocked else (m, k), dtype)
            if got is not None:
                return got.reshape(shape)
        return self._dequantize(dict(buffers), shape).to(dtype)

    def quantize(self, x: torch.Tensor, *, fake_dtype: torch.dtype | None = None,
                 internal: bool = False, eager: bool | None = None,
                 tensor_amax: float | torch.Tensor | None = None) -> "QuantizedTensorStorage":
        """Quantize ``x`` with TE's numerics; a wrapper tensor (or bare storage if ``internal``).
        Compiled where ``formats/fused.py``'s policy says so; ``eager=True`` forces the eager path.
        ``tensor_amax`` (formats whose :meth:`takes_tensor_amax`): scale with this amax, at least
        max|x| (a fused group's shared one), in place of max|x|."""
        if isinstance(x, QuantizedTensorStorage):
            x = x.dequantize(eager=eager)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise FormatError(f"{type(self).__name__}.quantize needs a floating-point tensor, "
                              f"got {getattr(x, 'dtype', type(x))}")
        shape = tuple(x.shape)
        self.check_shape(shape)
        given = None
        if tensor_amax is not None:
            if not self.takes_tensor_amax():
                raise FormatError(f"{type(self).__name__} ({self.layout_name()}) has no tensor-wide amax to "
                                  "share: tensor_amax= applies to per-tensor FP8 current scaling and NVFP4")
            given = torch.as_tensor(tensor_amax, dtype=torch.float32).reshape(()).to(x.device)
            if not float(given) >= 0:  # NaN or negative; an infinite amax is TE's too (an inf in the group)
                raise FormatError(f"tensor_amax must be >= 0, got {float(given)}")
        with fused.policy("eager") if eager else contextlib.nullcontext():
            buffers = self._quantize(x.detach(), given)
        cls = self.storage_class if internal else self.tensor_class
        return cls(shape, fake_dtype or x.dtype, self, **buffers)

    __call__ = quantize



def _blocked(x2: torch.Tensor, align: tuple[int, int]) -> torch.Tensor:
    """[M, K] as the view [M / a, a, K / b, b] when (a, b) divide it, else as it is. A compiled
    graph then sees M = a·s0 and K = b·s1: block counts are exact symbols, so its kernels index
    blocks without modulo arithmetic and vectorize (with M and K alone, inductor cannot prove
    K == 16·(K // 16), and NVFP4's cast ran scalar, 20× slower)."""
    (m, k), (a, b) = x2.shape, align
    if m % a or k % b or a * b == 1:
        return x2
    x4 = x2.view(m // a, a, k // b, b)
    torch._dynamo.mark_static(x4, 1)  # a and b are constants of the graph, not symbols
    torch._dynamo.mark_static(x4, 3)
    return x4


def _quantize_whole(q: Quantizer, x: torch.Tensor, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``fused`` compiles for quantize: the format's own numerics over the whole 2-D tensor
    (given as :func:`_blocked` gives it)."""
    if x.dim() == 4:
        x = x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3])
    return q._quantize_2d(x, args)


def _dequantize_whole(q: Quantizer, buffers: dict[str, torch.Tensor], shape: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """What ``fused`` compiles for dequantize: the format's ``_dequantize`` and the cast to ``dtype``.
    Data given as :func:`_blocked` gives it sets the shape ``None`` stands for (block counts as symbols)."""
    buffers = dict(buffers)
    for u in USAGES:
        lay = q.usage_layout(u)
        d = buffers.get(lay.data)
        if d is not None and d.dim() == 4:
            d = buffers[lay.data] = d.reshape(d.shape[0] * d.shape[1], d.shape[2] * d.shape[3])
            if shape is None:
                rows, cols = d.shape[0], d.shape[1] * lay.pack
                shape = (cols, rows) if lay.transposed else (rows, cols)
    return q._dequantize(buffers, torch.Size(shape)).to(dtype)
