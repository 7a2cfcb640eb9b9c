"""TE's quantized formats in pure PyTorch: one module per format, the shared machinery in protocol,
layout_rules, engine, tensors and base."""

from .protocol import (COLUMNWISE, QUANTIZER_REGISTRY, ROWWISE, STORAGE_REGISTRY, BufferSpec, StorageMeta,
                       UsageLayout, resolve_quantizer, resolve_storage)
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .blockwise import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage
from .grouped import GroupedQuantizer, GroupedTensor, GroupedTensorStorage
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage
from .mxfp4 import MXFP4Quantizer, MXFP4Tensor, MXFP4TensorStorage
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage
from .slicing import slice_quantized
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "QUANTIZER_REGISTRY", "STORAGE_REGISTRY", "BufferSpec", "QuantizedTensor",
    "QuantizedTensorStorage", "Quantizer", "StorageMeta", "resolve_quantizer", "resolve_storage",
    "UsageLayout", "ROWWISE", "COLUMNWISE", "slice_quantized",
    "Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage",
    "Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Tensor", "Float8TensorStorage",
    "MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage",
    "MXFP4Quantizer", "MXFP4Tensor", "MXFP4TensorStorage",
    "GroupedQuantizer", "GroupedTensor", "GroupedTensorStorage",
    "NVFP4Quantizer", "NVFP4Tensor", "NVFP4TensorStorage",
    "swizzle_scales", "unswizzle_scales",
]
