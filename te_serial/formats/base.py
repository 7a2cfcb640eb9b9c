"""What every format shares: quantizer base, buffer specs, registries, storage and wrapper classes.

A format module declares three things once and everything else follows from them here:

* its storage class's ``BUFFERS`` (TE's inner buffer attribute names, in flatten order),
* its quantizer's ``_buffer_specs(shape)`` (the one place its buffer shapes and dtypes are written),
* its quantizer's numerics, pure tensor functions: ``_prepare`` (tensor-wide quantities such as
  a per-tensor amax), ``_quantize_rows`` (whole 128-row groups → each usage's data and scale grid,
  placed into the buffers here from ``usage_layout``) and ``_dequantize``;
* its rules (the protocol below): ``usage_layout`` (where each usage's data, scales and amax sit),
  ``layout_key`` / ``layout_name`` (what defines the bytes), ``exact_output`` / ``derivable`` /
  ``derive`` (which usages and formats it converts to exactly) and ``te_adapter`` (TE's classes).

Valid scale regions, block scale grids, slicing and relayouts follow from ``usage_layout`` here,
so nothing outside ``formats/`` needs to know a format's kind.

The same numerics run two ways (``formats/fused.py`` chooses): compiled by ``torch.compile`` over
the whole tensor (a few fused loops), or eager over chunks of whole 128-row groups (every format's
blocks fit inside one), so intermediates stay cache-sized: on CPU that is several times faster
than whole-tensor eager ops, whose fresh allocations are bound by page faults.

Allocation (``alloc_tensors``), validation (``check_buffers``), flatten/unflatten, device moves,
``repr`` and the registries are generic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, ClassVar, Mapping, NamedTuple

import torch
from torch.utils._pytree import tree_map_only

from .. import numerics as nx
from . import fused
from ..dtypes import dtype_from_name, dtype_name
from ..errors import (BufferMismatchError, FormatError, ShapeError, UnknownQuantizerError,
                      UnknownStorageError, UnsupportedOperationError)

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


class BlockAmax(NamedTuple):
    """|x| maxima (fp32) taken ahead of a compiled graph with its NaN check (``fused.nan_free_amaxes``):
    of the 1×b blocks ([M, K/b]) and the b×1 blocks ([M/b, K]) of the 2-D input."""
    rows: torch.Tensor
    cols: torch.Tensor
    b: int

    def of(self, rows: int, cols: int) -> torch.Tensor:
        """The maxima of the (1 × b), (b × 1) or (b × b) blocks."""
        if (rows, cols) == (1, self.b):
            return self.rows
        if (rows, cols) == (self.b, 1):
            return self.cols
        if (rows, cols) != (self.b, self.b):
            raise ValueError(f"no maxima of {rows}x{cols} blocks from {self.b}-element ones")
        m, kb = self.rows.shape
        return self.rows.reshape(m // self.b, self.b, kb).amax(dim=1)


def blocks_amax(x2: torch.Tensor, rows: int, cols: int, given: BlockAmax | None = None) -> torch.Tensor:
    """|x| maxima (fp32, NaN ignored) of the (rows × cols) blocks of a 2-D tensor,
    [ceil(M/rows), ceil(K/cols)], edge blocks over the elements that exist; from ``given`` where the
    compiled path took them ahead of its graph."""
    if given is not None:
        return given.of(rows, cols)
    m, k = x2.shape
    mb, kb = nx.ceil_div(m, rows), nx.ceil_div(k, cols)
    padded = nx.pad_to(x2, (mb * rows, kb * cols))  # zero padding never raises an amax
    return nx.nan_ignoring_amax(padded.reshape(mb, rows, kb, cols), dim=(1, 3))


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


def spread_scales(tiles: torch.Tensor, tile: tuple[int, int], grid: tuple[int, int],
                  grid_shape: tuple[int, int]) -> torch.Tensor:
    """Scales of ``tile``-sized blocks repeated over a finer ``grid`` (which divides the tile),
    cropped to ``grid_shape``: how a coarser block's scale becomes each of its cells' scale."""
    fr, fc = tile[0] // grid[0], tile[1] // grid[1]
    out = tiles.repeat_interleave(fr, dim=0) if fr > 1 else tiles
    out = out.repeat_interleave(fc, dim=1) if fc > 1 else out
    return out[: grid_shape[0], : grid_shape[1]]


_SHORT_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_short_name(dtype: torch.dtype) -> str:
    """``e4m3`` / ``e5m2`` for layout names."""
    return _SHORT_FP8.get(dtype) or dtype_name(dtype)


def require_fp8_dtype(q: "Quantizer") -> None:
    """Refuse a quantizer whose ``fp8_dtype`` is not one of TE's two FP8 formats."""
    if q.fp8_dtype not in nx.FP8_DTYPES:
        raise FormatError(f"{type(q).__name__}: fp8_dtype must be one of {nx.FP8_DTYPES}, got {q.fp8_dtype}")


