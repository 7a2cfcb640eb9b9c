"""The storage and wrapper classes every format's tensors are: ``QuantizedTensorStorage`` (TE's
``*TensorStorage``: the inner buffers, flatten / unflatten, device moves, repr) and
``QuantizedTensor`` (a ``torch.Tensor`` wrapper subclass with a nominal dtype, and the dispatch
that keeps it quantized where it can, dequantizing for everything else)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch
from torch.utils._pytree import tree_map_only

from ..dtypes import dtype_name
from ..errors import BufferMismatchError, FormatError, UnsupportedOperationError
from .protocol import STORAGE_REGISTRY, StorageMeta, first_buffer, resolve_storage

if TYPE_CHECKING:  # pragma: no cover
    from .base import Quantizer


class QuantizedTensorStorage:
    """Holds a quantized tensor's inner buffers (TE's ``*TensorStorage``); not a torch.Tensor.

    Subclasses declare ``BUFFERS`` once; they are registered by class name in
    :data:`STORAGE_REGISTRY`, which is the only way ``__tensor_unflatten__`` finds a class.
    """

    BUFFERS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        other = STORAGE_REGISTRY.get(cls.__name__)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise FormatError(f"storage class name {cls.__name__!r} registered twice")
        STORAGE_REGISTRY[cls.__name__] = cls

    def __init__(self, shape, fake_dtype: torch.dtype, quantizer: Quantizer, *,
                 requires_grad: bool = False, **buffers: torch.Tensor | None) -> None:
        unknown = set(buffers) - set(self.BUFFERS)
        if unknown:
            raise BufferMismatchError(f"{type(self).__name__} has no buffer(s) {sorted(unknown)}")
        for name in self.BUFFERS:
            setattr(self, name, buffers.get(name))
        self._quantizer = quantizer
        self._fake_dtype = fake_dtype
        self._logical_shape = torch.Size(shape)

    # --- introspection ------------------------------------------------------------------------
    @property
    def quantizer(self) -> Quantizer:
        return self._quantizer

    @property
    def fake_dtype(self) -> torch.dtype:
        return self._fake_dtype

    @property
    def logical_shape(self) -> torch.Size:
        return self._logical_shape

    @property
    def usages(self) -> dict[str, bool]:
        return self._quantizer.get_usages()

    def get_usages(self) -> dict[str, bool]:
        return self.usages

    def buffers(self) -> dict[str, torch.Tensor]:
        """Present inner buffers, by TE attribute name, in flatten order."""
        return {n: getattr(self, n) for n in self.BUFFERS if getattr(self, n) is not None}

    def quantized_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers().values())

    def dequantize(self, dtype: torch.dtype | None = None, *, eager: bool | None = None) -> torch.Tensor:
        """The high-precision values (fp32 math, as TE), as ``dtype`` (default: nominal dtype);
        compiled where ``formats/fused.py``'s policy says so, ``eager=True`` forces the eager path."""
        return self._quantizer.dequantize_buffers(self.buffers(), self._logical_shape,
                                                  dtype or self._fake_dtype, eager=eager)

    # --- flatten protocol -----------------------------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], StorageMeta]:
        meta = StorageMeta(type(self).__name__, self._quantizer, self._fake_dtype,
                           bool(getattr(self, "requires_grad", False)))
        return [n for n in self.BUFFERS if getattr(self, n) is not None], meta

    @staticmethod
    def __tensor_unflatten__(inner: Mapping[str, torch.Tensor], meta: StorageMeta,
                             outer_size, outer_stride=None) -> "QuantizedTensorStorage":
        cls = resolve_storage(meta.storage)
        return cls(outer_size, meta.fake_dtype, meta.quantizer,
                   requires_grad=meta.requires_grad, **inner)

    def _rebuild(self, buffers: Mapping[str, torch.Tensor], **overrides: Any) -> "QuantizedTensorStorage":
        """Same class and metadata, other buffers (device moves, clones, detach)."""
        kwargs = dict(shape=self._logical_shape, fake_dtype=self._fake_dtype,
                      quantizer=self._quantizer)
        kwargs.update(overrides)
        return type(self)(kwargs.pop("shape"), kwargs.pop("fake_dtype"), kwargs.pop("quantizer"),
                          **kwargs, **buffers)

    def __repr__(self) -> str:
        bufs = ", ".join(f"{n}={dtype_name(b.dtype)}{list(b.shape)}" for n, b in self.buffers().items())
        device = first_buffer(self.buffers()).device
        return (f"{type(self).__name__}(shape={list(self._logical_shape)}, "
                f"dtype={dtype_name(self._fake_dtype)}, device={device}, "
                f"quantizer={self._quantizer!r}, {bufs})")


# --- the torch.Tensor wrapper subclass -------------------------------------------------------

_aten = torch.ops.aten


