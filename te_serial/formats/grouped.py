"""Grouped tensors: all experts of an MoE layer in one set of packed buffers (TE's ``GroupedTensor``).

TE: pytorch/tensor/storage/grouped_tensor_storage.py (``make_grouped_tensor``,
``split_into_quantized_tensors``), pytorch/tensor/grouped_tensor.py, pytorch/module/grouped_linear.py
(``GroupedLinear(single_grouped_weight=True)``). TE keeps one 1-D buffer per inner buffer kind —
``rowwise_data``, ``columnwise_data``, ``scale_inv``, ``columnwise_scale_inv``, ``amax``,
``columnwise_amax`` — holding the members' own buffers flattened and concatenated in member order,
with no padding between members: member i's part of a buffer starts at the sum of the element
counts of members 0..i-1 (each member's scale buffer keeps its own 128×4 padding, as its
quantizer's ``get_scale_shape`` gives it). Per-tensor FP8 keeps one scale_inv per member (shared by
both usages). TE's ``scale`` / current-scaling ``amax`` are quantization workspace, not stored.

Which member buffer goes into which grouped buffer follows from the member format's
``usage_layout`` (data → ``rowwise_data`` / ``columnwise_data``, scale → ``scale_inv`` /
``columnwise_scale_inv``, amax → ``amax`` / ``columnwise_amax``); the shapes come from the member
quantizer's ``describe_buffers``. Nothing here knows a format's kind.

TE groups what ``GroupedLinear`` groups: FP8 current scaling, MXFP8, FP8 blockwise, NVFP4 and plain
high-precision weights. Delayed scaling is not grouped (TE keeps those weights per GEMM: their
scale and amax are per-tensor state), so :class:`GroupedQuantizer` refuses data-dependent formats.

In te-serial a grouped tensor's "quantizer" is :class:`GroupedQuantizer`: the member quantizer (None
for plain members, with their ``dtype``) and the member shapes, which together fix the buffers. Its
shape is TE's wrapper shape: ``(n, *s)`` when all members have shape ``s``, else TE's 2-D logical
shape (rows summed when only rows vary, columns summed when only columns vary, ``(1, total)`` when
both vary); ``dequantize`` gives the members' values laid out in that shape.

Hugging Face MoE checkpoints name each expert's weight ``<prefix>.experts.<i>.<proj>.weight``; a
grouped tensor ``<prefix>.experts.<proj>.weight`` splits into those names and merges back from them
(:func:`split_grouped`, :func:`merge_grouped`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

import torch

from ..dtypes import dtype_name
from ..errors import FormatError, ShapeError, UnsupportedOperationError
from .protocol import COLUMNWISE, ROWWISE, BufferSpec
from .tensors import QuantizedTensor, QuantizedTensorStorage
from .base import Quantizer
from .te_adapter import TE_ADAPTERS, TEAdapter, adapter_for, register_te_adapter

#: TE's grouped buffer attribute names, in flatten order
GROUPED_BUFFERS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax")
#: most members one grouped tensor may hold (MoE layers have up to a few hundred experts)
MAX_MEMBERS = 1 << 12
_SLOTS = {ROWWISE: ("rowwise_data", "scale_inv", "amax"),
          COLUMNWISE: ("columnwise_data", "columnwise_scale_inv", "columnwise_amax")}
_PLAIN = "rowwise_data"


def grouped_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """TE's wrapper shape of a group of members with these shapes (see the module docstring)."""
    n, s0 = len(shapes), tuple(shapes[0])
    if all(tuple(s) == s0 for s in shapes):
        return (n, *s0)
    if any(len(s) != 2 for s in shapes):
        raise ShapeError(f"members of different shapes must be 2-D (TE's grouped tensors); got {list(shapes)[:4]}")
    firsts, lasts = [s[0] for s in shapes], [s[1] for s in shapes]
    if len(set(lasts)) == 1:
        return (sum(firsts), lasts[0])
    if len(set(firsts)) == 1:
        return (firsts[0], sum(lasts))
    return (1, sum(f * l for f, l in zip(firsts, lasts)))


class _Layout(NamedTuple):
    """Where each member's buffers sit in the grouped buffers."""

    specs: dict[str, BufferSpec]                 # grouped buffer → its flat spec, flatten order
    member_name: dict[str, str]                  # grouped buffer → member buffer name
    offsets: dict[str, tuple[int, ...]]          # grouped buffer → n + 1 element offsets
    member_specs: tuple[dict[str, BufferSpec], ...]


def _group_names(member: Quantizer) -> dict[str, str]:
    """Member buffer → TE's grouped buffer, from the member format's usage layouts (first usage wins:
    per-tensor FP8's one scale_inv serves both usages, as TE's shared tensor does)."""
    out: dict[str, str] = {}
    for usage in member.usages_on():
        lay = member.usage_layout(usage)
        for name, slot in zip((lay.data, lay.scale, lay.amax), _SLOTS[usage]):
            if name is not None:
                out.setdefault(name, slot)
    return out


