"""The quantizer base every format builds on, from four rooms with one job each:

* ``protocol`` — usages, buffer specs, usage layouts, storage metadata, the registries;
* ``layout_rules`` — what follows from a format's ``usage_layout``: valid scale regions, block-scale
  grids, zeroed padding, relayouts, slice alignment (:class:`~.layout_rules.LayoutRules`);
* ``engine`` — the quantize engine: compiled or chunked eager runs of the format's numerics
  (:class:`~.engine.QuantizeEngine`);
* ``tensors`` — the storage and wrapper classes and their dispatch.

``Quantizer`` here is what a format declares once and everything else follows from: its fields
(immutable, compared by value, ``to_dict`` / ``from_dict`` through the registry), its buffers'
``_buffer_specs(shape)``, its ``usage_layout``, its numerics (``_prepare``, ``_quantize_rows``,
``_dequantize``) and its exact-conversion rules (``exact_output`` / ``derivable`` / ``derive``).
Nothing outside ``formats/`` needs to know a format's kind.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from ..dtypes import dtype_from_name, dtype_name
from ..errors import BufferMismatchError, FormatError, ShapeError
from .engine import QuantizeEngine
from .layout_rules import LayoutRules
from .protocol import (FIELD_TYPES, QUANTIZER_REGISTRY, ROWWISE, BufferSpec, StorageMeta, UsageLayout,
                       encode_field, resolve_quantizer)

if TYPE_CHECKING:  # pragma: no cover
    from .tensors import QuantizedTensor, QuantizedTensorStorage


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantizer(LayoutRules, QuantizeEngine):
    """Base of te-serial's quantizers: immutable, compared and hashed by value.

    ``rowwise`` / ``columnwise`` choose which usages (TE's GEMM directions) are produced.
    """

    rowwise: bool = True
    columnwise: bool = True

    #: stable registry name written into checkpoints
    kind: ClassVar[str] = ""
    #: fields added by a later minor format version: written only when not at their default
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset()
    #: field → the format version (major, minor) that added it, for every field added after 1.0: a
    #: manifest of an older version holding the field is refused (schema/README.md §10)
    FIELD_VERSIONS: ClassVar[Mapping[str, tuple[int, int]]] = {}
    #: the format version (major, minor) that added this quantizer kind: a manifest of an older
    #: version naming it is refused (schema/README.md §10)
    KIND_VERSION: ClassVar[tuple[int, int]] = (1, 0)
    #: class returned by ``quantize(internal=True)`` and ``quantize()`` respectively
    storage_class: ClassVar[type["QuantizedTensorStorage"]]
    tensor_class: ClassVar[type["QuantizedTensor"]]
    #: a container of member tensors (grouped MoE weights): read whole or one member at a time,
    #: never sliced by rows or columns
    is_container: ClassVar[bool] = False
    #: fields holding torch dtypes (serialized by name)
    _dtype_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind:
            if kind in QUANTIZER_REGISTRY and QUANTIZER_REGISTRY[kind].__qualname__ != cls.__qualname__:
                raise FormatError(f"quantizer kind {kind!r} registered twice")
            QUANTIZER_REGISTRY[kind] = cls

    def __post_init__(self) -> None:
        if not (self.rowwise or self.columnwise):
            raise FormatError(f"{type(self).__name__} needs at least one of rowwise/columnwise")

    # --- usages (TE names) -------------------------------------------------------------------
    @property
    def rowwise_usage(self) -> bool:
        return self.rowwise

    @property
    def columnwise_usage(self) -> bool:
        return self.columnwise

    def get_usages(self) -> dict[str, bool]:
        return {"rowwise": self.rowwise, "columnwise": self.columnwise}

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> "Quantizer":
        """A copy with other usages (quantizers are immutable: itself where they are the same)."""
        if (rowwise is None or rowwise == self.rowwise) and (columnwise is None or columnwise == self.columnwise):
            return self
        return dataclasses.replace(
            self, rowwise=self.rowwise if rowwise is None else rowwise,
            columnwise=self.columnwise if columnwise is None else columnwise)

    def copy(self) -> "Quantizer":
        return self

    # --- the format's one shape rule ----------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise :class:`ShapeError` if this format cannot hold a tensor of ``shape``."""
        if len(shape) < 1:
            raise ShapeError(f"{type(self).__name__} needs a tensor with at least one dim, "
                             f"got shape {tuple(shape)}")

    def _buffer_specs(self, shape: tuple[int, ...]) -> dict[str, BufferSpec]:
        raise NotImplementedError

    def describe_buffers(self, shape) -> dict[str, BufferSpec]:
        """name → (shape, dtype) of each inner buffer for a tensor of ``shape``, in flatten order."""
        shape = tuple(int(s) for s in shape)
        self.check_shape(shape)
        return self._buffer_specs(shape)

    def value_dtypes(self) -> dict[str, torch.dtype]:
        """What each buffer's bytes mean (``float8_e4m3fn``, ``float8_e8m0fnu`` …): the dtype a
        checkpoint stores it as, so generic readers see it. Same item size as the buffer dtype."""
        raise NotImplementedError

    def alloc_tensors(self, shape, device=None) -> dict[str, torch.Tensor]:
        """Uninitialized inner buffers for a tensor of ``shape`` (pure Python; traceable)."""
        return {name: torch.empty(spec.shape, dtype=spec.dtype, device=device)
                for name, spec in self.describe_buffers(shape).items()}

    def create_metadata(self, shape, dtype: torch.dtype, requires_grad: bool = False) -> StorageMeta:
        """The unflatten context for a wrapper tensor of ``shape`` with nominal ``dtype``."""
        self.check_shape(tuple(shape))
        return StorageMeta(self.tensor_class.__name__, self, dtype, requires_grad)

    def nbytes(self, shape) -> int:
        """Bytes of all inner buffers for a tensor of ``shape``."""
        return sum(spec.nbytes for spec in self.describe_buffers(shape).values())

    def check_buffers(self, shape, buffers: Mapping[str, torch.Tensor | None], *,
                      where: str = "tensor") -> None:
        """Raise :class:`BufferMismatchError` unless ``buffers`` is exactly what this quantizer makes."""
        specs = self.describe_buffers(shape)
        present = {n: b for n, b in buffers.items() if b is not None}
        if set(present) != set(specs):
            raise BufferMismatchError(
                f"{where}: {type(self).__name__} for shape {tuple(shape)} has buffers "
                f"{sorted(specs)}, got {sorted(present)}")
        for name, spec in specs.items():
            b = present[name]
            if tuple(b.shape) != spec.shape or b.dtype != spec.dtype:
                raise BufferMismatchError(
                    f"{where}: buffer {name} should be {dtype_name(spec.dtype)}{list(spec.shape)}, "
                    f"got {b.dtype}{list(b.shape)}")

    # --- the format's rules (the protocol every format implements) -----------------------------
    #: adapter to TE's own classes (``formats/te_adapter.py``), set when the format registers one
    te_adapter: ClassVar[Any] = None
    #: whether Transformer Engine has a tensor class for this format (MXFP4 has none in TE 2.20): a
    #: format with one registers a TE adapter; ``to_te`` and TE's ``TensorSpec`` refuse one without
    has_te_class: ClassVar[bool] = True
    #: holds tensor state (delayed scaling's scale and amax) that a conversion fills from the data
    data_dependent: ClassVar[bool] = False

    def usage_layout(self, usage: str) -> UsageLayout:
        """Where ``usage``'s data, scales and amax sit (whether or not this quantizer makes it)."""
        raise NotImplementedError

    def layout_key(self) -> tuple:
        """What gives the bytes their meaning: kind and layout fields (not usages, not how scales
        were chosen). Equal keys mean a buffer of one is a valid buffer of the other."""
        return (self.kind, *(getattr(self, f.name) for f in dataclasses.fields(self)
                             if f.name not in ("rowwise", "columnwise")))

    def layout_name(self) -> str:
        """A descriptive name of the layout for reports, e.g. ``mxfp8_2d_e4m3``."""
        return self.kind

    def default_usages(self) -> tuple[bool, bool]:
        """(rowwise, columnwise) a recipe target gets for a tensor of this format, unless told: its own."""
        return self.rowwise, self.columnwise

    def for_target(self, target: "Quantizer") -> "Quantizer":
        """The quantizer a tensor of this format gets when a recipe names ``target``: ``target``
        itself, except for containers (a grouped tensor keeps its members, each in ``target``)."""
        return target

    def serving_form(self, rep: "Quantizer") -> "Quantizer":
        """``rep`` (a serving layout scheme's representation) in the form that holds this format's
        bytes, where the layouts state this format's second level as it is (their global scale is
        amax / divisor, any divisor): NVFP4 with another E4M3 bound (4over6's 256, as ModelOpt
        writes it). ``rep`` itself otherwise."""
        return rep

    def exact_output(self, target: "Quantizer") -> "Quantizer | None":
        """The quantizer of an exact (or partly exact) conversion from this format into ``target``'s
        format and usages, or None. The source's format declares its exact paths here."""
        if self.same_layout(target):
            return dataclasses.replace(self, rowwise=target.rowwise, columnwise=target.columnwise)
        if target.takes_exact_values:
            return target
        return None

    def of_whole(self, shape) -> "Quantizer":
        """The quantizer of the whole tensor of ``shape`` whose shard this quantizer describes (a DTensor's
        local tensor): this one; a grouped stack's shard holds fewer members than the whole."""
        return self

    def member_format(self) -> "Quantizer":
        """The quantizer the tensor's values are quantized with: this one; a container's members'."""
        return self

    def data_buffers(self) -> frozenset[str]:
        """The buffers holding element codes (the bulk), as opposed to scales and amaxes."""
        return frozenset(self.usage_layout(u).data for u in self.usages_on())

    def conversion_usages(self) -> tuple[str, ...]:
        """The usages a conversion builds one by one (:meth:`derive`): the enabled ones; a container's
        are its members'."""
        return self.usages_on()

    def derivable(self, out: "Quantizer", usage: str) -> bool:
        """Can ``usage`` of ``out`` (from :meth:`exact_output`) be built from this tensor's bytes
        (for some bytes: :meth:`derive` may find these do not allow it)?"""
        if out.takes_exact_values and not self.same_layout(out):
            return True
        return self.has_usage(usage)

    def derive(self, buffers: Mapping[str, torch.Tensor], shape, out: "Quantizer",
               usage: str) -> dict[str, torch.Tensor] | None:
        """``usage``'s buffers of the ``out`` tensor, built from this tensor's bytes (``derivable``);
        None where an exact rule that depends on the bytes does not hold for these (the conversion
        then requantizes that usage and reports it lossy)."""
        if out.takes_exact_values and not self.same_layout(out):
            return out.exact_from_values(self.usage_values(buffers, shape, usage), usage)
        return self.usage_buffers(buffers, usage)

    def derives_by_table(self, out: "Quantizer", usage: str) -> bool:
        """Whether :meth:`derive` builds ``usage`` of ``out`` by a fixed table that gives each stored
        (code, block scale) the same value (MXFP4 codes as their E4M3 bytes under the same scale): exact
        for any bytes, so a conversion need not compare the values element by element."""
        return False

    #: as a conversion target, holds any source's values exactly where they are representable,
    #: decided per tensor from the values (:meth:`exact_from_values`: MXFP4)
    takes_exact_values: ClassVar[bool] = False

    def exact_from_values(self, values: torch.Tensor, usage: str) -> dict[str, torch.Tensor] | None:
        """``usage``'s buffers holding fp32 ``values`` bit for bit, or None where this format cannot
        (formats that :attr:`takes_exact_values`)."""
        return None

    def usage_values(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """fp32 values of ``usage`` (the other usage where this tensor lacks it)."""
        u = usage if self.has_usage(usage) else self.usages_on()[0]
        q = self.set_usage(rowwise=u == ROWWISE, columnwise=u != ROWWISE)
        return q.dequantize_buffers({n: buffers[n] for n in q.describe_buffers(shape)}, shape, torch.float32)

    def refused_value(self, buffers: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
        """(buffer name, why) where ``buffers`` hold a value this format never writes and no reader
        decodes (MXFP4's E8M0 NaN scale byte), else None: reading and dequantizing refuse such a tensor."""
        return None

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype TE's kernel takes an input of ``dtype`` in (NVFP4's RHT casts to BF16)."""
        return dtype

    def global_scale_divisor(self) -> float | None:
        """For a two-level format whose second level is the stored tensor amax (``usage_layout(u).amax``):
        the divisor D in ``value = code × block scale × (amax / D)``. Exporters write the
        tensor-wide factor in their own layout's convention from it. None: no second level."""
        return None

    def takes_tensor_amax(self) -> bool:
        """Whether one tensor-wide amax sets this format's scale (per-tensor FP8 current scaling,
        NVFP4's global scale). ``quantize(x, tensor_amax=a)`` then quantizes with ``a`` in place of
        max|x|: tensors a serving engine fuses into one GEMM share one scale that way."""
        return False

    def shares_fused_scale(self) -> bool:
        """Whether serving engines need every member of a fused group (q/k/v, gate/up:
        :mod:`te_serial.fusion`) in this format to hold the same tensor scale, because they apply
        one to the fused GEMM as they find it (NVFP4's global scale: vLLM takes the members'
        largest and serves the others wrong). False where the format has no tensor-wide scale, or
        where engines requantize the members to their largest scale themselves at load: an export
        then keeps the bytes of members copied with their own scales."""
        return False

    def recorded_tensor_amax(self, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The tensor amax a quantized tensor was made with, where its buffers record it (NVFP4's
        rowwise amax), as a 0-d fp32 tensor; None where they do not."""
        return None

    def deterministic(self) -> "Quantizer":
        """This quantizer in a mode ``quantize`` reproduces (NVFP4: rounding to nearest)."""
        return self

    def settle(self, x: torch.Tensor, buffers: Mapping[str, torch.Tensor] | None = None) -> "Quantizer":
        """This quantizer with its tensor state filled in for values ``x`` (and, when given, the
        ``buffers`` an exact path built); only ``data_dependent`` formats change."""
        return self

    # --- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-ready fields: ``{"kind": ..., field: value}`` with dtypes by name. Fields a
        later format version added (:attr:`LATER_FIELDS`) are left out at their defaults, so an older
        reader still reads every tensor that does not use them."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.LATER_FIELDS and value == f.default:
                continue
            out[f.name] = encode_field(value)
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Quantizer":
        """Rebuild a quantizer from :meth:`to_dict`'s output, through the registry only."""
        if not isinstance(data, Mapping):
            raise FormatError(f"quantizer must be a mapping, got {type(data).__name__}")
        cls = resolve_quantizer(data.get("kind"))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"kind"}
        if unknown:
            raise FormatError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in data.items():
            if k == "kind":
                continue
            if k in cls._dtype_fields:
                v = dtype_from_name(v)
            elif not FIELD_TYPES.get(types[k], lambda _: True)(v):
                raise FormatError(f"{cls.__name__} field {k} must be {types[k]}, got {v!r}")
            kwargs[k] = v
        try:
            q = cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise FormatError(f"bad fields for {cls.__name__}: {e}") from None
        q._check_fields(data)
        return q

    def _check_fields(self, data: Mapping[str, Any]) -> None:
        """Raise :class:`FormatError` where the fields as written (``data``) break a rule the built
        quantizer cannot see (it may have derived a field from another): none by default."""
