"""TensorProto: a data-free prototype of a plain or quantized tensor that can rebuild it.

``create_tensor`` allocates through ``Quantizer.alloc_tensors`` and assembles through the storage
class's ``__tensor_unflatten__`` (found in the storage registry) — pure Python, so it traces under
``torch.compile(fullgraph=True)``. Its fields map 1:1 onto TE's ``TensorSpec``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch

from .dtypes import dtype_from_name, dtype_name
from .errors import FormatError, ShapeError
from .formats.protocol import BufferSpec, StorageMeta
from .formats.tensors import QuantizedTensorStorage
from .formats.base import Quantizer
from .te.interop import from_te, is_te_tensor


#: the most bytes torch can address in one tensor (its sizes and strides are int64)
MAX_TENSOR_BYTES = 2 ** 63 - 1


def addressable(shape: Sequence[int], itemsize: int) -> bool:
    """Whether torch can lay out a contiguous tensor of ``shape``: its storage size, counting each
    dimension as at least 1 as torch's stride calculation does, fits in int64. A zero dimension
    beside huge ones holds no bytes, yet overflows that calculation."""
    total = itemsize
    for d in shape:
        total *= max(d, 1)
        if total > MAX_TENSOR_BYTES:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class TensorProto:
    """Shape, nominal dtype, quantizer (None for a plain tensor), requires_grad and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    quantizer: Quantizer | None = None
    requires_grad: bool = False
    device: torch.device | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if 0 in self.shape and not addressable(self.shape, self.dtype.itemsize):  # holds nothing, yet
            raise ShapeError(f"shape {list(self.shape)} of {dtype_name(self.dtype)} is larger than torch can lay out "
                             "(storage size over 2^63 bytes, each dimension counted as at least 1)")
        if self.device is not None and not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))
        if self.quantizer is not None:
            self.quantizer.check_shape(self.shape)

    @property
    def is_quantized(self) -> bool:
        return self.quantizer is not None

    def buffer_specs(self) -> dict[str, BufferSpec]:
        """name → (shape, dtype) of each inner buffer; a plain tensor has none."""
        return self.quantizer.describe_buffers(self.shape) if self.quantizer is not None else {}

    def inner_names(self) -> list[str]:
        """Names ``__tensor_flatten__`` returns for such a tensor, in order."""
        return list(self.buffer_specs())

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's data occupies (all inner buffers for a quantized tensor)."""
        if self.quantizer is None:
            return math.prod(self.shape) * self.dtype.itemsize
        return sum(spec.nbytes for spec in self.buffer_specs().values())

    def create_metadata(self) -> StorageMeta:
        """The unflatten context (storage class name, quantizer, nominal dtype, requires_grad)."""
        if self.quantizer is None:
            raise FormatError("a plain TensorProto has no storage metadata")
        return self.quantizer.create_metadata(self.shape, self.dtype, self.requires_grad)

    def create_inner_tensors(self, device=None) -> dict[str, torch.Tensor]:
        """Uninitialized inner buffers on ``device`` (default: the proto's device)."""
        return self.quantizer.alloc_tensors(self.shape, device=device or self.device)

    def assemble(self, inner: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> torch.Tensor:
        """Build the tensor from its inner buffers (a mapping, or a list in ``inner_names`` order)."""
        if not isinstance(inner, dict) and not isinstance(inner, Mapping):
            inner = dict(zip(self.inner_names(), inner))
        meta = self.create_metadata()
        return QuantizedTensorStorage.__tensor_unflatten__(inner, meta, self.shape, None)

    def create_tensor(self, device=None) -> torch.Tensor:
        """An uninitialized tensor of this prototype (quantized: wrapper subclass over fresh buffers)."""
        device = device or self.device
        if self.quantizer is None:
            return torch.empty(self.shape, dtype=self.dtype, device=device,
                               requires_grad=self.requires_grad)
        return self.assemble(self.quantizer.alloc_tensors(self.shape, device=device))

    # --- manifest form ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """msgpack-ready fields (the device is not stored: the loader chooses it)."""
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "requires_grad": self.requires_grad,
                "quantizer": self.quantizer.to_dict() if self.quantizer is not None else None}

    @staticmethod
    def from_dict(data: Mapping[str, Any], device=None) -> "TensorProto":
        q = data.get("quantizer")
        return TensorProto(tuple(data["shape"]), dtype_from_name(data["dtype"]),
                           Quantizer.from_dict(q) if q is not None else None,
                           bool(data.get("requires_grad", False)), device)


def to_tensor_proto(t: torch.Tensor | QuantizedTensorStorage) -> TensorProto:
    """The prototype of a plain tensor, a te-serial quantized tensor or a bare storage, or a TE
    one (read by ``from_te``, which refuses TE's experimental classes)."""
    if is_te_tensor(t):
        t = from_te(t)
    if isinstance(t, QuantizedTensorStorage):
        if isinstance(t, torch.Tensor):
            return TensorProto(tuple(t.shape), t.dtype, t.quantizer, t.requires_grad, t.device)
        device = next(iter(t.buffers().values())).device
        return TensorProto(tuple(t.logical_shape), t.fake_dtype, t.quantizer, False, device)
    if isinstance(t, torch.Tensor):
        return TensorProto(tuple(t.shape), t.dtype, None, t.requires_grad, t.device)
    raise FormatError(f"to_tensor_proto needs a tensor, got {type(t).__name__}")
