"""Named recipes: the short names users type (``"mxfp8"``, ``"nvfp4_2d"`` …) → weight quantizers.

One table, used by the CLI, the demo, the benchmarks, and later by model quantization and
conversion. Each entry is the quantizer TE's recipe would use for a linear layer's weight.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import FormatError
from .formats import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                      MXFP4Quantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

RECIPES: dict[str, tuple[str, Callable[..., Quantizer]]] = {
    "fp8_delayed": ("per-tensor FP8 E4M3, delayed scaling (scale 1.0)",
                    lambda **kw: Float8Quantizer(1.0, 0.0, E4M3, **kw)),
    "fp8_current": ("per-tensor FP8 E4M3, current scaling",
                    lambda **kw: Float8CurrentScalingQuantizer(E4M3, **kw)),
    "fp8_current_e5m2": ("per-tensor FP8 E5M2, current scaling",
                         lambda **kw: Float8CurrentScalingQuantizer(E5M2, **kw)),
    "mxfp8": ("MXFP8 E4M3, 1x32 blocks, E8M0 scales",
              lambda **kw: MXFP8Quantizer(E4M3, **kw)),
    "mxfp8_2d": ("MXFP8 E4M3, 32x32 tiles",
                 lambda **kw: MXFP8Quantizer(E4M3, with_2d_quantization=True, **kw)),
    "fp8_block_1d": ("FP8 blockwise E4M3, 1x128 blocks, pow-2 fp32 scales",
                     lambda **kw: Float8BlockQuantizer(E4M3, block_scaling_dim=1, **kw)),
    "fp8_block": ("FP8 blockwise E4M3, 128x128 tiles, pow-2 fp32 scales",
                  lambda **kw: Float8BlockQuantizer(E4M3, block_scaling_dim=2, **kw)),
    "mxfp4": ("MXFP4 E2M1, 1x32 blocks, E8M0 scales (no TE class: TE's reference numerics)",
              lambda **kw: MXFP4Quantizer(**kw)),
    "nvfp4": ("NVFP4 E2M1, 1x16 blocks, E4M3 scales + fp32 amax",
              lambda **kw: NVFP4Quantizer(**kw)),
    "nvfp4_2d": ("NVFP4 E2M1, 16x16 tiles (TE's weight recipe)",
                 lambda **kw: NVFP4Quantizer(with_2d_quantization=True, **kw)),
    "nvfp4_4over6": ("NVFP4 4over6: 16x16 tiles each map-to-4 or map-to-6 by MAE, E4M3 bound 256 "
                     "(TE's weight recipe with nvfp4_4over6)",
                     lambda **kw: NVFP4Quantizer(with_2d_quantization=True, nvfp4_use_4over6=True,
                                                 nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MAE", **kw)),
    "nvfp4_row_scaled": ("NVFP4 row-scaled: one fp32 amax per row, 1x16 blocks; rowwise only (TE's "
                         "row-scaled kernels make no columnwise copy: a columnwise request is dropped)",
                         lambda rowwise=True, columnwise=True: NVFP4Quantizer(row_scaled_nvfp4=True,
                                                                              rowwise=True, columnwise=False)),
}


def recipe_quantizer(name: str, *, rowwise: bool = True, columnwise: bool = True) -> Quantizer:
    """The weight quantizer of the recipe called ``name``."""
    try:
        _, make = RECIPES[name]
    except KeyError:
        raise FormatError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}") from None
    return make(rowwise=rowwise, columnwise=columnwise)
