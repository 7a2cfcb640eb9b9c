"""te-serial: pickle-free checkpoints and exact reconstruction for Transformer Engine quantized tensors."""

from .errors import (BufferMismatchError, CheckpointError, CheckpointFileError, ChecksumError,
                     FormatError, ManifestError, QuantizationError, ShapeError, TeSerialError,
                     TensorMismatchError, UnknownQuantizerError, UnknownStorageError,
                     UnsupportedOperationError, UnsupportedValueError, VersionError)
from .formats import (QUANTIZER_REGISTRY, STORAGE_REGISTRY, BufferSpec, Float8BlockQuantizer,
                      Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage,
                      Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor,
                      Float8TensorStorage, MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage,
                      NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage, QuantizedTensor,
                      QuantizedTensorStorage, Quantizer, StorageMeta, resolve_quantizer,
                      resolve_storage, swizzle_scales, unswizzle_scales)
from .proto import TensorProto, to_tensor_proto
from .formats.slicing import slice_quantized

from ._version import __version__

from .checkpoint import Checkpoint, load_quantized, read_protos, save_quantized, verify  # noqa: E402
from .checkpoint import open_checkpoint as open  # noqa: E402,A001
from .te_interop import from_te, is_te_tensor, to_te  # noqa: E402
from .model import LoadResult, Plan, load_into, materialize, plan, quantize_model  # noqa: E402
from .conversion import ConversionReport, convert  # noqa: E402

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
    "ManifestError", "VersionError", "CheckpointFileError", "TensorMismatchError", "ChecksumError",
    "UnsupportedValueError", "Checkpoint", "save_quantized", "load_quantized", "open", "read_protos",
    "verify", "from_te", "to_te", "is_te_tensor", "load_into", "quantize_model", "materialize", "plan",
    "Plan", "LoadResult", "convert", "ConversionReport", "slice_quantized",
]