@functools.lru_cache(maxsize=256)
def _layout(member: Quantizer | None, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype | None) -> _Layout:
    if member is None:
        specs = tuple({_PLAIN: BufferSpec(s, dtype)} for s in shapes)
        names = {_PLAIN: _PLAIN}
    else:
        specs = tuple(member.describe_buffers(s) for s in shapes)
        to_group = _group_names(member)
        missing = set(specs[0]) - set(to_group)
        if missing:
            raise FormatError(f"{type(member).__name__} buffers {sorted(missing)} have no place in a grouped tensor")
        names = {g: m for m, g in to_group.items() if m in specs[0]}
    member_name, offsets, out = {}, {}, {}
    for g in GROUPED_BUFFERS:
        m = names.get(g)
        if m is None:
            continue
        offs = [0]
        for sp in specs:
            offs.append(offs[-1] + math.prod(sp[m].shape))
        member_name[g], offsets[g] = m, tuple(offs)
        out[g] = BufferSpec((offs[-1],), specs[0][m].dtype)
    return _Layout(out, member_name, offsets, specs)


def _shape_list(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)):
        raise FormatError(f"member_shapes must be a list of shapes, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_MEMBERS:
        raise FormatError(f"a grouped tensor holds 1 to {MAX_MEMBERS} members, got {len(value)}")
    out = []
    for s in value:
        if (not isinstance(s, (list, tuple, torch.Size)) or not 1 <= len(s) <= 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)):
            raise FormatError(f"member shape {s!r} is not a 1-D or 2-D shape of non-negative ints")
        out.append(tuple(s))
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedQuantizer(Quantizer):
    """The member quantizer (None: plain members of ``dtype``) and the member shapes of a grouped tensor.

    Immutable and compared by value like every quantizer; its usages are the member's.
    """

    kind: ClassVar[str] = "grouped"
    is_container: ClassVar[bool] = True
    _dtype_fields: ClassVar[tuple[str, ...]] = ("dtype",)
    #: format 1.4: ``transposed`` (a 1.3 reader still reads every grouped tensor that leaves it false)
    FIELD_VERSIONS: ClassVar[Mapping[str, tuple[int, int]]] = {"transposed": (1, 4)}
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset(FIELD_VERSIONS)

    member: Any = None
    member_shapes: Any = ()
    dtype: Any = None
    #: the group holds each member transposed: a stack of ``[in, out]`` weights (gpt-oss's experts),
    #: each member stored and quantized as TE's ``[out, in]`` (blocks along the reduction dim)
    transposed: bool = False

    def __post_init__(self) -> None:
        member = self.member
        if isinstance(member, Mapping):  # as read from a manifest
            member = Quantizer.from_dict(member)
        if member is not None:
            if not isinstance(member, Quantizer) or isinstance(member, GroupedQuantizer):
                raise FormatError(f"a grouped tensor's members need a format quantizer, got {type(member).__name__}")
            if member.data_dependent:
                raise FormatError(f"{type(member).__name__} is not grouped: TE keeps delayed-scaling weights per "
                                  "GEMM (their scale and amax are per-tensor state)")
            if self.dtype is not None:
                raise FormatError("a grouped tensor of quantized members has no plain dtype")
            usage = dict(rowwise=member.rowwise, columnwise=member.columnwise)
        else:
            if not isinstance(self.dtype, torch.dtype) or not (self.dtype.is_floating_point or self.dtype.is_complex):
                raise FormatError(f"a grouped tensor of plain members needs their floating-point dtype, "
                                  f"got {self.dtype!r}")
            usage = dict(rowwise=True, columnwise=False)
        shapes = _shape_list(self.member_shapes)
        for s in shapes:
            if member is not None:
                member.check_shape(s)
        object.__setattr__(self, "member", member)
        object.__setattr__(self, "member_shapes", shapes)
        for k, v in usage.items():
            object.__setattr__(self, k, v)
        super().__post_init__()
        shape = grouped_shape(shapes)
        if self.transposed is not False:
            if self.transposed is not True:
                raise FormatError(f"GroupedQuantizer field transposed must be a bool, got {self.transposed!r}")
            if len(shape) != 3:
                raise FormatError(f"a transposed group needs members of one 2-D shape, got {list(shapes)[:4]}")
            shape = (shape[0], shape[2], shape[1])
        object.__setattr__(self, "_shape", shape)

    def _check_fields(self, data: Mapping[str, Any]) -> None:
        """As read from a manifest: ``rowwise`` / ``columnwise`` are the member's (plain members: true /
        false), never other values the constructor would silently replace."""
        for k in ("rowwise", "columnwise"):
            if k in data and data[k] != getattr(self, k):
                whose = "the member quantizer's" if self.member is not None else "plain members'"
                raise FormatError(f"GroupedQuantizer field {k} must be {whose} ({getattr(self, k)}), got {data[k]!r}")

    def __repr__(self) -> str:
        shapes = ", ".join(map(str, self.member_shapes[:3])) + (", …" if self.num_tensors > 3 else "")
        inner = repr(self.member) if self.member is not None else f"dtype={dtype_name(self.dtype)}"
        t = ", transposed" if self.transposed else ""
        return f"GroupedQuantizer({inner}, {self.num_tensors} members: {shapes}{t})"

    # --- what the group is --------------------------------------------------------------------
    @property
    def num_tensors(self) -> int:
        return len(self.member_shapes)

    @property
    def group_shape(self) -> tuple[int, ...]:
        """The grouped tensor's (TE wrapper) shape."""
        return self._shape

    def _lay(self) -> _Layout:
        return _layout(self.member, self.member_shapes, self.dtype)

    def member_ranges(self, i: int) -> dict[str, tuple[int, int]]:
        """Grouped buffer → (first element, element count) of member ``i``'s part."""
        if not 0 <= i < self.num_tensors:
            raise ShapeError(f"member {i} out of range: the group has {self.num_tensors} members")
        return self.member_span(i, i + 1)[1]

    def assemble_member(self, i: int, parts: Mapping[str, torch.Tensor], fake_dtype: torch.dtype, *,
                        requires_grad: bool = False) -> torch.Tensor:
        """Member ``i`` from its parts of the grouped buffers (grouped name → its 1-D range, any dtype of
        the same item size, e.g. as stored): a plain tensor or the member format's tensor."""
        lay = self._lay()
        specs = lay.member_specs[i]
        bufs = {m: parts[g].view(specs[m].dtype).reshape(specs[m].shape) for g, m in lay.member_name.items()}
        if self.member is None:
            return bufs[_PLAIN].requires_grad_(True) if requires_grad else bufs[_PLAIN]
        return self.member.tensor_class(self.member_shapes[i], fake_dtype, self.member, requires_grad=requires_grad,
                                        **bufs)

    # --- the Quantizer protocol ---------------------------------------------------------------
    def check_shape(self, shape):
        if tuple(shape) != self._shape:
            raise ShapeError(f"a grouped tensor of members {list(self.member_shapes)[:4]}"
                             f"{'…' if self.num_tensors > 4 else ''} has shape {list(self._shape)}, "
                             f"got {list(shape)}")

    def _buffer_specs(self, shape):
        return dict(self._lay().specs)

    def value_dtypes(self) -> dict[str, torch.dtype]:
        if self.member is None:
            return {_PLAIN: self.dtype}
        values = self.member.value_dtypes()
        return {g: values[m] for g, m in self._lay().member_name.items()}

    def usages_on(self) -> tuple[str, ...]:
        """None at the group level: grouped buffers are flat; each usage's layout is the members'."""
        return ()

    def valid_regions(self, shape) -> dict[str, tuple[int, int]]:
        return {}

    def usage_layout(self, usage):
        raise UnsupportedOperationError("a grouped tensor has no 2-D usage layout; use its members()")

    def layout_key(self):
        return (self.kind, self.member.layout_key() if self.member is not None else self.dtype, self.member_shapes,
                self.transposed)

    def layout_name(self):
        inner = self.member.layout_name() if self.member is not None else dtype_name(self.dtype)
        return f"grouped{self.num_tensors}_{inner}"

    def conversion_usages(self) -> tuple[str, ...]:
        return self.member.usages_on() if self.member is not None else ()

    def member_format(self) -> Quantizer:
        return self.member if self.member is not None else self

    # --- shards of a stack: a range of whole members (FSDP2's Shard(0), expert parallelism) ------
    def _stacked(self) -> bool:
        return len(self._shape) == 3 and all(s == self.member_shapes[0] for s in self.member_shapes)

    def of_whole(self, shape) -> Quantizer:
        shape = tuple(int(d) for d in shape)
        if not self._stacked() or len(shape) != 3 or shape[1:] != self._shape[1:]:
            return self
        return dataclasses.replace(self, member_shapes=[self.member_shapes[0]] * shape[0])

    def slice_alignment(self) -> tuple[int, int]:
        """A stack is sliced by whole members along its first dim: rows of its 2-D view [E × a, b] in
        multiples of a member's ``a``, columns whole."""
        if not self._stacked():
            return self._shape[0] if len(self._shape) == 2 else 1, math.prod(self._shape[1:]) or 1
        return self._shape[1], self._shape[2]

    def member_span(self, start: int, stop: int) -> tuple["GroupedQuantizer", dict[str, tuple[int, int]]]:
        """(the quantizer of members ``start`` .. ``stop - 1`` as a group of their own, grouped buffer →
        (first element, element count) of their part)."""
        if isinstance(start, bool) or isinstance(stop, bool) or not 0 <= start < stop <= self.num_tensors:
            raise ShapeError(f"members [{start}, {stop}) out of range: the group has {self.num_tensors} members")
        offsets = self._lay().offsets
        return (dataclasses.replace(self, member_shapes=self.member_shapes[start:stop]),
                {g: (o[start], o[stop] - o[start]) for g, o in offsets.items()})

    def member_boxes(self, rows: tuple[int, int]) -> dict[str, tuple[tuple[int], tuple[int]]]:
        """Grouped buffer → (offset, size) of members ``rows // a`` (a range of whole members of a
        stack: see :meth:`slice_alignment`) in its flat buffer."""
        per = self._shape[1]
        spans = self.member_span(rows[0] // per, -(-rows[1] // per))[1]
        return {g: ((first,), (count,)) for g, (first, count) in spans.items()}

    def data_buffers(self) -> frozenset[str]:
        member_data = self.member.data_buffers() if self.member is not None else {_PLAIN}
        return frozenset(g for g, m in self._lay().member_name.items() if m in member_data)

    def exact_output(self, target):
        """The same members in ``target``'s member format where the member format has an exact path."""
        if target == self:
            return self
        if (not isinstance(target, GroupedQuantizer) or target.member_shapes != self.member_shapes
                or self.member is None or target.member is None):
            return None
        if target.transposed != self.transposed:
            return None
        out = self.member.exact_output(target.member)
        return None if out is None else GroupedQuantizer(member=out, member_shapes=self.member_shapes,
                                                         transposed=self.transposed)

    def derivable(self, out, usage):
        return self.member is not None and self.member.derivable(out.member, usage)

    def derive(self, buffers, shape, out, usage):
        """``usage``'s grouped buffers of ``out``, each member's derived by the member format (a stack
        derived by a table, element by element: in one call over its members' rows joined, each
        member's rows then a view of the one output)."""
        from .slicing import cat_rows
        if self._whole_stack(self.member, out.member) and self.member.derives_by_table(out.member, usage):
            whole_shape, whole = self._joined(buffers)
            oq = out.member.set_usage(rowwise=usage == ROWWISE, columnwise=usage != ROWWISE)
            parts = self._member_rows(oq, self.member.derive(whole, whole_shape, oq, usage), whole_shape)
        else:
            parts = [self.member.derive(m.buffers(), s, out.member, usage)
                     for m, s in zip(self.split_buffers(buffers, internal=True), self.member_shapes)]
            if any(p is None for p in parts):  # a member's bytes break its format's exact rule: the group requantizes
                return None
        return {g: cat_rows([p[m].reshape(-1) for p in parts])
                for g, m in out._lay().member_name.items() if m in parts[0]}

    def derives_by_table(self, out, usage):
        return (self.member is not None and isinstance(out, GroupedQuantizer) and out.member is not None
                and self.member.derives_by_table(out.member, usage))

    def refused_value(self, buffers):
        if self.member is None or type(self.member).refused_value is Quantizer.refused_value:
            return None   # a member format that refuses no value: no pass over the members
        grouped_name = {m: g for g, m in self._lay().member_name.items()}
        for i, m in enumerate(self.split_buffers(buffers, internal=True)):
            bad = self.member.refused_value(m.buffers())
            if bad is not None:
                return grouped_name[bad[0]], f"member {i}: {bad[1]}"
        return None

    def default_usages(self):
        return (True, True) if self.member is None else (self.rowwise, self.columnwise)  # plain members: as plain

    def for_target(self, target):
        """A recipe for a grouped weight quantizes each member: the same members, each in ``target``."""
        if isinstance(target, GroupedQuantizer):
            return target
        return GroupedQuantizer(member=target, member_shapes=self.member_shapes, transposed=self.transposed)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "rowwise": self.rowwise, "columnwise": self.columnwise,
                               "member": self.member.to_dict() if self.member is not None else None,
                               "member_shapes": [list(s) for s in self.member_shapes]}
        if self.member is None:
            out["dtype"] = dtype_name(self.dtype)
        if self.transposed:
            out["transposed"] = True
        return out

    # --- values -------------------------------------------------------------------------------
    def split_values(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The members' values in a tensor of the group's shape (views where the layout allows)."""
        shapes = self.member_shapes
        if self.transposed:
            return [p.transpose(0, 1) for p in x.unbind(0)]
        if all(s == shapes[0] for s in shapes):
            return list(x.unbind(0))
        firsts, lasts = [s[0] for s in shapes], [s[1] for s in shapes]
        if len(set(lasts)) == 1:
            return list(x.split(firsts, dim=0))
        if len(set(firsts)) == 1:
            return list(x.split(lasts, dim=1))
        return [p.reshape(s) for p, s in zip(x.reshape(-1).split([math.prod(s) for s in shapes]), shapes)]

    def join_values(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split_values`."""
        shapes = self.member_shapes
        if self.transposed:
            return torch.stack([p.transpose(0, 1) for p in parts])
        if all(s == shapes[0] for s in shapes):
            return torch.stack(list(parts))
        firsts, lasts = [s[0] for s in shapes], [s[1] for s in shapes]
        if len(set(lasts)) == 1:
            return torch.cat(list(parts), dim=0)
        if len(set(firsts)) == 1:
            return torch.cat(list(parts), dim=1)
        return torch.cat([p.reshape(-1) for p in parts]).reshape(self._shape)

    def _quantize(self, x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self._quantizes_whole():
            return self._quantize_whole(x)
        parts = self.split_values(x)
        if self.member is None:
            members = [{_PLAIN: p.to(self.dtype)} for p in parts]
        else:
            members = [self.member.quantize(p.contiguous(), internal=True).buffers() for p in parts]
        return self.merge_buffers(members)

    def _quantizes_whole(self) -> bool:
        """A stack whose members the member format can quantize as one [E × out, in] tensor, giving each
        member the bytes it gets alone: every scale per block (nothing tensor-wide: no per-tensor scale, no
        tensor amax, no delayed-scaling state) and every member's rows ending on the format's blocks."""
        m = self.member
        return (self._whole_stack(m) and not m.takes_tensor_amax() and not m.scale_per_tensor
                and not m.data_dependent)

    def _whole_stack(self, *formats: Quantizer | None) -> bool:
        """A stack of quantized members whose rows end on each of ``formats``' row blocks: its members'
        rows join into one [E × out, in] tensor of those formats and split back exactly."""
        rows = self.member_shapes[0][0]
        return (self._stacked() and all(q is not None for q in formats)
                and all(rows % q.slice_alignment()[0] == 0 for q in formats))

    def _joined(self, buffers: Mapping[str, torch.Tensor]) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
        """(shape, buffers) of the stack as one [E × out, in] tensor of the member format (its members'
        rows joined: data buffers as views where they lie in order)."""
        from .slicing import join_rows, stacks_flat
        rows, cols = self.member_shapes[0]
        if self._stacked() and stacks_flat(self.member, (rows, cols), self.num_tensors):
            whole = (self.num_tensors * rows, cols)   # the packed buffers are the joined ones: views
            specs, lay = self.member.describe_buffers(whole), self._lay()
            return whole, {m: buffers[g].view(specs[m].dtype).reshape(specs[m].shape)
                           for g, m in lay.member_name.items()}
        return join_rows(self.member, [(m.logical_shape, m.buffers())
                                       for m in self.split_buffers(buffers, internal=True)])

    def _member_rows(self, q: Quantizer, buffers: Mapping[str, torch.Tensor], shape) -> list[dict[str, torch.Tensor]]:
        """Each member's buffers of a [E × out, in] tensor of ``q`` (its rows' slice: data a view,
        compact scales, as the member alone has them)."""
        from .slicing import slice_buffers
        rows = self.member_shapes[0][0]
        return [slice_buffers(q, buffers, shape, rows=(i * rows, (i + 1) * rows))[1] for i in range(self.num_tensors)]

    def _quantize_whole(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """One quantize of the stacked members (fewer, larger kernel calls), split back into members."""
        k = self.member_shapes[0][1]
        stacked = (x.transpose(1, 2) if self.transposed else x).reshape(-1, k)
        whole = self.member.quantize(stacked.contiguous(), internal=True)
        parts = self._member_rows(self.member, whole.buffers(), tuple(whole.logical_shape))
        return self.merge_buffers(parts, views=True)  # fresh bytes: no copy needed

    def _dequantize(self, buffers: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        if self._quantizes_whole():  # one dequantize of the stack [E × out, in], the members' rows joined
            whole_shape, whole = self._joined(buffers)
            values = self.member.dequantize_buffers(whole, whole_shape, torch.float32)
            values = values.reshape(self.num_tensors, *self.member_shapes[0])
            return values.transpose(1, 2) if self.transposed else values
        parts = [m.float() if self.member is None else m.dequantize(torch.float32)
                 for m in self.split_buffers(buffers, internal=True)]
        return self.join_values(parts)

    # --- merge and split (exact: the members' bytes) -------------------------------------------
    def merge_buffers(self, members: Sequence[Mapping[str, torch.Tensor]], *,
                      views: bool = False) -> dict[str, torch.Tensor]:
        """The grouped buffers holding each member's buffers (by member buffer name), concatenated: a
        copy, or with ``views`` a view where the members' buffers are consecutive in one storage."""
        from .slicing import cat_rows
        lay = self._lay()
        if len(members) != self.num_tensors:
            raise FormatError(f"{len(members)} members for a group of {self.num_tensors}")
        out = {}
        for g, m in lay.member_name.items():
            parts = []
            for i, bufs in enumerate(members):
                b, spec = bufs.get(m), lay.member_specs[i][m]
                if b is None or tuple(b.shape) != spec.shape or b.dtype != spec.dtype:
                    got = "none" if b is None else f"{dtype_name(b.dtype)}{list(b.shape)}"
                    raise FormatError(f"member {i}: buffer {m} should be {dtype_name(spec.dtype)}{list(spec.shape)}, "
                                      f"got {got}")
                parts.append(b.reshape(-1))
            out[g] = cat_rows(parts) if views else torch.cat(parts)
        return out

    def split_buffers(self, buffers: Mapping[str, torch.Tensor], *, fake_dtype: torch.dtype | None = None,
                      internal: bool = False) -> list:
        """The member tensors, as views of the grouped ``buffers`` (plain members: plain tensors)."""
        lay = self._lay()
        out = []
        for i, shape in enumerate(self.member_shapes):
            bufs = {m: buffers[g][lay.offsets[g][i]:lay.offsets[g][i + 1]].view(lay.member_specs[i][m].shape)
                    for g, m in lay.member_name.items()}
            if self.member is None:
                out.append(bufs[_PLAIN])
                continue
            cls = self.member.storage_class if internal else self.member.tensor_class
            out.append(cls(shape, fake_dtype or torch.float32, self.member, **bufs))
        return out


def per_expert(q: Quantizer, shape: Sequence[int], *, transposed: bool = False) -> Quantizer:
    """The quantizer a weight of ``shape`` gets from recipe quantizer ``q``: ``q`` for a 2-D weight;
    for a 3-D expert stack ``[experts, out, in]``, a grouped quantizer of ``experts`` members of
    ``[out, in]``, each quantized on its own (per-expert scales, as TE's ``GroupedLinear``); a stack
    stored ``[experts, in, out]`` (``transposed``: gpt-oss) gets members ``[out, in]`` all the same,
    its blocks along the reduction dim."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or isinstance(q, GroupedQuantizer):
        return q
    member = (shape[2], shape[1]) if transposed else shape[1:]
    return GroupedQuantizer(member=q, member_shapes=[member] * shape[0], transposed=transposed)


class GroupedTensorStorage(QuantizedTensorStorage):
    """TE's ``GroupedTensorStorage``: the members' buffers packed flat, by TE's attribute names."""

    BUFFERS = GROUPED_BUFFERS

    @property
    def num_tensors(self) -> int:
        return self._quantizer.num_tensors

    @property
    def member_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self._quantizer.member_shapes

    def members(self) -> list:
        """The member tensors (TE's ``split_into_quantized_tensors``): views of the grouped buffers,
        byte-identical to what was merged; plain members come back as plain tensors."""
        internal = not isinstance(self, torch.Tensor)
        return self._quantizer.split_buffers(self.buffers(), fake_dtype=self._fake_dtype, internal=internal)

    def member_range(self, start: int, stop: int) -> "GroupedTensorStorage":
        """Members ``start`` .. ``stop - 1`` as a grouped tensor of their own (views of the packed
        buffers, the same member format and layout): an expert-parallel rank's or an FSDP2 shard's
        experts."""
        part, spans = self._quantizer.member_span(start, stop)
        bufs = {g: b[spans[g][0]:spans[g][0] + spans[g][1]] for g, b in self.buffers().items()}
        return type(self)(part.group_shape, self._fake_dtype, part, **bufs)

    def rows_joined(self) -> QuantizedTensorStorage:
        """The members stacked by rows as one tensor of the member format, exactly (the format's
        ``join_rows``; data buffers are views where they lie in order): a stack's experts written as
        one. :class:`~te_serial.FormatError` where the members are plain or stored transposed, or
        their rows do not end on the format's row blocks."""
        q = self._quantizer
        if q.member is None or q.transposed:
            raise FormatError("only quantized members stored (out, in) join by rows")
        shape, bufs = q._joined(self.buffers())
        return q.member.tensor_class(shape, self._fake_dtype, q.member, **bufs)

    @classmethod
    def from_members(cls, tensors: Sequence[Any], *, requires_grad: bool = False) -> "GroupedTensorStorage":
        """One grouped tensor holding ``tensors`` exactly: te-serial quantized tensors with one quantizer
        and nominal dtype, or plain tensors of one dtype (a copy of their bytes, packed)."""
        tensors = list(tensors)
        if not tensors:
            raise FormatError("a grouped tensor needs at least one member")
        first = tensors[0]
        if isinstance(first, QuantizedTensorStorage):
            for i, t in enumerate(tensors):
                if not isinstance(t, QuantizedTensorStorage) or t.quantizer != first.quantizer \
                        or t.fake_dtype != first.fake_dtype:
                    raise FormatError(f"member {i} differs from member 0 in quantizer or nominal dtype "
                                      f"({getattr(t, 'quantizer', type(t).__name__)!r} vs {first.quantizer!r})")
            q = GroupedQuantizer(member=first.quantizer, member_shapes=[tuple(t.logical_shape) for t in tensors])
            buffers = q.merge_buffers([t.buffers() for t in tensors])
            fake = first.fake_dtype
        else:
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or isinstance(t, QuantizedTensorStorage) or t.dtype != first.dtype:
                    raise FormatError(f"member {i} is not a plain tensor of dtype {first.dtype}")
            q = GroupedQuantizer(member_shapes=[tuple(t.shape) for t in tensors], dtype=first.dtype)
            buffers = q.merge_buffers([{_PLAIN: t.detach()} for t in tensors])
            fake = first.dtype
        return cls(q.group_shape, fake, q, requires_grad=requires_grad, **buffers)


class GroupedTensor(GroupedTensorStorage, QuantizedTensor):
    """TE's ``GroupedTensor``: a wrapper tensor of the group's shape over the packed buffers.

    Picking experts out of a stack of equal members (``w[i]``, ``w[expert_ids]``: how
    transformers' eager and batched expert implementations read a 3-D expert parameter)
    dequantizes only the members picked; every other op sees the whole stack's values."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PICKS and isinstance(args[0], GroupedTensor):
            picked = _PICKS[func](*args, **kwargs)
            if picked is not None:
                return picked
        return super().__torch_dispatch__(func, types, args, kwargs)


def _stacked(t: GroupedTensor) -> bool:
    shapes = t.member_shapes
    return len(t.shape) == len(shapes[0]) + 1 and all(s == shapes[0] for s in shapes)


def _member_values(t: GroupedTensor, i: int) -> torch.Tensor:
    m = t.members()[i]
    v = m.dequantize() if t.quantizer.member is not None else m.to(t.dtype)
    return v.transpose(0, 1) if t.quantizer.transposed else v


def _select(t: GroupedTensor, dim: int, index: int) -> torch.Tensor | None:
    """``t[i]``: member ``i``'s values."""
    if dim not in (0, -t.dim()) or not _stacked(t):
        return None
    n = t.num_tensors
    if not -n <= index < n:
        return None  # torch's own error, from the fallback
    return _member_values(t, index % n)


def _index(t: GroupedTensor, indices) -> torch.Tensor | None:
    """``t[ids]`` with one integer index tensor on the expert dim: the picked members' values."""
    if len(indices) != 1 or indices[0] is None or not _stacked(t):
        return None
    ids = indices[0]
    if ids.dtype not in (torch.int64, torch.int32) or ids.device.type == "meta":
        return None
    n = t.num_tensors
    if ids.numel() and not bool(((ids >= -n) & (ids < n)).all()):
        return None
    wanted, inverse = torch.unique(ids.remainder(n), return_inverse=True)
    values = [_member_values(t, int(i)) for i in wanted.tolist()]
    if not values:
        return torch.empty((*ids.shape, *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.stack(values)[inverse.to(t.device)]


_PICKS = {torch.ops.aten.select.int: _select, torch.ops.aten.index.Tensor: _index}


GroupedQuantizer.storage_class = GroupedTensorStorage
GroupedQuantizer.tensor_class = GroupedTensor


# --- Hugging Face MoE names --------------------------------------------------------------------

_EXPERT = re.compile(r"(.+\.experts)\.(0|[1-9][0-9]*)\.([^.]+)\.([^.]+)", re.DOTALL)
_GROUPED = re.compile(r"(.+\.experts)\.([^.]+)\.([^.]+)", re.DOTALL)


def expert_name(name: str, i: int) -> str:
    """Member ``i``'s name of grouped tensor ``name``: ``<p>.experts.<proj>.<leaf>`` →
    ``<p>.experts.<i>.<proj>.<leaf>`` (Hugging Face MoE checkpoints' per-expert names)."""
    m = _GROUPED.fullmatch(name)
    if m is None:
        raise FormatError(f"grouped tensor {name!r} is not named <prefix>.experts.<proj>.<leaf>; cannot name "
                          "its experts")
    return f"{m.group(1)}.{i}.{m.group(2)}.{m.group(3)}"


def split_name(name: str) -> tuple[str, int] | None:
    """(grouped name, expert index) of a per-expert name ``<p>.experts.<i>.<proj>.<leaf>``, else None."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    return f"{m.group(1)}.{m.group(3)}.{m.group(4)}", int(m.group(2))


def plan_split(protos: Mapping[str, Any], keep: frozenset[str] = frozenset()) -> dict[str, tuple[str, int | None]]:
    """Output name → (source name, member index or None) when every grouped tensor but those in
    ``keep`` is split into its experts (``protos``: name → TensorProto, in order; others pass through)."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, p in protos.items():
        q = getattr(p, "quantizer", None)
        split = isinstance(q, GroupedQuantizer) and name not in keep
        names = [(expert_name(name, i), (name, i)) for i in range(q.num_tensors)] if split else [(name, (name, None))]
        for new, src in names:
            if new in out:
                raise FormatError(f"splitting grouped tensors gives the name {new!r} twice")
            out[new] = src
    return out


def plan_merge(names: Sequence[str]) -> dict[str, list[str]]:
    """Output name → its source names, in order: per-expert tensors ``<p>.experts.<i>.<proj>.<leaf>`` with
    indices exactly 0..n-1 merge into ``<p>.experts.<proj>.<leaf>`` (at the first expert's place); any
    other name passes through."""
    groups: dict[str, dict[int, str]] = {}
    for name in names:
        hit = split_name(name)
        if hit is not None:
            groups.setdefault(hit[0], {})[hit[1]] = name
    complete = {g: [m[i] for i in range(len(m))] for g, m in groups.items() if set(m) == set(range(len(m)))}
    member_of = {n: g for g, ms in complete.items() for n in ms}
    out: dict[str, list[str]] = {}
    for name in names:
        g = member_of.get(name)
        if g is None:
            if name in out or name in complete:
                raise FormatError(f"merging experts gives the name {name!r} twice")
            out[name] = [name]
        elif g not in out:
            out[g] = complete[g]
    return out


def split_grouped(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Every grouped tensor replaced by its experts under their Hugging Face names (views, same bytes)."""
    cache: dict[str, list] = {}
    out = {}
    for new, (src, i) in plan_split({n: _proto_of(t) for n, t in tensors.items()}).items():
        if i is None:
            out[new] = tensors[src]
        else:
            out[new] = cache.setdefault(src, tensors[src].members())[i]
    return out


def merge_grouped(tensors: Mapping[str, Any], *, grouped_class: type = GroupedTensor) -> dict[str, Any]:
    """Per-expert tensors ``<p>.experts.<i>.<proj>.<leaf>`` merged into one grouped tensor each (exact)."""
    out = {}
    for new, srcs in plan_merge(list(tensors)).items():
        if srcs == [new]:
            out[new] = tensors[new]
            continue
        try:
            out[new] = grouped_class.from_members([tensors[s] for s in srcs])
        except FormatError as e:
            raise FormatError(f"cannot merge {srcs[0]} … {srcs[-1]} into {new}: {e}") from None
    return out


class _QuantizerOnly(NamedTuple):
    quantizer: Any


def _proto_of(t: Any) -> Any:
    return _QuantizerOnly(t.quantizer if isinstance(t, QuantizedTensorStorage) else None)


# --- Transformer Engine's GroupedTensor --------------------------------------------------------

def _member_adapter(t: Any) -> TEAdapter:
    for c in type(t).__mro__:
        if c.__module__.startswith("transformer_engine.") and c.__name__ in TE_ADAPTERS:
            return TE_ADAPTERS[c.__name__]
    raise FormatError(f"TE grouped member {type(t).__name__} has no te-serial adapter")


class _GroupedTE(TEAdapter):
    """TE's ``GroupedTensor``: read through TE's own split (each member by its format's adapter, so
    swizzled scales are unswizzled and padding zeroed), built back with TE's
    ``make_grouped_tensor_with_shapes`` and the packed bytes copied in."""

    te_module = "tensor.grouped_tensor"
    te_tensor = "GroupedTensor"
    te_storage = "GroupedTensorStorage"
    te_quantizers = ()  # TE groups under its member formats' quantizers

    def read(self, t, tq, shape):
        members = t.quantized_tensors if t.quantized_tensors is not None else t.split_into_quantized_tensors()
        shapes = [tuple(m.shape) if isinstance(m, torch.Tensor) else tuple(m.size()) for m in members]
        if t.quantizer is None:
            return GroupedQuantizer(member_shapes=shapes, dtype=t.fake_dtype), {_PLAIN: t.rowwise_data}
        read = [_member_adapter(m).from_te(m, t.quantizer, s) for m, s in zip(members, shapes)]
        q = read[0][0]
        for i, (qi, _) in enumerate(read):
            if qi != q:
                raise FormatError(f"TE grouped member {i} reads as {qi!r}, member 0 as {q!r}")
        g = GroupedQuantizer(member=q, member_shapes=shapes)
        return g, g.merge_buffers([{n: b for n, b in bufs.items() if b is not None} for _, bufs in read])

    def te_quantizer(self, q, te):
        return adapter_for(q.member).te_quantizer(q.member, te) if q.member is not None else None

    def to_te(self, t: GroupedTensorStorage, te) -> Any:
        """TE's GroupedTensor holding ``t``'s bytes (TE allocates; workspace buffers are zeroed)."""
        q: GroupedQuantizer = t.quantizer
        cls = getattr(te.module(self.te_module), self.te_tensor)
        bufs = t.buffers()
        device = next(iter(bufs.values())).device
        if q.member is None and len(q.member_shapes[0]) == 1:
            return cls.make_grouped_tensor_from_rowwise_data(
                num_tensors=q.num_tensors, tensor_shape=q.member_shapes[0], rowwise_data=bufs[_PLAIN].clone(),
                dtype=t.fake_dtype)
        out = cls.make_grouped_tensor_with_shapes(num_tensors=q.num_tensors, shapes=list(q.member_shapes),
                                                  quantizer=self.te_quantizer(q, te), device=device,
                                                  dtype=t.fake_dtype)
        names = (*GROUPED_BUFFERS, "scale")
        for name in names:  # first: workspace TE fills when it quantizes (current scaling's scale, amax)
            dst = getattr(out, name, None)
            if dst is not None and name not in bufs:
                dst.zero_()
        for name in names:  # then the bytes (per-tensor FP8's columnwise_scale_inv is TE's scale_inv)
            dst, src = getattr(out, name, None), bufs.get(name)
            if src is not None:
                if dst is None:
                    raise FormatError(f"TE's grouped tensor for {q.layout_name()} has no {name}")
                dst.view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
        if bool(getattr(t, "requires_grad", False)):
            out.requires_grad_(True)
        return out

    def te_kwargs(self, q, buffers, te):
        raise UnsupportedOperationError("TE's GroupedTensor is built by the grouped adapter's build()")


register_te_adapter(_GroupedTE(), GroupedQuantizer)
