"""te-serial: pickle-free checkpoints and exact reconstruction for Transformer Engine quantized tensors.

The top level holds what users call. Storage and tensor classes, registries and the swizzle helpers
live in :mod:`te_serial.formats`; every error class in :mod:`te_serial.errors`; distributed
checkpoints in :mod:`te_serial.dcp`; weights handed to a serving engine in :mod:`te_serial.serving`.
"""

from ._version import __version__
from .errors import CheckpointError, TeSerialError
from .formats import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP4Quantizer,
                      MXFP4Tensor, MXFP4TensorStorage, MXFP8Quantizer, NVFP4Quantizer)
from .formats.slicing import slice_quantized
from .proto import TensorProto, to_tensor_proto
from .checkpoint import (Checkpoint, CheckpointWriter, load_quantized, read_protos, save_quantized,
                         verify)
# te_serial.open, as safetensors' safe_open; not in __all__, so `from te_serial import *` leaves the builtin
from .checkpoint import open_checkpoint as open  # noqa: A001
from .te.interop import from_te, to_te
from .te.spec import from_te_spec, to_te_spec
from .model import load_into, materialize, plan, quantize_model
from .conversion import convert
from .serving import export_tensors

__all__ = [
    "__version__",
    "save_quantized", "load_quantized", "read_protos", "verify", "convert", "export_tensors",
    "load_into", "quantize_model", "materialize", "plan", "Checkpoint", "CheckpointWriter",
    "TensorProto", "to_tensor_proto", "slice_quantized",
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
    "NVFP4Quantizer", "MXFP4Quantizer", "MXFP4Tensor", "MXFP4TensorStorage",
    "from_te", "to_te", "to_te_spec", "from_te_spec",
    "TeSerialError", "CheckpointError",
]
