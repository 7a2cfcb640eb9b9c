"""The protocol every format shares, and the registries: usages, buffer specs, usage layouts,
storage metadata, the quantizer and storage registries, and the shape helpers the formats' rules
use. A leaf of ``formats/``: the quantizer base (``base``), its layout rules (``layout_rules``), its
quantize engine (``engine``) and the tensor classes (``tensors``) build on it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

import torch

from .. import numerics as nx
from ..dtypes import dtype_name
from ..errors import BufferMismatchError, FormatError, ShapeError, UnknownQuantizerError, UnknownStorageError

if TYPE_CHECKING:  # pragma: no cover
    from .base import Quantizer
    from .tensors import QuantizedTensorStorage

ROWWISE, COLUMNWISE = "rowwise", "columnwise"
USAGES = (ROWWISE, COLUMNWISE)


class BufferSpec(NamedTuple):
    """Shape and dtype of one inner buffer (no data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class UsageLayout(NamedTuple):
    """Where one usage's bytes sit, in TE's 2-D view [M, K] of the logical tensor.

    ``grid`` is the (rows, cols) span of one stored scale (None: one scale for the whole tensor);
    ``tile`` the span one scale value is computed over when larger (2-D modes repeat a tile's
    scale over its grid cells). Data is stored as [M, K] or, ``transposed``, as [K, M]
    (``(S[-1], *S[:-1])``), with ``pack`` elements per byte along its last dim. The scale grid
    [ceil(M / rows), ceil(K / cols)] sits at the top left of the scale buffer, transposed if
    ``scale_transposed``; the rest of the buffer is zero padding. The ``amax`` buffer holds one
    fp32 value for the whole tensor, or with ``amax_rows`` one per row of [M, K] (row-scaled
    NVFP4), which a slice of rows slices too.
    """

    data: str
    scale: str
    amax: str | None = None
    grid: tuple[int, int] | None = None
    tile: tuple[int, int] | None = None
    transposed: bool = False
    scale_transposed: bool = False
    pack: int = 1
    amax_rows: bool = False

    @property
    def block(self) -> tuple[int, int] | None:
        """The span one scale value covers (``tile`` if set, else ``grid``)."""
        return self.tile or self.grid


class StorageMeta(NamedTuple):
    """The non-tensor half of ``__tensor_flatten__``: everything unflatten needs besides buffers."""

    storage: str                # registry name of the storage / wrapper class
    quantizer: "Quantizer"
    fake_dtype: torch.dtype     # the nominal high-precision dtype
    requires_grad: bool = False


#: kind → quantizer class; filled by ``Quantizer.__init_subclass__``.
QUANTIZER_REGISTRY: dict[str, type["Quantizer"]] = {}


#: class name → storage or wrapper class; filled by ``QuantizedTensorStorage.__init_subclass__``.
STORAGE_REGISTRY: dict[str, type["QuantizedTensorStorage"]] = {}


def resolve_quantizer(kind: str) -> type["Quantizer"]:
    """The quantizer class registered under ``kind``; nothing outside the registry resolves."""
    try:
        return QUANTIZER_REGISTRY[kind]
    except (KeyError, TypeError):
        raise UnknownQuantizerError(
            f"unknown quantizer kind {kind!r}; registered: {sorted(QUANTIZER_REGISTRY)}") from None


def resolve_storage(name: str) -> type["QuantizedTensorStorage"]:
    """The storage class registered under ``name``; nothing outside the registry resolves."""
    try:
        return STORAGE_REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownStorageError(
            f"unknown storage class {name!r}; registered: {sorted(STORAGE_REGISTRY)}") from None


def flatten_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """TE's 2-D view of a tensor: M = prod(shape[:-1]), K = shape[-1]."""
    return math.prod(shape[:-1]), shape[-1]


def require_divisible(shape: tuple[int, ...], block: int, fmt: str) -> None:
    """The MXFP8 / NVFP4 rule: both TE dims (M, K) divisible by the block size."""
    m, k = flatten_2d(shape)
    if m % block or k % block:
        raise ShapeError(f"{fmt} needs both dims divisible by {block} (M = prod(shape[:-1]), "
                         f"K = shape[-1]); got shape {tuple(shape)} with M={m}, K={k}")


_SHORT_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_short_name(dtype: torch.dtype) -> str:
    """``e4m3`` / ``e5m2`` for layout names."""
    return _SHORT_FP8.get(dtype) or dtype_name(dtype)


def require_fp8_dtype(q: "Quantizer") -> None:
    """Refuse a quantizer whose ``fp8_dtype`` is not one of TE's two FP8 formats."""
    if q.fp8_dtype not in nx.FP8_DTYPES:
        raise FormatError(f"{type(q).__name__}: fp8_dtype must be one of {nx.FP8_DTYPES}, got {q.fp8_dtype}")


#: checks for the annotated types of quantizer fields, as read from a file
FIELD_TYPES = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def encode_field(value: Any) -> Any:
    """A quantizer field's value as a file holds it (a torch dtype by its name)."""
    return dtype_name(value) if isinstance(value, torch.dtype) else value


def first_buffer(buffers: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    """The first buffer that is present (a quantized tensor's device is its buffers')."""
    for b in buffers.values():
        if b is not None:
            return b
    raise BufferMismatchError("a quantized tensor needs at least one inner buffer")