#: checks for the annotated types of quantizer fields, as read from a file
_FIELD_TYPES = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _encode_field(value: Any) -> Any:
    return dtype_name(value) if isinstance(value, torch.dtype) else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantizer:
    """Base of te-serial's quantizers: immutable, compared and hashed by value.

    ``rowwise`` / ``columnwise`` choose which usages (TE's GEMM directions) are produced.
    """

    rowwise: bool = True
    columnwise: bool = True

    #: stable registry name written into checkpoints
    kind: ClassVar[str] = ""
    #: fields added by a later minor format version: written only when not at their default
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset()
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
        """A copy with other usages (quantizers are immutable)."""
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
        return None

    def derivable(self, out: "Quantizer", usage: str) -> bool:
        """Can ``usage`` of ``out`` (from :meth:`exact_output`) be built from this tensor's bytes?"""
        return self.has_usage(usage)

    def derive(self, buffers: Mapping[str, torch.Tensor], shape, out: "Quantizer",
               usage: str) -> dict[str, torch.Tensor]:
        """``usage``'s buffers of the ``out`` tensor, built from this tensor's bytes (``derivable``)."""
        return self.usage_buffers(buffers, usage)

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

    # --- rules that follow from usage_layout ---------------------------------------------------
    def usages_on(self) -> tuple[str, ...]:
        """The enabled usages, rowwise first."""
        return tuple(u for u in USAGES if self.has_usage(u))

    def has_usage(self, usage: str) -> bool:
        return self.rowwise if usage == ROWWISE else self.columnwise

    @property
    def scale_per_tensor(self) -> bool:
        """One scale for the whole tensor (per-tensor FP8)."""
        return self.usage_layout(ROWWISE).grid is None

    def same_layout(self, other: "Quantizer") -> bool:
        return self.layout_key() == other.layout_key()

    def usage_buffers(self, buffers: Mapping[str, torch.Tensor], usage: str) -> dict[str, torch.Tensor]:
        """The buffers holding ``usage`` (data, scale, amax), taken from ``buffers``."""
        lay = self.usage_layout(usage)
        return {n: buffers[n] for n in (lay.data, lay.scale, lay.amax) if n is not None}

    def grid_shape(self, shape, usage: str) -> tuple[int, int] | None:
        """[ceil(M / rows), ceil(K / cols)] of ``usage``'s scale grid; None for one tensor scale."""
        grid = self.usage_layout(usage).grid
        if grid is None:
            return None
        m, k = flatten_2d(tuple(shape))
        return -(-m // grid[0]), -(-k // grid[1])

    def valid_regions(self, shape) -> dict[str, tuple[int, int]]:
        """Scale buffer → (rows, cols) of its valid top-left region; the rest is zero padding.
        The one place these regions are computed."""
        out = {}
        for u in self.usages_on():
            lay, g = self.usage_layout(u), self.grid_shape(shape, u)
            if g is not None:
                out[lay.scale] = (g[1], g[0]) if lay.scale_transposed else g
        return out

    def zero_padding(self, buffers: Mapping[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
        """``buffers`` with every scale buffer's padding zero: shared where it already is, else a
        copy (TE leaves the padding uninitialized)."""
        out = dict(buffers)
        for name, (r, c) in self.valid_regions(shape).items():
            s = out.get(name)
            if s is None or tuple(s.shape) == (r, c):
                continue
            pad = s.clone()
            pad[r:] = 0
            pad[:, c:] = 0
            if not torch.equal(pad.view(torch.uint8), s.view(torch.uint8)):
                out[name] = pad
        return out

    def block_scales(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """``usage``'s stored scales on the grid [ceil(M / rows), ceil(K / cols)] (a view, stored
        dtype); [1, 1] for a per-tensor scale."""
        lay = self.usage_layout(usage)
        s, g = buffers[lay.scale], self.grid_shape(shape, usage)
        if g is None:
            return s.reshape(1, 1)
        return s[: g[1], : g[0]].t() if lay.scale_transposed else s[: g[0], : g[1]]

    def tile_scales(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """One scale per ``usage_layout(usage).block`` (block_scales thinned where tiles repeat)."""
        lay, g = self.usage_layout(usage), self.block_scales(buffers, shape, usage)
        if lay.tile is None or lay.grid is None:
            return g
        return g[:: lay.tile[0] // lay.grid[0], :: lay.tile[1] // lay.grid[1]]

    def scale_buffer(self, grid: torch.Tensor, shape, usage: str) -> torch.Tensor:
        """A zero-padded scale buffer of ``usage`` holding ``grid`` ([grid rows, grid cols], or
        anything that broadcasts to it)."""
        lay = self.usage_layout(usage)
        spec = self.describe_buffers(shape)[lay.scale]
        out = torch.zeros(spec.shape, dtype=spec.dtype, device=grid.device)
        g = self.grid_shape(shape, usage)
        if g is None:
            out.copy_(grid.reshape(out.shape))
        elif lay.scale_transposed:
            out[: g[1], : g[0]] = grid.t()
        else:
            out[: g[0], : g[1]] = grid
        return out

    def codes(self, buffers: Mapping[str, torch.Tensor], shape, usage: str) -> torch.Tensor:
        """``usage``'s element codes as [M, K] uint8 (a view of the data unless unpacked)."""
        lay = self.usage_layout(usage)
        m, k = flatten_2d(tuple(shape))
        rows, cols = (k, m) if lay.transposed else (m, k)
        d = buffers[lay.data].reshape(rows, cols // lay.pack)
        if lay.pack == 2:
            d = nx.unpack_fp4(d)
        return d.t() if lay.transposed else d

    def data_buffer(self, codes: torch.Tensor, shape, usage: str) -> torch.Tensor:
        """``usage``'s data buffer holding element codes [M, K] (inverse of :meth:`codes`)."""
        lay = self.usage_layout(usage)
        c = (codes.t() if lay.transposed else codes).contiguous()
        if lay.pack == 2:
            c = nx.pack_fp4(c)
        return c.reshape(self.describe_buffers(shape)[lay.data].shape)

    def relayout(self, buffers: Mapping[str, torch.Tensor], shape, out: "Quantizer", usage: str,
                 src_usage: str, grid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``out``'s ``usage`` buffers holding this tensor's ``src_usage`` codes, with scales ``grid``
        (on ``out``'s grid; default: the source's own block scales) and the source's amax."""
        lay, src = out.usage_layout(usage), self.usage_layout(src_usage)
        res = {lay.data: out.data_buffer(self.codes(buffers, shape, src_usage), shape, usage)}
        g = self.block_scales(buffers, shape, src_usage) if grid is None else grid
        res[lay.scale] = out.scale_buffer(g, shape, usage)
        if lay.amax is not None:
            res[lay.amax] = buffers[src.amax].clone()
        return res

    def slice_alignment(self) -> tuple[int, int]:
        """(rows, cols) that a slice's start, and its end unless it is the tensor's end, must be a
        multiple of: each enabled usage's scale block (``usage_layout.block``) and byte packing."""
        r = c = 1
        for u in self.usages_on():
            lay = self.usage_layout(u)
            br, bc = lay.block or (1, 1)
            r = math.lcm(r, br, lay.pack if lay.transposed else 1)
            c = math.lcm(c, bc, 1 if lay.transposed else lay.pack)
        return r, c

    # --- numerics -------------------------------------------------------------------------------
    #: rows per chunk are a multiple of this (lcm of every format's block heights)
    ROW_GROUP: ClassVar[int] = 128
    #: target fp32 bytes of one chunk
    CHUNK_BYTES: ClassVar[int] = 1 << 20

    def fusable(self) -> bool:
        """Whether this quantizer's numerics are pure tensor functions that ``formats/fused.py`` may
        compile (bit-exactly); formats opt in."""
        return False

    def _kernel_args(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Fields that vary from tensor to tensor (delayed scaling's scale) as tensors, handed to
        ``_prepare``: inputs of a compiled kernel rather than constants that would recompile it."""
        return {}

    @staticmethod
    def _tensor_amax(x2: torch.Tensor, args: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """max|x2| (NaN ignored) as fp32: the one the compiled path took with its NaN check, handed
        in through ``args``, else computed here."""
        given = (args or {}).get(fused.TENSOR_AMAX)
        return given if given is not None else nx.nan_ignoring_amax(x2)

    def amax_block(self) -> int | None:
        """b where this format's numerics take the |x| maxima of 1×b and b×1 blocks: the compiled
        path then takes them ahead of its graph, with the NaN check, in one pass (``fused``), and
        hands them to ``_prepare`` in ``args`` (:meth:`_given_amax`)."""
        return None

    def _given_amax(self, args: Mapping[str, torch.Tensor] | None) -> BlockAmax | None:
        """The block maxima in ``args``, where the compiled path took them (else None: the format
        reduces its blocks itself)."""
        rows = (args or {}).get(fused.ROW_BLOCK_AMAX)
        return None if rows is None else BlockAmax(rows, args[fused.COL_BLOCK_AMAX], self.amax_block())

    def _prepare(self, x2: torch.Tensor, args: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Tensor-wide pass over the 2-D input [M, K] before the rows: (state for ``_quantize_rows``,
        whole-tensor buffers such as a per-tensor ``scale_inv`` or ``amax``, in their spec shapes)."""
        return None, {}

    def _quantize_rows(self, xc: torch.Tensor, state: Any) -> dict[str, torch.Tensor]:
        """Quantize whole 128-row groups ``xc`` [R, K] (a pure function): per enabled usage (see
        ``usage_layout``) its data, [R, K / pack] or if ``transposed`` [K, R / pack], and for a
        block-scaled usage its scale grid [R / grid rows, K / grid cols], never transposed; an
        ``amax_rows`` amax as [R]."""
        raise NotImplementedError

    def _parts(self) -> dict[str, tuple[str, UsageLayout]]:
        """Buffer name → (role, usage layout) for what ``_quantize_rows`` returns."""
        out = {}
        for u in self.usages_on():
            lay = self.usage_layout(u)
            out[lay.data] = ("data", lay)
            if lay.grid is not None:
                out[lay.scale] = ("scale", lay)
            if lay.amax is not None and lay.amax_rows:
                out[lay.amax] = ("amax", lay)
        return out

    def _quantize_2d(self, x2: torch.Tensor, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensor in one pass (what ``fused`` compiles): 2-D data, zero-padded scales."""
        specs = self.describe_buffers(tuple(x2.shape))
        state, out = self._prepare(x2, args)
        roles = self._parts()
        for name, part in self._quantize_rows(x2, state).items():
            role, lay = roles[name]
            if role == "scale":
                g = part.t() if lay.scale_transposed else part
                rows, cols = specs[name].shape
                part = nx.pad_to(g, specs[name].shape)
            out[name] = part.contiguous()
        return out

    def _place_rows(self, out: dict[str, torch.Tensor], parts: Mapping[str, torch.Tensor], r0: int,
                    m: int, k: int) -> None:
        """Write one chunk's ``_quantize_rows`` output (rows from ``r0``) into the buffers."""
        roles = self._parts()
        for name, part in parts.items():
            role, lay = roles[name]
            if role == "data":
                if lay.transposed:
                    n = part.shape[1]
                    out[name].view(k, m // lay.pack)[:, r0 // lay.pack: r0 // lay.pack + n] = part
                else:
                    out[name].view(m, k // lay.pack)[r0:r0 + part.shape[0]] = part
            elif role == "amax":
                out[name][r0:r0 + part.shape[0]] = part
            else:
                g0, (gr, gc) = r0 // lay.grid[0], part.shape
                if lay.scale_transposed:
                    out[name][:gc, g0:g0 + gr] = part.t()
                else:
                    out[name][g0:g0 + gr, :gc] = part

    def _quantize(self, x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers of ``x``: compiled over the whole tensor where ``fused`` says so, else eager
        over chunks of whole 128-row groups (cache-sized intermediates) into preallocated buffers.
        ``tensor_amax``: the amax to scale with in place of max|x| (:meth:`takes_tensor_amax`)."""
        shape = tuple(x.shape)
        m, k = flatten_2d(shape)
        specs = self.describe_buffers(shape)
        x2 = x.reshape(m, k)
        args = self._kernel_args(x.device)
        if tensor_amax is not None:
            args[fused.TENSOR_AMAX] = tensor_amax
        ahead = fused.nan_free_amaxes(x2, self.amax_block()) if fused.wants_fused(x.numel(), x.device,
                                                                                   self.fusable()) else None
        if ahead is not None:
            # detach: no view of x, whose strides would be guarded; a given amax stands
            got = fused.run(_quantize_whole, ("quantize", self.kind, x.device.type, x.dtype),
                            self, _blocked(x2.detach(), self.slice_alignment()), {**ahead, **args})
            if got is not None:  # FP8 data comes back typed (fast stores): the same bytes, viewed
                return {n: got[n].view(specs[n].dtype).reshape(specs[n].shape) for n in specs}
        out = {}
        for name, spec in specs.items():
            make = torch.empty if name.endswith(("_data", "_transpose")) else torch.zeros
            out[name] = make(spec.shape, dtype=spec.dtype, device=x.device)
        state, whole = self._prepare(x2, args)
        for name, t in whole.items():
            out[name].copy_(t)
        rows = max(self.ROW_GROUP, self.CHUNK_BYTES // (4 * max(k, 1)) // self.ROW_GROUP * self.ROW_GROUP)
        for r0 in range(0, m, rows):
            self._place_rows(out, self._quantize_rows(x2[r0:r0 + rows], state), r0, m, k)
        return out

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """fp32 values of ``shape`` from the buffers (a pure function; ``fused`` may compile it)."""
        raise NotImplementedError

    def dequantize_buffers(self, buffers: Mapping[str, torch.Tensor], shape, dtype: torch.dtype, *,
                           eager: bool | None = None) -> torch.Tensor:
        """The values the buffers hold, as ``dtype`` (fp32 math, as TE): compiled where ``fused``
        says so, else eager."""
        shape = torch.Size(shape)
        device = _first_buffer(buffers).device
        if fused.wants_fused(math.prod(shape), device, self.fusable(), eager):
            m, k = flatten_2d(tuple(shape))
            (a, b), blocked = self.slice_alignment(), False
            flat = dict(buffers)  # data as 2-D [M, K / pack] or [K, M / pack]: one graph for any rank
            for u in USAGES:
                lay = self.usage_layout(u)
                if lay.data in flat:
                    rows, cols, ra, ca = (k, m, b, a) if lay.transposed else (m, k, a, b)
                    d = flat[lay.data].reshape(rows, cols // lay.pack).detach()
                    flat[lay.data] = _blocked(d, (ra, max(1, ca // lay.pack)))
                    blocked = blocked or flat[lay.data].dim() == 4
            got = fused.run(_dequantize_whole, ("dequantize", self.kind, device.type, dtype),
                            self, flat, None if blocked else (m, k), dtype)
            if got is not None:
                return got.reshape(shape)
        return self._dequantize(dict(buffers), shape).to(dtype)

    def quantize(self, x: torch.Tensor, *, fake_dtype: torch.dtype | None = None,
                 internal: bool = False, eager: bool | None = None,
                 tensor_amax: float | torch.Tensor | None = None) -> "QuantizedTensorStorage":
        """Quantize ``x`` with TE's numerics; a wrapper tensor (or bare storage if ``internal``).
        Compiled where ``formats/fused.py``'s policy says so; ``eager=True`` forces the eager path.
        ``tensor_amax`` (formats whose :meth:`takes_tensor_amax`): scale with this amax, at least
        max|x| (a fused group's shared one), in place of max|x|."""
        if isinstance(x, QuantizedTensorStorage):
            x = x.dequantize(eager=eager)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise FormatError(f"{type(self).__name__}.quantize needs a floating-point tensor, "
                              f"got {getattr(x, 'dtype', type(x))}")
        shape = tuple(x.shape)
        self.check_shape(shape)
        given = None
        if tensor_amax is not None:
            if not self.takes_tensor_amax():
                raise FormatError(f"{type(self).__name__} ({self.layout_name()}) has no tensor-wide amax to "
                                  "share: tensor_amax= applies to per-tensor FP8 current scaling and NVFP4")
            given = torch.as_tensor(tensor_amax, dtype=torch.float32).reshape(()).to(x.device)
            if not float(given) >= 0:  # NaN or negative; an infinite amax is TE's too (an inf in the group)
                raise FormatError(f"tensor_amax must be >= 0, got {float(given)}")
        with fused.policy("eager") if eager else contextlib.nullcontext():
            buffers = self._quantize(x.detach(), given)
        cls = self.storage_class if internal else self.tensor_class
        return cls(shape, fake_dtype or x.dtype, self, **buffers)

    __call__ = quantize

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
            out[f.name] = _encode_field(value)
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
            elif not _FIELD_TYPES.get(types[k], lambda _: True)(v):
                raise FormatError(f"{cls.__name__} field {k} must be {types[k]}, got {v!r}")
            kwargs[k] = v
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise FormatError(f"bad fields for {cls.__name__}: {e}") from None


def _blocked(x2: torch.Tensor, align: tuple[int, int]) -> torch.Tensor:
    """[M, K] as the view [M / a, a, K / b, b] when (a, b) divide it, else as it is. A compiled
    graph then sees M = a·s0 and K = b·s1: block counts are exact symbols, so its kernels index
    blocks without modulo arithmetic and vectorize (with M and K alone, inductor cannot prove
    K == 16·(K // 16), and NVFP4's cast ran scalar, 20× slower)."""
    (m, k), (a, b) = x2.shape, align
    if m % a or k % b or a * b == 1:
        return x2
    x4 = x2.view(m // a, a, k // b, b)
    torch._dynamo.mark_static(x4, 1)  # a and b are constants of the graph, not symbols
    torch._dynamo.mark_static(x4, 3)
    return x4


def _quantize_whole(q: Quantizer, x: torch.Tensor, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``fused`` compiles for quantize: the format's own numerics over the whole 2-D tensor
    (given as :func:`_blocked` gives it)."""
    if x.dim() == 4:
        x = x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3])
    return q._quantize_2d(x, args)


def _dequantize_whole(q: Quantizer, buffers: dict[str, torch.Tensor], shape: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """What ``fused`` compiles for dequantize: the format's ``_dequantize`` and the cast to ``dtype``.
    Data given as :func:`_blocked` gives it sets the shape ``None`` stands for (block counts as symbols)."""
    buffers = dict(buffers)
    for u in USAGES:
        lay = q.usage_layout(u)
        d = buffers.get(lay.data)
        if d is not None and d.dim() == 4:
            d = buffers[lay.data] = d.reshape(d.shape[0] * d.shape[1], d.shape[2] * d.shape[3])
            if shape is None:
                rows, cols = d.shape[0], d.shape[1] * lay.pack
                shape = (cols, rows) if lay.transposed else (rows, cols)
    return q._dequantize(buffers, torch.Size(shape)).to(dtype)


def _first_buffer(buffers: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    for b in buffers.values():
        if b is not None:
            return b
    raise BufferMismatchError("a quantized tensor needs at least one inner buffer")


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
        device = _first_buffer(self.buffers()).device
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
        device = _first_buffer(buffers).device
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
