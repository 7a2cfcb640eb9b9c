"""te-serial: pickle-free checkpoints and exact reconstruction for Transformer Engine quantized tensors."""

from .errors import (BufferMismatchError, CheckpointError, FormatError, QuantizationError,
                     ShapeError, TeSerialError, UnknownQuantizerError, UnknownStorageError,
                     UnsupportedOperationError)
from .formats import (QUANTIZER_REGISTRY, STORAGE_REGISTRY, BufferSpec, Float8BlockQuantizer,
                      Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage,
                      Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor,
                      Float8TensorStorage, MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage,
                      NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage, QuantizedTensor,
                      QuantizedTensorStorage, Quantizer, StorageMeta, resolve_quantizer,
                      resolve_storage, swizzle_scales, unswizzle_scales)
from .proto import TensorProto, to_tensor_proto

__version__ = "0.1.0"

__all__ = [
    "TeSerialError", "FormatError", "ShapeError", "BufferMismatchError", "UnknownQuantizerError",
    "UnknownStorageError", "QuantizationError", "UnsupportedOperationError", "CheckpointError",
    "Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
    "Float8BlockQuantizer", "NVFP4Quantizer",
    "QuantizedTensorStorage", "QuantizedTensor", "Float8TensorStorage", "Float8Tensor",
    "MXFP8TensorStorage", "MXFP8Tensor", "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensor",
    "NVFP4TensorStorage", "NVFP4Tensor", "BufferSpec", "StorageMeta", "QUANTIZER_REGISTRY",
    "STORAGE_REGISTRY", "resolve_quantizer", "resolve_storage", "swizzle_scales",
    "unswizzle_scales", "TensorProto", "to_tensor_proto", "__version__",
]
