"""TE's GEMM-ready ("swizzled") scale layout for MXFP8 and NVFP4, and its inverse.

The padded rowwise scale matrix [Mp, Sp] (Mp % 128 == 0, Sp % 4 == 0) is cut into 128×4 tiles laid
out row-major; inside a tile, scale (r, c) sits at byte (r % 32) * 16 + (r // 32) * 4 + c
(``gemm_swizzled_scale_idx``, common/cast/mxfp8/swizzle.cuh). Columnwise scales are transposed
first and then swizzled the same way. te-serial stores compact scales; these helpers exist for
reading and writing TE tensors that carry ``with_gemm_swizzled_scales=True``.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError


def _check(scale: torch.Tensor) -> tuple[int, int]:
    if scale.dim() != 2 or scale.shape[0] % 128 or scale.shape[1] % 4:
        raise ShapeError(f"swizzling needs a padded [128·a, 4·b] scale matrix, got {tuple(scale.shape)}")
    return scale.shape[0], scale.shape[1]


def _swizzle_rowwise(scale: torch.Tensor) -> torch.Tensor:
    rows, cols = _check(scale)
    tiles = scale.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(rows, cols)


def _unswizzle_rowwise(swizzled: torch.Tensor) -> torch.Tensor:
    rows, cols = _check(swizzled)
    tiles = swizzled.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(rows, cols)


def swizzle_scales(scale: torch.Tensor, *, columnwise: bool = False) -> torch.Tensor:
    """Compact (padded) scales → GEMM-ready bytes, in a buffer of the same shape."""
    if not columnwise:
        return _swizzle_rowwise(scale)
    return _swizzle_rowwise(scale.t().contiguous()).reshape(scale.shape)


def unswizzle_scales(swizzled: torch.Tensor, *, columnwise: bool = False) -> torch.Tensor:
    """GEMM-ready bytes → compact (padded) scales: the inverse of :func:`swizzle_scales`."""
    if not columnwise:
        return _unswizzle_rowwise(swizzled)
    rows, cols = swizzled.shape
    return _unswizzle_rowwise(swizzled.reshape(cols, rows)).t().contiguous()
