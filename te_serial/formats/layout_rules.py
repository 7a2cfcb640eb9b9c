"""The layout rules every format gets from its ``usage_layout``: which usages are on, the valid
scale regions and block-scale grids, zeroed padding, codes and data buffers, relayouts between
layouts, and the slice alignment. A format declares ``usage_layout``; nothing here branches on
its kind."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import torch

from .. import numerics as nx
from .protocol import ROWWISE, USAGES, UsageLayout, flatten_2d

if TYPE_CHECKING:  # pragma: no cover
    from .base import Quantizer


def spread_scales(tiles: torch.Tensor, tile: tuple[int, int], grid: tuple[int, int],
                  grid_shape: tuple[int, int]) -> torch.Tensor:
    """Scales of ``tile``-sized blocks repeated over a finer ``grid`` (which divides the tile),
    cropped to ``grid_shape``: how a coarser block's scale becomes each of its cells' scale."""
    fr, fc = tile[0] // grid[0], tile[1] // grid[1]
    out = tiles.repeat_interleave(fr, dim=0) if fr > 1 else tiles
    out = out.repeat_interleave(fc, dim=1) if fc > 1 else out
    return out[: grid_shape[0], : grid_shape[1]]


class LayoutRules:
    """The rules that follow from a quantizer's ``usage_layout`` (mixed into ``Quantizer``)."""

    def usage_layout(self, usage: str) -> UsageLayout:
        raise NotImplementedError

    def usages_on(self) -> tuple[str, ...]:
        """The enabled usages, rowwise first."""
        return tuple(u for u in USAGES if self.has_usage(u))

    def has_usage(self, usage: str) -> bool:
        return self.rowwise if usage == ROWWISE else self.columnwise

    @property
    def scale_per_tensor(self) -> bool:
        """One scale for the whole tensor (per-tensor FP8)."""
        return self.usage_layout(ROWWISE).grid is None

    def same_layout(self, other: "Quantizer") -> bool:
        return self.layout_key() == other.layout_key()

    def usage_buffers(self, buffers: Mapping[str, torch.Tensor], usage: str) -> dict[str, torch.Tensor]:
        """The buffers holding ``usage`` (data, scale, amax), taken from ``buffers``."""
        lay = self.usage_layout(usage)
        return {n: buffers[n] for n in (lay.data, lay.scale, lay.amax) if n is not None}

    def grid_shape(self, shape, usage: str) -> tuple[int, int] | None:
        """[ceil(M / rows), ceil(K / cols)] of ``usage``'s scale grid; None for one tensor scale."""
        grid = self.usage_layout(usage).grid
        if grid is None:
            return None
        m, k = flatten_2d(tuple(shape))
        return -(-m // grid[0]), -(-k // grid[1])

    def valid_regions(self, shape) -> dict[str, tuple[int, int]]:
        """Scale buffer → (rows, cols) of its valid top-left region; the rest is zero padding.
        The one place these regions are computed."""
        out = {}
        for u in self.usages_on():
            lay, g = self.usage_layout(u), self.grid_shape(shape, u)
            if g is not None:
                out[lay.scale] = (g[1], g[0]) if lay.scale_transposed else g
        return out

    def zero_padding(self, buffers: Mapping[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
        """``buffers`` with every scale buffer's padding zero: shared where it already is, else a
        copy (TE leaves the padding uninitialized)."""
        out = dict(buffers)
        for name, (r, c) in self.valid_regions(shape).items():
            s = out.get(name)
            if s is None or tuple(s.shape) == (r, c):
                continue
            pad = s.clone()
            pad[r:] = 0
            pad[:, c:] = 0
            if not torch.equal(pad.view(torch.uint8), s.view(torch.uint8)):
                out[name] = pad
        return out

    def block_scales(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """``usage``'s stored scales on the grid [ceil(M / rows), ceil(K / cols)] (a view, stored
        dtype); [1, 1] for a per-tensor scale."""
        lay = self.usage_layout(usage)
        s, g = buffers[lay.scale], self.grid_shape(shape, usage)
        if g is None:
            return s.reshape(1, 1)
        return s[: g[1], : g[0]].t() if lay.scale_transposed else s[: g[0], : g[1]]

    def tile_scales(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """One scale per ``usage_layout(usage).block`` (block_scales thinned where tiles repeat)."""
        lay, g = self.usage_layout(usage), self.block_scales(buffers, shape, usage)
        if lay.tile is None or lay.grid is None:
            return g
        return g[:: lay.tile[0] // lay.grid[0], :: lay.tile[1] // lay.grid[1]]

    def scale_buffer(self, grid: torch.Tensor, shape, usage: str) -> torch.Tensor:
        """A zero-padded scale buffer of ``usage`` holding ``grid`` ([grid rows, grid cols], or
        anything that broadcasts to it)."""
        lay = self.usage_layout(usage)
        spec = self.describe_buffers(shape)[lay.scale]
        out = torch.zeros(spec.shape, dtype=spec.dtype, device=grid.device)
        g = self.grid_shape(shape, usage)
        if g is None:
            out.copy_(grid.reshape(out.shape))
        elif lay.scale_transposed:
            out[: g[1], : g[0]] = grid.t()
        else:
            out[: g[0], : g[1]] = grid
        return out

    def codes(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """``usage``'s element codes as [M, K] uint8 (a view of the data unless unpacked)."""
        lay = self.usage_layout(usage)
        m, k = flatten_2d(tuple(shape))
        rows, cols = (k, m) if lay.transposed else (m, k)
        d = buffers[lay.data].reshape(rows, cols // lay.pack)
        if lay.pack == 2:
            d = nx.unpack_fp4(d)
        return d.t() if lay.transposed else d

    def data_buffer(self, codes: torch.Tensor, shape, usage: str) -> torch.Tensor:
        """``usage``'s data buffer holding element codes [M, K] (inverse of :meth:`codes`)."""
        lay = self.usage_layout(usage)
        c = (codes.t() if lay.transposed else codes).contiguous()
        if lay.pack == 2:
            c = nx.pack_fp4(c)
        return c.reshape(self.describe_buffers(shape)[lay.data].shape)

    def relayout(self, buffers: Mapping[str, torch.Tensor], shape, out: "Quantizer", usage: str,
                 src_usage: str, grid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``out``'s ``usage`` buffers holding this tensor's ``src_usage`` codes, with scales ``grid``
        (on ``out``'s grid; default: the source's own block scales) and the source's amax."""
        lay, src = out.usage_layout(usage), self.usage_layout(src_usage)
        res = {lay.data: out.data_buffer(self.codes(buffers, shape, src_usage), shape, usage)}
        g = self.block_scales(buffers, shape, src_usage) if grid is None else grid
        res[lay.scale] = out.scale_buffer(g, shape, usage)
        if lay.amax is not None:
            res[lay.amax] = buffers[src.amax].clone()
        return res

    def slice_alignment(self) -> tuple[int, int]:
        """(rows, cols) that a slice's start, and its end unless it is the tensor's end, must be a
        multiple of: each enabled usage's scale block (``usage_layout.block``) and byte packing."""
        r = c = 1
        for u in self.usages_on():
            lay = self.usage_layout(u)
            br, bc = lay.block or (1, 1)
            r = math.lcm(r, br, lay.pack if lay.transposed else 1)
            c = math.lcm(c, bc, 1 if lay.transposed else lay.pack)
        return r, c