def _mutated_quantized_arg(func, args, kwargs) -> bool:
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, QuantizedTensor):
            return True
    return False


class QuantizedTensor(torch.Tensor):
    """A ``torch.Tensor`` wrapper subclass with a nominal high-precision dtype.

    Format classes are ``XTensor(XTensorStorage, QuantizedTensor)``, as in TE. Device moves,
    ``detach``, ``clone`` and ``copy_`` between equal formats keep the bytes; any other op
    sees the dequantized values (so ``F.linear(x, qweight)`` just works).
    """

    @staticmethod
    def __new__(cls, shape, fake_dtype: torch.dtype, quantizer: Quantizer, *,
                requires_grad: bool = False, **buffers: torch.Tensor | None):
        device = first_buffer(buffers).device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=fake_dtype, device=device,
                                                   requires_grad=requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        raise UnsupportedOperationError(
            f"{type(self).__name__} is not picklable by design; use te_serial.save_quantized")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _DISPATCH.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if _mutated_quantized_arg(func, args, kwargs):
            raise UnsupportedOperationError(
                f"{func} would modify a quantized tensor in place; dequantize it first")
        args, kwargs = tree_map_only(QuantizedTensor, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _detach(t: QuantizedTensor) -> QuantizedTensor:
    return t._rebuild(t.buffers())


def _clone(t: QuantizedTensor, *, memory_format=None) -> QuantizedTensor:
    return t._rebuild({n: b.clone() for n, b in t.buffers().items()})


#: nominal dtypes a quantized tensor can be cast to keeping its bytes (``.float()``, ``.half()``,
#: ``.bfloat16()``, ``.to(dtype)``, ``module.to(dtype)``): only what ``dequantize`` returns changes
NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _to_copy(t: QuantizedTensor, *, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    if dtype is not None and dtype != t.dtype and dtype not in NOMINAL_DTYPES:
        out = t.dequantize()  # an FP8 / integer cast: of the values
        return out.to(device=device or out.device, dtype=dtype, non_blocking=non_blocking)
    device = torch.device(device) if device is not None else t.device
    moved = {}
    for n, b in t.buffers().items():
        b = b.to(device=device, non_blocking=non_blocking, copy=True)
        moved[n] = b.pin_memory() if pin_memory and device.type == "cpu" else b
    return t._rebuild(moved, fake_dtype=dtype or t.dtype)  # a float cast: same bytes, new nominal dtype


def _copy_(dst, src, non_blocking=False):
    if isinstance(dst, QuantizedTensor):
        if dst.shape != src.shape:
            raise UnsupportedOperationError(f"copy_ between shapes {tuple(src.shape)} and {tuple(dst.shape)}")
        if not (isinstance(src, QuantizedTensor) and type(src) is type(dst)
                and src.quantizer == dst.quantizer):
            # Different formats (or plain source): requantize with the destination's quantizer.
            hp = src.dequantize() if isinstance(src, QuantizedTensorStorage) else src
            src = dst.quantizer.quantize(hp.to(device=dst.device), fake_dtype=dst.dtype)
        for name, b in dst.buffers().items():
            b.copy_(getattr(src, name), non_blocking=non_blocking)
        return dst
    return dst.copy_(src.dequantize(), non_blocking=non_blocking)


def _empty_like(t: QuantizedTensor, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    device = device if device is not None else t.device
    if dtype is not None and dtype != t.dtype:
        return torch.empty(t.shape, dtype=dtype, device=device)
    buffers = t.quantizer.alloc_tensors(t.shape, device=device)
    return t._rebuild(buffers)


def _view(t: QuantizedTensor, size):
    """``view`` to the tensor's own shape (``DTensor.from_local`` does ``view_as(self)``) is an
    alias with the same buffers; any other view sees the dequantized values."""
    size = list(size)
    if size.count(-1) == 1:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = t.numel() // known if known else 0
    if tuple(size) == tuple(t.shape):
        return _detach(t)
    return _aten.view.default(t.dequantize(), size)


def _new_empty(t: QuantizedTensor, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """An uninitialized quantized tensor of the same format when shape and dtype are kept (what
    checkpoint stagers ask before copying the buffers in); a plain tensor otherwise."""
    device = torch.device(device) if device is not None else t.device
    if (dtype is None or dtype == t.dtype) and tuple(size) == tuple(t.shape):
        return t._rebuild(t.quantizer.alloc_tensors(t.shape, device=device))
    return torch.empty(size, dtype=dtype or t.dtype, device=device)


_DISPATCH = {
    _aten.view.default: _view,
    _aten.new_empty.default: _new_empty,
    _aten.detach.default: _detach,
    _aten.alias.default: _detach,
    _aten.clone.default: _clone,
    _aten._to_copy.default: _to_copy,
    _aten.copy_.default: _copy_,
    _aten.empty_like.default: _empty_like,
}
