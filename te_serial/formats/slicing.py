"""Block-aligned slices of quantized tensors, from each format's ``usage_layout``.

Rows count over the leading dims flattened (TE's 2-D view: M = prod(shape[:-1]), K = shape[-1]).
A range must start on a multiple of the quantizer's ``slice_alignment()`` and end on one or at
the tensor's end (a partial last block). Alignment per format, from its enabled usages:

* per-tensor FP8: any range;
* MXFP8: 32 in both dims (also in 32×32 mode); NVFP4: 16 in both dims (columnwise data packs
  two rows per byte, which 16 covers);
* blockwise 1×128: rowwise blocks run along K, so rows are free and columns align to 128;
  the columnwise copy's blocks run along M, so it needs rows aligned to 128 and leaves columns
  free; with both usages both align to 128. 128×128: 128 in both dims.

Formats whose scale depends on the whole tensor keep the parent's: per-tensor FP8's scale_inv
and NVFP4's tensor amax (``_amax_rowwise`` / ``_amax_columnwise``). Every other buffer equals the
range quantized on its own.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..errors import FormatError, ShapeError
from .base import QuantizedTensorStorage, Quantizer, flatten_2d

__all__ = ["slice_quantized", "slice_buffers"]

Range = tuple[int, int] | slice | None


def _bounds(r: Range, n: int, align: int, what: str) -> tuple[int, int]:
    """(start, stop) of ``r`` within ``n``, refusing empty, out-of-range or unaligned ranges."""
    if r is None:
        return 0, n
    if isinstance(r, slice):
        if r.step not in (None, 1):
            raise ShapeError(f"{what} slice needs step 1, got {r.step}")
        start, stop = r.start, r.stop
    else:
        try:
            start, stop = r
        except (TypeError, ValueError):
            raise ShapeError(f"{what} must be a (start, stop) pair or a slice, got {r!r}") from None
    start = 0 if start is None else int(start)
    stop = n if stop is None else int(stop)
    start, stop = start + n if start < 0 else start, stop + n if stop < 0 else stop
    if not 0 <= start < stop <= n:
        raise ShapeError(f"{what} range [{start}, {stop}) is empty or outside [0, {n})")
    if start % align or (stop % align and stop != n):
        raise ShapeError(f"{what} range [{start}, {stop}) is not aligned to this format's blocks of "
                         f"{align} (start a multiple of {align}, stop too or the end {n})")
    return start, stop


def slice_buffers(q: Quantizer, buffers: Mapping[str, torch.Tensor], shape, rows: Range = None,
                  cols: Range = None) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """(shape, buffers) of the block-aligned range ``rows`` × ``cols`` of a tensor quantized by ``q``.

    The shape is ``(rows, cols)`` when ``rows`` is given, else the leading dims are kept. Data
    buffers are views of the parent where the range is contiguous; scale and amax buffers are
    new (grids compact and zero-padded).
    """
    shape = tuple(int(s) for s in shape)
    m, k = flatten_2d(shape)
    ra, ca = q.slice_alignment()
    r0, r1 = _bounds(rows, m, ra, "rows")
    c0, c1 = _bounds(cols, k, ca, "cols")
    new_shape = (*shape[:-1], c1 - c0) if rows is None else (r1 - r0, c1 - c0)
    specs = q.describe_buffers(new_shape)  # the format's shape rule (ShapeError)
    out: dict[str, torch.Tensor] = {}
    for usage in q.usages_on():
        lay = q.usage_layout(usage)
        p = lay.pack
        if lay.transposed:
            d = buffers[lay.data].reshape(k, m // p)[c0:c1, r0 // p: -(-r1 // p)]
        else:
            d = buffers[lay.data].reshape(m, k // p)[r0:r1, c0 // p: -(-c1 // p)]
        out[lay.data] = d.contiguous().reshape(specs[lay.data].shape)
        if lay.grid is None:
            out[lay.scale] = buffers[lay.scale].clone()
        else:
            gr, gc = lay.grid
            grid = q.block_scales(buffers, shape, usage)[r0 // gr: -(-r1 // gr), c0 // gc: -(-c1 // gc)]
            out[lay.scale] = q.scale_buffer(grid, new_shape, usage)
        if lay.amax is not None:
            out[lay.amax] = buffers[lay.amax].clone()
    return new_shape, out


def slice_quantized(t: QuantizedTensorStorage, *, rows: Range = None, cols: Range = None) -> QuantizedTensorStorage:
    """The quantized tensor of a block-aligned range of ``t``: same class and quantizer, its own
    compact zero-padded scales, shape ``(nrows, ncols)`` (or ``t``'s leading dims when ``rows`` is
    None).

    ``rows`` / ``cols`` are ``(start, stop)`` pairs or step-1 slices over TE's 2-D view
    (rows = leading dims flattened). Each buffer equals that range quantized on its own, except
    where the scale depends on the whole tensor: per-tensor FP8 keeps the parent's scale_inv and
    NVFP4 the parent's tensor amax. A range off the format's blocks raises
    :class:`~te_serial.ShapeError` naming the block size (see ``Quantizer.slice_alignment``).
    Data buffers may share memory with ``t``.
    """
    if not isinstance(t, QuantizedTensorStorage):
        raise FormatError(f"slice_quantized needs a te-serial quantized tensor, got {type(t).__name__}")
    q = t.quantizer
    shape, bufs = slice_buffers(q, t.buffers(), tuple(t.logical_shape), rows, cols)
    return type(t)(shape, t.fake_dtype, q, **bufs)
