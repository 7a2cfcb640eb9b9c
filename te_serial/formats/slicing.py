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
and NVFP4's tensor amax (``_amax_rowwise`` / ``_amax_columnwise``). A per-row amax (row-scaled
NVFP4, ``UsageLayout.amax_rows``) is sliced with the rows and kept whole along the columns. Every
other buffer equals the range quantized on its own.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import torch

from ..errors import FormatError, ShapeError
from .tensors import QuantizedTensorStorage
from .base import Quantizer
from .protocol import flatten_2d

Range = tuple[int, int] | slice | None
#: a box in a region view: (offsets, sizes), one int per dim
Box = tuple[tuple[int, ...], tuple[int, ...]]


def range_bounds(r: Range, n: int, align: int, what: str) -> tuple[int, int]:
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


def region_views(q: Quantizer, shape) -> dict[str, tuple[int, ...]]:
    """Buffer → its **region view**: the array in which the part of the buffer that a block-aligned
    range of rows × cols holds is one box (see :func:`buffer_regions`), in flatten order.

    Data: [M, K / pack] ([K, M / pack] when stored transposed), a reshape of the buffer. A scale
    with a block grid: its valid region (stored orientation; the rest of the buffer is padding). A
    per-row amax: [M]. A tensor-wide buffer (one scale for the whole tensor, an amax): its own shape.
    """
    shape = tuple(int(s) for s in shape)
    specs = q.describe_buffers(shape)
    m, k = flatten_2d(shape)
    valid = q.valid_regions(shape)
    out = {n: tuple(spec.shape) for n, spec in specs.items()}
    for usage in q.usages_on():
        lay = q.usage_layout(usage)
        out[lay.data] = (k, m // lay.pack) if lay.transposed else (m, k // lay.pack)
        if lay.scale in valid:
            out[lay.scale] = tuple(valid[lay.scale])
        if lay.amax_rows:
            out[lay.amax] = (m,)
    return out


def storage_view(stored_shape, view) -> tuple[int, ...]:
    """The shape to view a whole stored buffer as, so that its region view ``view`` is the box at
    the origin: ``view`` itself when it holds every element (a reshape), else the stored 2-D shape
    (the region view is its top-left corner; the rest is zero padding)."""
    stored_shape, view = tuple(stored_shape), tuple(view)
    return view if math.prod(view) == math.prod(stored_shape) else stored_shape


def buffer_regions(q: Quantizer, shape, rows: Range = None, cols: Range = None) -> dict[str, Box]:
    """Buffer → the box (offsets, sizes in its :func:`region_views` view) that the block-aligned
    range ``rows`` × ``cols`` of a tensor of ``shape`` holds, in flatten order.

    Data: the range itself (columns / rows divided by the packing); gridded scales: the block grid
    cells the range covers; a per-row amax: the rows; tensor-wide buffers: the whole buffer
    (every range holds it).
    Unaligned or empty ranges raise :class:`~te_serial.ShapeError` naming the block.
    """
    shape = tuple(int(s) for s in shape)
    m, k = flatten_2d(shape)
    ra, ca = q.slice_alignment()
    r0, r1 = range_bounds(rows, m, ra, "rows")
    c0, c1 = range_bounds(cols, k, ca, "cols")
    if q.is_container:  # a range of whole members: their parts of the packed buffers
        return q.member_boxes((r0, r1))
    views = region_views(q, shape)
    out: dict[str, Box] = {n: ((0,) * len(v), v) for n, v in views.items()}
    for usage in q.usages_on():
        lay = q.usage_layout(usage)
        p = lay.pack
        if lay.transposed:
            out[lay.data] = ((c0, r0 // p), (c1 - c0, -(-r1 // p) - r0 // p))
        else:
            out[lay.data] = ((r0, c0 // p), (r1 - r0, -(-c1 // p) - c0 // p))
        if lay.grid is not None:
            gr, gc = lay.grid
            a0, a1, b0, b1 = r0 // gr, -(-r1 // gr), c0 // gc, -(-c1 // gc)
            out[lay.scale] = ((b0, a0), (b1 - b0, a1 - a0)) if lay.scale_transposed else ((a0, b0), (a1 - a0, b1 - b0))
        if lay.amax_rows:
            out[lay.amax] = ((r0,), (r1 - r0,))
    return out


def box_to_range(shape, offsets, sizes) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((r0, r1), (c0, c1)) in TE's 2-D view [M, K] of the box ``offsets`` / ``sizes`` of a tensor
    of ``shape`` (≥ 1 dim), or None when the box is not one range of rows × cols (its leading
    dims must be contiguous once flattened: fixed indices, then one partial dim, then full dims)."""
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(sizes)
    if not shape:
        return None
    c = (offsets[-1], offsets[-1] + sizes[-1])
    lead, lo, ls = shape[:-1], offsets[:-1], sizes[:-1]
    d = len(lead)
    while d > 0 and lo[d - 1] == 0 and ls[d - 1] == lead[d - 1]:
        d -= 1  # trailing full dims
    if d == 0:
        return (0, math.prod(lead)), c
    if any(s != 1 for s in ls[:d - 1]):
        return None
    inner = math.prod(lead[d:])
    r0 = 0
    for i in range(d):
        r0 = r0 * lead[i] + lo[i]
    r0 *= inner
    return (r0, r0 + ls[d - 1] * inner), c


def slice_from_regions(q: Quantizer, shape, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The buffers of a tensor of ``shape`` from each buffer's whole region view (``pieces``, as
    :func:`region_views` shapes them): data reshaped (a view where it can be), scales placed at the
    top left of a zero-padded buffer, tensor-wide buffers copied."""
    return _place(_placement(q, tuple(int(s) for s in shape)), pieces)


def _narrow(t: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (o, s) in enumerate(zip(*box)):
        t = t.narrow(dim, o, s)
    return t


def slice_buffers(q: Quantizer, buffers: Mapping[str, torch.Tensor], shape, rows: Range = None,
                  cols: Range = None) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """(shape, buffers) of the block-aligned range ``rows`` × ``cols`` of a tensor quantized by ``q``.

    The shape is ``(rows, cols)`` when ``rows`` is given, else the leading dims are kept. Data
    buffers are views of the parent where the range is contiguous; scale and amax buffers are
    new (grids compact and zero-padded). Built from :func:`buffer_regions` (the one rule).
    """
    shape = tuple(int(s) for s in shape)
    m, k = flatten_2d(shape)
    (r0, r1), (c0, c1) = range_bounds(rows, m, 1, "rows"), range_bounds(cols, k, 1, "cols")
    new_shape, cuts, placed = _slice_plan(q, shape, None if rows is None else (r0, r1), (c0, c1))
    pieces = {}
    for name, (full, box) in cuts.items():
        pieces[name] = _narrow(buffers[name].reshape(full), box)
    return new_shape, _place(placed, pieces)


@functools.lru_cache(maxsize=1024)
def _slice_plan(q: Quantizer, shape: tuple[int, ...], rows: tuple[int, int] | None, cols: tuple[int, int]):
    """What slicing a tensor of ``shape`` by ``rows`` × ``cols`` does to each buffer, from the format's
    rules alone (the same for every expert of a stack, so worked out once): (new shape, buffer →
    (the parent's view to cut it from, the box), the new buffers' placement for :func:`_place`)."""
    boxes = buffer_regions(q, shape, rows, cols)
    new_shape = (*shape[:-1], cols[1] - cols[0]) if rows is None else (rows[1] - rows[0], cols[1] - cols[0])
    q.describe_buffers(new_shape)  # the format's shape rule (ShapeError)
    specs, views = q.describe_buffers(shape), region_views(q, shape)
    cuts = {name: (storage_view(specs[name].shape, views[name]), box) for name, box in boxes.items()}
    return new_shape, cuts, _placement(q, new_shape)


def _placement(q: Quantizer, shape) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]]:
    """Buffer → (its region view, its stored shape, the whole-buffer view it is placed in, is data)
    for a tensor of ``shape``: what :func:`slice_from_regions` builds the buffers from."""
    specs = q.describe_buffers(tuple(shape))
    views = region_views(q, shape)
    data = {q.usage_layout(u).data for u in q.usages_on()}
    return {name: (views[name], tuple(spec.shape), storage_view(spec.shape, views[name]), name in data)
            for name, spec in specs.items()}


def _place(placed, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (view, stored, full, is_data) in placed.items():
        piece = pieces[name]
        if tuple(piece.shape) != view:
            raise ShapeError(f"buffer {name} region is {list(piece.shape)}, expected {list(view)}")
        if is_data:
            out[name] = piece.contiguous().reshape(stored)
            continue
        nbytes = piece.dtype.itemsize
        buf = torch.zeros((*full[:-1], full[-1] * nbytes), dtype=torch.uint8, device=piece.device).view(piece.dtype)
        buf[tuple(slice(0, v) for v in view)] = piece
        out[name] = buf.reshape(stored)
    return out


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


def _row_dim(q: Quantizer) -> dict[str, int | None]:
    """Buffer → the dim of its region view along which the tensor's rows run (None: the buffer
    holds the whole tensor: a per-tensor scale, a tensor amax)."""
    out: dict[str, int | None] = {}
    for usage in q.usages_on():
        lay = q.usage_layout(usage)
        out[lay.data] = 1 if lay.transposed else 0
        out.setdefault(lay.scale, None if lay.grid is None else (1 if lay.scale_transposed else 0))
        if lay.amax is not None:
            out.setdefault(lay.amax, 0 if lay.amax_rows else None)
    return out


def cat_rows(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)``, without the copy when ``dim`` is 0 and the parts are contiguous,
    consecutive pieces of one storage (a grouped tensor's members, one quantize's rows): then a view
    spanning them."""
    first = parts[0]
    if dim == 0 and len(parts) > 1 and all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
                                           and p.shape[1:] == first.shape[1:] for p in parts):
        storage = first.untyped_storage()
        end = first.data_ptr()
        for p in parts:
            if p.untyped_storage().data_ptr() != storage.data_ptr() or p.data_ptr() != end:
                break
            end += p.numel() * p.element_size()
        else:
            rows = sum(p.shape[0] for p in parts)
            return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
    return torch.cat(list(parts), dim=dim)


def check_row_join(q: Quantizer, row_counts) -> None:
    """Raise :class:`~te_serial.FormatError` unless parts of these row counts stack exactly: every part
    but the last ends on the format's row blocks (``slice_alignment``)."""
    align = q.slice_alignment()[0]
    for i, m in enumerate(list(row_counts)[:-1]):
        if m % align:
            raise FormatError(f"part {i} has {m} rows, not a multiple of {q.layout_name()}'s row blocks of {align}: "
                              "stacked, its last block would mix rows of two parts (requantizing)")


def stacks_flat(q: Quantizer, shape, count: int) -> bool:
    """Are ``count`` tensors of ``shape`` (2-D), stacked by rows, buffer by buffer one after another,
    the buffers of their rows joined (:func:`join_rows`) as they are? So where every buffer runs along
    the rows in its first dim and has no padding, and the rows end on the format's row blocks."""
    m, k = flatten_2d(tuple(int(d) for d in shape))
    if count > 1 and m % q.slice_alignment()[0]:
        return False
    along, views = _row_dim(q), region_views(q, (m, k))
    specs, whole = q.describe_buffers((m, k)), q.describe_buffers((count * m, k))
    return all(along.get(n) == 0 and tuple(views[n]) == tuple(spec.shape) and len(spec.shape) >= 1
               and tuple(whole[n].shape) == (count * spec.shape[0], *spec.shape[1:]) for n, spec in specs.items())


def join_rows(q: Quantizer, parts) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    """(shape, buffers) of the tensors ``parts`` (``(shape, buffers)`` pairs of one quantizer, equal
    column counts) stacked along rows, exactly: the inverse of slicing by rows (a fused gate/up
    weight from its gate and up). Every part but the last must end on the format's row blocks
    (``slice_alignment``), and what holds the whole tensor (a per-tensor scale, a tensor amax) must
    be equal in every part; else :class:`~te_serial.FormatError` names the rule (stacking would
    requantize)."""
    parts = [(tuple(int(d) for d in s), b) for s, b in parts]
    if not parts:
        raise FormatError("join_rows needs at least one part")
    dims = [flatten_2d(s) for s, _ in parts]
    k = dims[0][1]
    if any(kk != k for _, kk in dims):
        raise ShapeError(f"parts to stack by rows have different column counts {[kk for _, kk in dims]}")
    check_row_join(q, [m for m, _ in dims])
    shape = (sum(m for m, _ in dims), k)
    specs = q.describe_buffers(shape)
    along = _row_dim(q)
    layouts = {s: (region_views(q, s), q.describe_buffers(s)) for s in {s for s, _ in parts}}  # per distinct shape
    pieces = {}
    for name, spec in specs.items():
        regions = []
        for s, bufs in parts:
            views, stored = layouts[s]
            view = views[name]
            full = storage_view(stored[name].shape, view)
            regions.append(_narrow(bufs[name].reshape(full), ((0,) * len(view), view)))
        dim = along.get(name)
        if dim is None:
            first = regions[0].contiguous().view(torch.uint8)
            for i, r in enumerate(regions[1:], 1):
                if not torch.equal(r.contiguous().view(torch.uint8), first):
                    raise FormatError(f"buffer {name} holds the whole tensor and differs between part 0 and part {i} "
                                      f"(a tensor-wide scale or amax): stacking them would requantize")
            pieces[name] = regions[0]
        else:
            pieces[name] = cat_rows(regions, dim)
    return shape, slice_from_regions(q, shape, pieces)
