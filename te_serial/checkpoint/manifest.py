"""The checkpoint manifest: columns over a table of distinct prototypes, in msgpack.

Layout (schema/manifest-v1.schema.json): ``quantizers`` and ``protos`` hold each distinct
quantizer and prototype once (with the buffers such a tensor has on disk); ``tensors`` holds
columns — names, prototype index, file index and checksum per buffer — so a 10,000-tensor
manifest decodes and validates in milliseconds. Buffer keys follow one rule (:func:`buffer_key`).

Reading is validation first: the schema (jsonschema-rs, compiled once), then every invariant
(quantizers resolve through the registry; each prototype's buffers are exactly what its
quantizer describes; indices in range; names unique) — before any buffer is touched.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Iterator, Mapping, NamedTuple

import jsonschema_rs
import msgpack
import torch
import xxhash

from ..dtypes import dtype_from_name, dtype_name
from ..errors import ManifestError, TeSerialError, VersionError
from ..formats.protocol import QUANTIZER_REGISTRY, STORAGE_REGISTRY, resolve_storage
from ..formats.base import Quantizer
from ..formats.slicing import region_views
from ..proto import TensorProto, addressable
from . import tree as tree_mod
from .header import gc_paused

FORMAT = "te-serial"
VERSION = (1, 5)
#: the format version that added the manifest checksum (``manifest_checksum``, schema/README.md §8)
CHECKSUM_VERSION = (1, 1)
#: the format version that added chunked tensors (``tensors.chunks``, schema/README.md §13)
CHUNKS_VERSION = (1, 2)
#: the format version that added grouped (MoE) tensors (quantizer kind ``grouped``, schema/README.md §14)
GROUPED_VERSION = (1, 3)
#: most members all grouped quantizers of one manifest may list together (each costs a prototype check)
MAX_GROUPED_MEMBERS = 1 << 16
MANIFEST_NAME = "te_serial.msgpack"
HEADER_KEY = "te_serial.manifest"
SCHEMA_FILE = "manifest-v1.schema.json"
MAX_MANIFEST_BYTES = 1 << 28
#: a buffer's ``file`` in a single-file checkpoint: the file carrying the manifest
SELF_FILE = ""
PLAIN_BUFFER = "data"
#: the manifest's last field (format 1.1): XXH3-64 of every manifest byte before its 8-byte value
MANIFEST_CHECKSUM = "manifest_checksum"
_TRAILER = msgpack.packb(MANIFEST_CHECKSUM) + b"\xcf"  # the key, then msgpack's uint64 marker


def seal(doc: dict) -> bytes:
    """msgpack bytes of a manifest document, its checksum as the last field (see :data:`MANIFEST_CHECKSUM`)."""
    doc = dict(doc)
    doc.pop(MANIFEST_CHECKSUM, None)
    doc[MANIFEST_CHECKSUM] = 2 ** 64 - 1  # always encoded as 0xcf + 8 bytes: patched below
    data = tree_mod.pack(doc)
    body = data[:-8]
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "big")


def sealed(data: bytes) -> bool | None:
    """True if ``data`` ends with a manifest checksum that matches, False if it ends with one that
    does not, None if it has none (format 1.0)."""
    if len(data) < len(_TRAILER) + 8 or data[-8 - len(_TRAILER):-8] != _TRAILER:
        return None
    return xxhash.xxh3_64_intdigest(data[:-8]) == int.from_bytes(data[-8:], "big")


def format_checksum(value: int | None) -> str:
    return "none" if value is None else f"xxh3_64:{value:016x}"


def buffer_key(tensor_name: str, buffer: str) -> str:
    """The safetensors key of a buffer: the tensor's name, or ``<name>.<TE buffer name>``."""
    return tensor_name if buffer == PLAIN_BUFFER else f"{tensor_name}.{buffer}"


def chunk_key(tensor_name: str, buffer: str, index: int) -> str:
    """The safetensors key of piece ``index`` of a chunked tensor's buffer: ``<buffer key>@<index>``."""
    return f"{buffer_key(tensor_name, buffer)}@{index}"


_PIECE_KEY = re.compile(r"(.*)@(0|[1-9][0-9]*)", re.DOTALL)


class Piece(NamedTuple):
    """One stored piece of a chunked tensor's buffer: a box of the buffer's region view (format 1.2)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: int
    checksum: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@functools.lru_cache(maxsize=4096)
def region_shapes(proto: TensorProto) -> tuple[tuple[int, ...], ...]:
    """Each buffer's region view (flatten order), in which a chunked tensor's pieces are boxes:
    a plain tensor's own shape; for a quantized tensor, the format's rule
    (:func:`te_serial.formats.slicing.region_views`)."""
    if proto.quantizer is None:
        return (tuple(proto.shape),)
    return tuple(region_views(proto.quantizer, proto.shape).values())


def check_tiling(view: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
                 budget: list[int]) -> str | None:
    """Why ``boxes`` do not tile ``view`` exactly (None when they do). Every box must lie inside the
    view with sizes ≥ 1, their volumes must add up to the view's, and no two may overlap — a sweep
    along the dim with the most distinct offsets, spending pair comparisons from ``budget[0]``."""
    nd = len(view)
    total = 0
    for offsets, sizes in boxes:
        if len(offsets) != nd or len(sizes) != nd:
            return f"a piece has {len(offsets)}/{len(sizes)} offsets/sizes for a {nd}-dim region"
        for o, z, v in zip(offsets, sizes, view):
            if z < 1 or o + z > v:
                return f"piece at {list(offsets)} of size {list(sizes)} leaves the region {list(view)}"
        total += math.prod(sizes)
    if total != math.prod(view):
        return f"pieces hold {total} elements, the region {list(view)} has {math.prod(view)}"
    if len(boxes) < 2 or nd == 0:
        return None
    dim = max(range(nd), key=lambda d: len({b[0][d] for b in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][dim])
    active: list[tuple[int, int]] = []
    for i in order:
        offsets, sizes = boxes[i]
        while active and active[0][0] <= offsets[dim]:
            heapq.heappop(active)
        budget[0] -= len(active)
        if budget[0] < 0:
            return "too many overlapping candidates to check within the manifest's work bound"
        for _, j in active:
            o2, s2 = boxes[j]
            if all(a < c + w and c < a + z for a, z, c, w in zip(offsets, sizes, o2, s2)):
                return f"pieces at {list(offsets)} and {list(o2)} overlap"
        heapq.heappush(active, (offsets[dim] + sizes[dim], i))
    return None


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    """The manifest's JSON Schema (schema/manifest-v1.schema.json)."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())


@functools.lru_cache(maxsize=1)
def _validator():
    return jsonschema_rs.validator_for(schema())


@functools.lru_cache(maxsize=4096)
def expected_buffers(proto: TensorProto) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name → (shape, stored dtype) of each buffer a tensor of this prototype has on disk (cached;
    callers must not modify the result)."""
    if proto.quantizer is None:
        return {PLAIN_BUFFER: (proto.shape, proto.dtype)}
    values = proto.quantizer.value_dtypes()
    return {n: (spec.shape, values[n]) for n, spec in proto.buffer_specs().items()}


@dataclass(frozen=True)
class BufferEntry:
    """Where one inner buffer lives: file, safetensors key, shape, stored dtype, checksum."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its prototype and its inner buffers (a plain tensor has one, ``data``)."""

    proto: TensorProto
    buffers: dict[str, BufferEntry]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class _TensorTable(Mapping):
    """name → TensorEntry, built on first access from the manifest's columns."""

    def __init__(self, manifest: "Manifest") -> None:
        self._m = manifest
        self._cache: dict[str, TensorEntry] = {}

    def __getitem__(self, name: str) -> TensorEntry:
        entry = self._cache.get(name)
        if entry is None:
            entry = self._cache[name] = self._m._entry(self._m._index[name])
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._m._index)

    def __len__(self) -> int:
        return len(self._m._index)

    def __contains__(self, name: object) -> bool:
        return name in self._m._index


class _ProtoView(Mapping):
    """name → TensorProto, read from the manifest's columns on each access (O(1), no copy)."""

    __slots__ = ("_index", "_protos", "_proto_index")

    def __init__(self, manifest: "Manifest") -> None:
        self._index, self._protos, self._proto_index = manifest._index, manifest.protos, manifest.proto_index

    def __getitem__(self, name: str) -> TensorProto:
        return self._protos[self._proto_index[self._index[name]]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __repr__(self) -> str:
        return f"<{len(self)} prototypes>"


@dataclass
class Manifest:
    """Everything a checkpoint says about itself except the buffer bytes, as columns."""

    names: list[str]
    protos: list[TensorProto]              # distinct prototypes
    proto_index: list[int]                 # per tensor
    files: dict[str, int]                  # file name → size, in file-index order
    file_index: list[list[int]]            # per tensor, per buffer
    checksum_column: Any                   # per tensor, per buffer: list, None, or still deferred (see checksums)
    aliases: dict[int, int] = field(default_factory=dict)
    tree: Any = None                       # None: a flat dict of all tensors, in table order
    metadata: dict[str, str] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = VERSION
    skipped: dict[str, str] = field(default_factory=dict)  # non-strict reads: name → reason
    #: format 1.2: tensor row → per buffer (flatten order) its pieces; such a row's files are []
    chunks: dict[int, list[list[Piece]]] = field(default_factory=dict)
    source: str | None = None              # the file a decoded manifest came from (named by its errors)

    @property
    def checksums(self) -> list[list[int]] | None:
        """Per tensor, per buffer, the XXH3-64 of its bytes (None: saved without). A decoded
        manifest keeps this column as bytes until first used (:class:`tree.DeferredColumn`); it is
        decoded and checked then, and a flaw is a ManifestError naming the tensor."""
        col = self.checksum_column
        if isinstance(col, tree_mod.DeferredColumn):
            col = self.checksum_column = _checked_checksums(col.raw, self)
        return col

    def __post_init__(self) -> None:
        self._index = ({n: i for i, n in enumerate(self.names) if n not in self.skipped} if self.skipped
                       else dict(zip(self.names, range(len(self.names)))))
        self._file_names = list(self.files) or [SELF_FILE]
        self._layouts: dict[int, list] = {}
        self.tensors = _TensorTable(self)

    # --- per-tensor views ---------------------------------------------------------------------
    def proto(self, name: str) -> TensorProto:
        return self.protos[self.proto_index[self._index[name]]]

    def protos_by_name(self) -> Mapping[str, TensorProto]:
        """name → prototype, a read-only view over the columns (nothing is built per tensor)."""
        return _ProtoView(self)

    def _layout(self, p: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(buffer name, shape, stored dtype) of prototype ``p``, in flatten order (cached)."""
        lay = self._layouts.get(p)
        if lay is None:
            lay = self._layouts[p] = [(n, s, d) for n, (s, d) in expected_buffers(self.protos[p]).items()]
        return lay

    def is_chunked(self, name: str) -> bool:
        """True if the tensor is stored as chunks (format 1.2): read it through :meth:`pieces`."""
        return bool(self.chunks) and self._index[name] in self.chunks

    def pieces(self, name: str) -> list[tuple[str, tuple[int, ...], torch.dtype,
                                               list[tuple[str, str, tuple[int, ...], tuple[int, ...], int | None]]]]:
        """Per buffer of a chunked tensor (flatten order): (buffer, region view, stored dtype,
        [(file, key, offsets, sizes, checksum) of each piece])."""
        i = self._index[name]
        p = self.proto_index[i]
        views = region_shapes(self.protos[p])
        out = []
        for (b, _, dtype), view, pcs in zip(self._layout(p), views, self.chunks[i]):
            out.append((b, view, dtype, [(self._file_names[pc.file], chunk_key(name, b, j), pc.offsets, pc.sizes,
                                          pc.checksum) for j, pc in enumerate(pcs)]))
        return out

    def locations(self, name: str) -> list[tuple[str, str, str, tuple[int, ...], torch.dtype, int | None]]:
        """(buffer, file, key, shape, stored dtype, checksum) of each buffer of a tensor — the
        columns read directly, without building entries (the loader's hot path). A chunked
        tensor's buffers (see :meth:`pieces`) are given with their first piece's file, the
        buffer's key and no checksum."""
        i = self._index[name]
        if self.chunks and i in self.chunks:
            return [(b, self._file_names[pcs[0].file] if pcs else self._file_names[0], buffer_key(name, b),
                     shape, dtype, None)
                    for (b, shape, dtype), pcs in zip(self._layout(self.proto_index[i]), self.chunks[i])]
        src = self.aliases.get(i, i)
        src_name, files, sums = self.names[src], self.file_index[src], self.checksums
        return [(b, self._file_names[files[j]], buffer_key(src_name, b), shape, dtype,
                 sums[src][j] if sums is not None else None)
                for j, (b, shape, dtype) in enumerate(self._layout(self.proto_index[i]))]

    def buffers_by_file(self) -> dict[str, list[tuple[str, str, str, tuple[int, ...], torch.dtype]]]:
        """file → (tensor, buffer, key, shape, stored dtype) of every stored buffer (aliases once)."""
        out: dict[str, list] = {}
        by_index: dict[int, list] = {}   # file index → its list in ``out``
        for name, i in self._index.items():
            if i in self.aliases:
                continue
            if self.chunks and i in self.chunks:
                for (b, _, dtype), pcs in zip(self._layout(self.proto_index[i]), self.chunks[i]):
                    for j, pc in enumerate(pcs):
                        out.setdefault(self._file_names[pc.file], []).append(
                            (name, b, chunk_key(name, b, j), pc.sizes, dtype))
                continue
            files = self.file_index[i]
            rows = [(name, b, buffer_key(name, b), shape, dtype) for b, shape, dtype in self._layout(self.proto_index[i])]
            if len(set(files)) == 1:  # the usual case: a tensor's buffers share one file
                target = by_index.get(files[0])
                if target is None:
                    target = by_index[files[0]] = out.setdefault(self._file_names[files[0]], [])
                target.extend(rows)
                continue
            for f, row in zip(files, rows):
                out.setdefault(self._file_names[f], []).append(row)
        return out

    def _entry(self, i: int) -> TensorEntry:
        return TensorEntry(self.protos[self.proto_index[i]],
                           {b: BufferEntry(f, k, s, d, c) for b, f, k, s, d, c in self.locations(self.names[i])})

    def nbytes(self) -> int:
        """Bytes of all buffers (tied tensors counted once)."""
        per_proto = [sum(math.prod(s) * d.itemsize for s, d in expected_buffers(p).values()) if p is not None else 0
                     for p in self.protos]
        if not (self.aliases or self.chunks or self.skipped):  # every row stored whole: a column at a time
            return sum(map(per_proto.__getitem__, self.proto_index))
        total = 0
        for i in self._index.values():
            if i in self.aliases:
                continue
            if self.chunks and i in self.chunks:  # stored bytes: pieces hold no padding
                total += sum(pc.numel * d.itemsize for (_, _, d), pcs in zip(self._layout(self.proto_index[i]),
                                                                            self.chunks[i]) for pc in pcs)
            else:
                total += per_proto[self.proto_index[i]]
        return total

    # --- building and encoding ------------------------------------------------------------------
    @staticmethod
    def from_entries(entries: Mapping[str, TensorEntry], files: Mapping[str, int], *, tree: Any = None,
                     aliases: Mapping[str, str] | None = None, metadata=None, producer=None,
                     chunks: Mapping[str, list[list[tuple]]] | None = None) -> "Manifest":
        """Columns from per-tensor entries (``aliases``: tied name → the name it shares buffers with).

        ``chunks`` (format 1.2): name → per buffer (flatten order) the pieces
        ``(offsets, sizes, file name, checksum)`` of a tensor stored in chunks; its entry has no buffers.
        """
        names = list(entries)
        index = {n: i for i, n in enumerate(names)}
        protos: list[TensorProto] = []
        proto_ids: dict[TensorProto, int] = {}
        file_ids = {f: i for i, f in enumerate(files)} or {SELF_FILE: 0}
        proto_index, file_index, sums = [], [], []
        for name in names:
            e = entries[name]
            proto_index.append(proto_ids.setdefault(e.proto, len(protos)))
            if len(protos) < len(proto_ids):
                protos.append(e.proto)
            file_index.append([file_ids[b.file] for b in e.buffers.values()])
            sums.append([b.checksum for b in e.buffers.values()])
        chunk_rows = {index[n]: [[Piece(tuple(o), tuple(z), file_ids[f], c) for o, z, f, c in pcs] for pcs in per_buffer]
                      for n, per_buffer in (chunks or {}).items()}
        has_sums = all(c is not None for row in sums for c in row) and all(
            pc.checksum is not None for rows in chunk_rows.values() for pcs in rows for pc in pcs)
        if not has_sums:
            chunk_rows = {i: [[pc._replace(checksum=None) for pc in pcs] for pcs in rows] for i, rows in chunk_rows.items()}
        alias_idx = {index[a]: index[b] for a, b in (aliases or {}).items()}
        return Manifest(names, protos, proto_index, dict(files), file_index, sums if has_sums else None,
                        alias_idx, tree, dict(metadata or {}), dict(producer or {}), chunks=chunk_rows)

    def to_bytes(self) -> bytes:
        quantizers: list[Quantizer] = []
        for p in self.protos:
            if p.quantizer is not None and p.quantizer not in quantizers:
                quantizers.append(p.quantizer)
        protos = []
        for p in self.protos:
            q = p.quantizer
            protos.append({
                "shape": list(p.shape), "dtype": dtype_name(p.dtype), "requires_grad": p.requires_grad,
                "quantizer": quantizers.index(q) if q is not None else None,
                "storage": q.tensor_class.__name__ if q is not None else None,
                "scale_layout": "compact" if q is not None else None,
                "buffers": [{"name": n, "shape": list(s), "dtype": dtype_name(d)}
                            for n, (s, d) in expected_buffers(p).items()]})
        tensors = {"names": self.names, "protos": self.proto_index, "files": self.file_index,
                   "checksums": self.checksums}
        if self.aliases:
            tensors["aliases"] = [[i, j] for i, j in self.aliases.items()]
        if self.chunks:
            col: list = [None] * len(self.names)
            for i, rows in self.chunks.items():
                col[i] = {"offsets": [[list(pc.offsets) for pc in pcs] for pcs in rows],
                          "sizes": [[list(pc.sizes) for pc in pcs] for pcs in rows],
                          "files": [[pc.file for pc in pcs] for pcs in rows],
                          "checksums": None if self.checksums is None else [[pc.checksum for pc in pcs] for pcs in rows]}
            tensors["chunks"] = col
        doc = {"format": FORMAT, "version": list(self.version), "producer": self.producer,
               "metadata": self.metadata, "files": [{"name": n, "size": s} for n, s in self.files.items()],
               "quantizers": [q.to_dict() for q in quantizers], "protos": protos, "tensors": tensors}
        if self.tree is not None:
            doc["tree"] = self.tree
        return seal(doc)

    # --- decoding and validation ----------------------------------------------------------------
    @staticmethod
    def from_bytes(data: bytes, *, source: str, strict: bool = True, file_bytes: int | None = None) -> "Manifest":
        """Decode and validate; raises :class:`ManifestError` naming ``source`` on any flaw.

        ``file_bytes``: the size of the file carrying a single-file manifest (a directory's
        manifest lists its files' sizes): no buffer may need more bytes than the files hold."""
        with gc_paused():  # many small objects at once
            return _Decoder(source, strict, file_bytes).decode(data)


def _newer_field(what: str, since: tuple[int, int], version: tuple[int, ...]) -> str:
    return (f"{what} needs format {since[0]}.{since[1]}, the manifest says {version[0]}.{version[1]}: a field newer "
            "than the manifest's version")


def _checked_checksums(raw: bytes, m: "Manifest") -> list[list[int]]:
    """A deferred checksums column, decoded and held to what the decoder checks of every column:
    the schema's rule, ints only, a row per tensor with a checksum per stored buffer (none for a
    chunked tensor, whose pieces carry theirs)."""
    where = "tensors/checksums"
    col = tree_mod.unpack_column(raw, source=m.source, field=where)
    try:
        _column_validator("checksums").validate(col)
    except jsonschema_rs.ValidationError as e:
        path = "/".join(map(str, e.instance_path))
        raise ManifestError(f"manifest breaks the schema at /{where}/{path}: {e.message}", file=m.source,
                            field=where) from None
    except (ValueError, TypeError) as e:
        raise ManifestError(f"manifest holds a value of no JSON type: {e}", file=m.source, field=where) from None
    if len(col) != len(m.names):
        raise ManifestError("tensor columns have different lengths", file=m.source, field=where)
    if not set(map(type, itertools.chain.from_iterable(col))) <= {int}:
        bad = next(i for i, row in enumerate(col) if not set(map(type, row)) <= {int})
        raise ManifestError("holds a number that is not an integer", file=m.source, field=where, tensor=m.names[bad])
    want = [0 if m.chunks and i in m.chunks else len(m._layout(m.proto_index[i])) if m.names[i] not in m.skipped
            else None for i in range(len(m.names))]
    got = list(map(len, col))
    if got != want:
        for i, (a, b) in enumerate(zip(got, want)):
            if b is not None and a != b:
                raise ManifestError(f"{a} checksums for a tensor with {b} stored buffers", file=m.source,
                                    field=where, tensor=m.names[i])
    return col


@functools.lru_cache(maxsize=4)
def _column_validator(column: str):
    """The schema's rule for one ``tensors`` column, alone (with the schema's definitions)."""
    rule = schema()["properties"]["tensors"]["properties"][column]
    return jsonschema_rs.validator_for({"$defs": schema().get("$defs", {}), **rule})


def _small_ints(rows: list[list]) -> bytes | None:
    """The values of ``rows`` as bytes, where every one is an int in [0, 256) (file and prototype
    indices, nearly always): one C-level pass that also proves them ints; None otherwise."""
    try:
        return bytes(itertools.chain.from_iterable(rows))
    except (TypeError, ValueError):
        return None


def _user(cols: dict, proto: int) -> str | None:
    """The first tensor whose prototype is ``proto`` (what an error about the prototype names)."""
    try:
        return cols["names"][cols["protos"].index(proto)]
    except (ValueError, IndexError):
        return None


def _buffer_like_names(names: list[str], buffer_names: frozenset[str]) -> list[int]:
    """Indices of the names ``<prefix>.<suffix>`` whose suffix starts with ``_`` or is a buffer
    name: one regular-expression pass over the joined names (a name holding a newline, which
    would break the join, sends every name through)."""
    joined = "\n".join(names)
    if joined.count("\n") != max(len(names) - 1, 0):
        return list(range(len(names)))
    pattern = r"\.(?:_[^.\n]*|" + "|".join(map(re.escape, sorted(buffer_names))) + r")$"
    found = [m.start() for m in re.finditer(pattern, joined, re.MULTILINE)]
    if not found:
        return []
    starts = list(itertools.accumulate((len(n) + 1 for n in names), initial=0))
    return [bisect.bisect_right(starts, at) - 1 for at in found]


class _Decoder:
    def __init__(self, source: str, strict: bool, file_bytes: int | None = None) -> None:
        self.source, self.strict, self.file_bytes = source, strict, file_bytes

    def fail(self, message: str, *, tensor: str | None = None, field: str | None = None):
        raise ManifestError(message, file=self.source, tensor=tensor, field=field)

    def decode(self, data: bytes) -> Manifest:
        self.size = len(data)
        if len(data) > MAX_MANIFEST_BYTES:
            self.fail(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        seal_ok = sealed(data)
        if seal_ok is False:
            self.fail("manifest does not match its checksum (damaged or edited)", field=MANIFEST_CHECKSUM)
        try:
            doc = tree_mod.unpack_manifest(data, source=self.source)
        except ManifestError as e:
            self.fail(str(e))
        if not isinstance(doc, dict):
            self.fail("manifest is not a map")
        self.check_version(doc)
        if seal_ok is None and (MANIFEST_CHECKSUM in doc or tuple(doc["version"]) >= (1, 1)):
            self.fail(f"a format {doc['version'][0]}.{doc['version'][1]} manifest must end with its "
                      f"{MANIFEST_CHECKSUM}", field=MANIFEST_CHECKSUM)
        tree = doc.pop("tree", None)
        cols = doc.get("tensors")
        # unpack_manifest keeps the checksums column as bytes (or nil): Manifest.checksums checks it
        # against its schema rule, and its rows, at first use
        deferred = type(cols) is dict and isinstance(cols.get("checksums"), tree_mod.DeferredColumn)
        try:
            _validator().validate(dict(doc, tensors={**cols, "checksums": []}) if deferred else doc)
        except jsonschema_rs.ValidationError as e:
            path = "/".join(map(str, e.instance_path))
            self.fail(f"manifest breaks the schema at /{path}: {e.message}", field=path or None)
        except (ValueError, TypeError) as e:  # a value no JSON type describes (bytes, ext types)
            self.fail(f"manifest holds a value of no JSON type: {e}")
        file_codes = _small_ints(doc["tensors"]["files"])  # every file index as bytes: ints below 256
        self.require_ints(doc, files_are_ints=file_codes is not None)
        self.check_field_versions(doc, has_trailer=seal_ok is not None)
        files = {}
        for f in doc["files"]:
            if f["name"] in files:
                self.fail(f"file {f['name']!r} listed twice", field="files")
            files[f["name"]] = f["size"]
        if files:
            self.file_bytes = sum(files.values())
        self.check_grouped(doc)
        bad_quantizers: dict[int, str] = {}
        quantizers: list[Quantizer | None] = []
        for i, qd in enumerate(doc["quantizers"]):
            try:
                quantizers.append(Quantizer.from_dict(qd))
            except TeSerialError as e:
                if self.strict:
                    self.fail(str(e), field=f"quantizers/{i}")
                quantizers.append(None)
                bad_quantizers[i] = str(e)
        protos, bad_protos = self.protos(doc["protos"], quantizers, bad_quantizers, doc["tensors"])
        cols = doc["tensors"]
        names, proto_index, file_index = cols["names"], cols["protos"], cols["files"]
        checksum_column = cols.get("checksums")
        n = len(names)
        if len(proto_index) != n or len(file_index) != n:
            self.fail("tensor columns have different lengths", field="tensors")
        if len(set(names)) != n:
            self.fail("tensor names are not unique", field="tensors/names")
        nbuf = [len(expected_buffers(p)) if p is not None else -1 for p in protos]
        n_files = max(len(files), 1)
        chunk_col = cols.get("chunks")
        if chunk_col is not None:
            if tuple(doc["version"]) < CHUNKS_VERSION:
                self.fail(f"tensors.chunks needs format {CHUNKS_VERSION[0]}.{CHUNKS_VERSION[1]}, the manifest says "
                          f"{doc['version'][0]}.{doc['version'][1]}", field="tensors/chunks")
            if len(chunk_col) != n:
                self.fail("tensor columns have different lengths", field="tensors/chunks")
        skipped = {}
        rows_ok = (chunk_col is None and not bad_protos and max(proto_index, default=-1) < len(protos)
                   and self.rows_fit(proto_index, file_index, file_codes, nbuf, n_files))
        for i in range(0 if rows_ok else n):  # the loop names the first tensor at fault
            p = proto_index[i]
            if p >= len(protos):
                self.fail(f"prototype index {p} out of range", tensor=names[i], field="tensors/protos")
            if p in bad_protos:
                if self.strict:  # unreachable: protos() already raised
                    self.fail(bad_protos[p], tensor=names[i])
                skipped[names[i]] = bad_protos[p]
                continue
            row = file_index[i]
            if chunk_col is not None and chunk_col[i] is not None:
                if row:
                    self.fail("a chunked tensor's files row must be empty", tensor=names[i], field="tensors/files")
                continue
            if len(row) != nbuf[p]:
                self.fail(f"{len(row)} buffer files for a prototype with {nbuf[p]} buffers",
                          tensor=names[i], field="tensors/files")
            if row and max(row) >= n_files:
                self.fail("buffer file index out of range", tensor=names[i], field="tensors/files")
        aliases = {}
        for a, b in cols.get("aliases", []):
            if a >= n or b >= n or a == b or proto_index[a] != proto_index[b]:
                self.fail(f"bad alias [{a}, {b}]", field="tensors/aliases")
            aliases[a] = b
        if any(b in aliases for b in aliases.values()):
            self.fail("an alias points to another alias", field="tensors/aliases")
        chunks = self.chunks(chunk_col, names, protos, proto_index, aliases, skipped, checksum_column is not None,
                             n_files) if chunk_col is not None else {}
        self.check_keys_unique(names, protos, proto_index, aliases, skipped)
        if chunks:
            self.check_piece_keys(names, protos, proto_index, aliases, skipped, chunks)
        if tree is not None:
            try:
                refs = tree_mod.check_tree(tree, source=self.source)
            except ManifestError as e:
                self.fail(str(e), field="tree")
            known = set(names)
            unknown = [r for r in refs if r not in known]
            if unknown:
                self.fail(f"tree refers to tensors not in the table: {unknown[:5]}", field="tree")
        return Manifest(names, protos, proto_index, files, file_index, checksum_column, aliases, tree,
                        dict(doc["metadata"]), dict(doc["producer"]), tuple(doc["version"]), skipped, chunks,
                        source=self.source)

    def chunks(self, col: list, names, protos, proto_index, aliases, skipped, has_sums: bool,
               n_files: int) -> dict[int, list[list[Piece]]]:
        """Format 1.2's ``tensors.chunks``: per chunked tensor and buffer, pieces that tile the
        buffer's region view exactly, in files that exist, with checksums iff the checkpoint has
        them. Overlap checks spend a budget proportional to the manifest's size."""
        budget = [8 * self.size + 100_000]
        tied = set(aliases) | set(aliases.values())
        out: dict[int, list[list[Piece]]] = {}
        for i, entry in enumerate(col):
            if entry is None or names[i] in skipped:
                continue
            name = names[i]
            where = "tensors/chunks"
            if i in tied:
                self.fail("a chunked tensor cannot be tied to another", tensor=name, field=where)
            proto = protos[proto_index[i]]
            layout = list(expected_buffers(proto).items())
            views = region_shapes(proto)
            offs, sizes, files, sums = entry["offsets"], entry["sizes"], entry["files"], entry.get("checksums")
            if (sums is not None) != has_sums:
                self.fail("chunk checksums must be given exactly when the checkpoint has checksums",
                          tensor=name, field=where)
            if not (len(offs) == len(sizes) == len(files) == len(layout)) or (sums is not None and len(sums) != len(layout)):
                self.fail(f"chunks must list {len(layout)} buffers", tensor=name, field=where)
            rows = []
            for b, ((bname, _), view) in enumerate(zip(layout, views)):
                o_b, s_b, f_b = offs[b], sizes[b], files[b]
                c_b = sums[b] if sums is not None else None
                if not (len(o_b) == len(s_b) == len(f_b)) or (c_b is not None and len(c_b) != len(o_b)):
                    self.fail(f"buffer {bname}: chunk columns have different lengths", tensor=name, field=where)
                if f_b and max(f_b) >= n_files:
                    self.fail(f"buffer {bname}: piece file index out of range", tensor=name, field=where)
                boxes = [(tuple(o), tuple(z)) for o, z in zip(o_b, s_b)]
                why = check_tiling(view, boxes, budget)
                if why is not None:
                    self.fail(f"buffer {bname}: pieces do not tile its region {list(view)}: {why}",
                              tensor=name, field=where)
                rows.append([Piece(o, z, f, c_b[j] if c_b is not None else None)
                             for j, ((o, z), f) in enumerate(zip(boxes, f_b))])
            out[i] = rows
        return out

    def check_piece_keys(self, names, protos, proto_index, aliases, skipped, chunks) -> None:
        """No whole-stored buffer's key equals a piece key ``<buffer key>@<j>`` of a chunked tensor."""
        pieces: dict[str, int] | None = None
        for i, name in enumerate(names):
            if "@" not in name or i in chunks or i in aliases or name in skipped:
                continue
            if pieces is None:
                pieces = {}
                for c, rows in chunks.items():
                    for (b, _), pcs in zip(expected_buffers(protos[proto_index[c]]).items(), rows):
                        pieces[buffer_key(names[c], b)] = len(pcs)
            for b in expected_buffers(protos[proto_index[i]]):
                m = _PIECE_KEY.fullmatch(buffer_key(name, b))
                if m and int(m.group(2)) < pieces.get(m.group(1), 0):
                    self.fail(f"tensor {name!r} would read the same safetensors key as a piece of a chunked tensor",
                              tensor=name, field="tensors/names")

    @staticmethod
    def rows_fit(proto_index: list, file_index: list, file_codes: bytes | None, nbuf: list, n_files: int) -> bool:
        """Every tensor's files row has its prototype's buffer count, and every file index names a
        listed file (``file_codes``: the indices as bytes, where they fit): the per-tensor loop's
        checks, a column at a time."""
        if list(map(len, file_index)) != list(map(nbuf.__getitem__, proto_index)):
            return False
        return max(file_codes if file_codes is not None else itertools.chain.from_iterable(file_index),
                   default=-1) < n_files

    def check_keys_unique(self, names, protos, proto_index, aliases, skipped) -> None:
        """No two stored buffers share a safetensors key. Buffer names hold no dot, so the only way
        is a plain tensor named ``<quantized tensor>.<one of its buffers>`` (``_<name>``, or a grouped
        tensor's TE names such as ``rowwise_data``)."""
        position = None
        buffer_names = {b for cls in STORAGE_REGISTRY.values() for b in cls.BUFFERS}
        # only names whose last component could be a buffer's need a look: found a column at a time
        candidates = _buffer_like_names(names, frozenset(buffer_names))
        for i in candidates:
            name = names[i]
            p = protos[proto_index[i]] if name not in skipped else None
            if p is None or p.quantizer is not None or i in aliases or "." not in name:
                continue
            prefix, suffix = name.rsplit(".", 1)
            if not (suffix.startswith("_") or suffix in buffer_names):
                continue
            position = position or {n: j for j, n in enumerate(names)}
            j = position.get(prefix)
            if j is not None and j not in aliases and names[j] not in skipped \
                    and suffix in expected_buffers(protos[proto_index[j]]):
                self.fail(f"plain tensor {name!r} would read the same safetensors key as buffer {suffix} "
                          f"of tensor {prefix!r}", tensor=name, field="tensors/names")

    def require_ints(self, doc: dict, files_are_ints: bool = False) -> None:
        """Indices, sizes and shapes must be ints: JSON Schema's "integer" also admits 1.0
        (``files_are_ints``: the files column is already known to hold ints; the checksums column is
        checked where it is decoded, at first use)."""
        def ints(values) -> bool:
            return set(map(type, values)) <= {int}

        def check(values, where: str) -> None:
            if not ints(values):
                self.fail("holds a number that is not an integer", field=where)
        check([f["size"] for f in doc["files"]], "files")
        for i, p in enumerate(doc["protos"]):
            check(p["shape"], f"protos/{i}/shape")
            check([p["quantizer"]] if p["quantizer"] is not None else [], f"protos/{i}/quantizer")
            for j, b in enumerate(p["buffers"]):
                check(b["shape"], f"protos/{i}/buffers/{j}/shape")
        cols = doc["tensors"]
        chain = itertools.chain.from_iterable
        for column, rows in (("protos", [cols["protos"]]), ("files", [] if files_are_ints else cols["files"])):
            if _small_ints(rows) is None and not ints(chain(rows)):  # slow path on failure: name the tensor
                for i, row in enumerate(cols[column]):
                    if not ints(row if isinstance(row, list) else [row]):
                        self.fail("holds a number that is not an integer", field=f"tensors/{column}",
                                  tensor=cols["names"][i] if i < len(cols["names"]) else None)
        check(list(chain(cols.get("aliases", []))), "tensors/aliases")
        for i, entry in enumerate(cols.get("chunks") or []):
            if entry is None:
                continue
            nums = list(chain(chain(entry["offsets"]))) + list(chain(chain(entry["sizes"]))) \
                + list(chain(entry["files"])) + list(chain(entry.get("checksums") or []))
            if not ints(nums):
                self.fail("holds a number that is not an integer", field="tensors/chunks",
                          tensor=cols["names"][i] if i < len(cols["names"]) else None)

    def protos(self, raw: list, quantizers: list, bad_quantizers: dict, cols: dict) -> tuple[list, dict]:
        """Every prototype, checked against the checkpoint's size and its declared buffers. A
        non-strict read skips (None, and the reason in the second value) only a prototype whose
        quantizer this te-serial cannot rebuild (a kind or field of a newer version, schema/README.md
        §10); any other flaw is refused whatever ``strict`` says, naming the first tensor that uses
        the prototype (``cols``: the tensor columns) and the field."""
        protos: list[TensorProto | None] = []
        bad: dict[int, str] = {}
        for i, d in enumerate(raw):
            where = f"protos/{i}"
            if self.file_bytes is not None:  # the declared buffers, before anything is built from them
                for j, b in enumerate(d["buffers"]):
                    try:
                        itemsize = dtype_from_name(b["dtype"]).itemsize
                    except TeSerialError as e:
                        self.fail(str(e), tensor=_user(cols, i), field=f"{where}/buffers/{j}/dtype")
                    if math.prod(b["shape"]) * itemsize > self.file_bytes:
                        self.fail(f"buffer {b['name']} of shape {list(b['shape'])} needs more bytes than the "
                                  f"checkpoint's files hold ({self.file_bytes})", tensor=_user(cols, i),
                                  field=f"{where}/buffers/{j}/shape")
            q_idx = d["quantizer"]
            if q_idx in bad_quantizers:  # a quantizer from a newer te-serial (strict reads failed at it)
                protos.append(None)
                bad[i] = bad_quantizers[q_idx]
                continue
            try:
                if q_idx is not None and q_idx >= len(quantizers):
                    raise ManifestError(f"quantizer index {q_idx} out of range")
                q = quantizers[q_idx] if q_idx is not None else None
                proto = TensorProto(tuple(d["shape"]), dtype_from_name(d["dtype"]), q, d["requires_grad"])
                storage = d.get("storage")
                if storage is not None:
                    if q is None:
                        raise ManifestError("a plain tensor has no storage class")
                    if resolve_storage(storage) not in (q.tensor_class, q.storage_class):
                        raise ManifestError(f"storage {storage!r} does not hold {q.kind} tensors")
                if q is None and d.get("scale_layout") is not None:  # the schema allows "compact" or nil
                    raise ManifestError("a plain tensor has no scale layout")
                want = expected_buffers(proto)
                for b, (s, dt) in want.items():
                    if not addressable(s, dt.itemsize):
                        raise ManifestError(f"buffer {b} of shape {list(s)} is larger than torch can lay out")
                got = [(b["name"], tuple(b["shape"]), dtype_from_name(b["dtype"])) for b in d["buffers"]]
                expect = [(name, s, dt) for name, (s, dt) in want.items()]
                if got != expect:
                    raise ManifestError(
                        "buffers " + ", ".join(f"{b}:{dtype_name(dt)}{list(s)}" for b, s, dt in got)
                        + " disagree with the prototype's "
                        + ", ".join(f"{b}:{dtype_name(dt)}{list(s)}" for b, s, dt in expect))
                protos.append(proto)
            except TeSerialError as e:
                self.fail(str(e), field=where, tensor=_user(cols, i))
        return protos, bad

    def check_field_versions(self, doc: dict, *, has_trailer: bool) -> None:
        """Every field added after format 1.0 needs a manifest of its version or later
        (schema/README.md §10, "Field versions"): ``manifest_checksum`` 1.1, quantizer kinds and fields a
        format added later (``Quantizer.KIND_VERSION``, ``FIELD_VERSIONS``, in grouped members too).
        ``tensors.chunks`` (1.2) and kind ``grouped`` (1.3) are checked where they are read."""
        version = tuple(doc["version"])
        if version < CHECKSUM_VERSION and (has_trailer or MANIFEST_CHECKSUM in doc):
            self.fail(_newer_field(MANIFEST_CHECKSUM, CHECKSUM_VERSION, version), field=MANIFEST_CHECKSUM)
        for i, qd in enumerate(doc["quantizers"]):
            where = f"quantizers/{i}"
            while isinstance(qd, dict):
                cls = QUANTIZER_REGISTRY.get(qd.get("kind"))
                since = getattr(cls, "KIND_VERSION", (1, 0))
                if version < since:
                    self.fail(_newer_field(f"quantizer kind {cls.kind!r}", since, version), field=f"{where}/kind")
                for name, since in getattr(cls, "FIELD_VERSIONS", {}).items():
                    if name in qd and version < since:
                        self.fail(_newer_field(f"{cls.kind} field {name}", since, version), field=f"{where}/{name}")
                qd, where = qd.get("member"), f"{where}/member"

    def check_grouped(self, doc: dict) -> None:
        """Grouped quantizers need format 1.3, and all of them together list at most
        :data:`MAX_GROUPED_MEMBERS` members (checked before any is parsed)."""
        grouped = [i for i, qd in enumerate(doc["quantizers"])
                   if getattr(QUANTIZER_REGISTRY.get(qd["kind"]), "is_container", False)]
        if not grouped:
            return
        if tuple(doc["version"]) < GROUPED_VERSION:
            self.fail(f"grouped tensors need format {GROUPED_VERSION[0]}.{GROUPED_VERSION[1]}, the manifest says "
                      f"{doc['version'][0]}.{doc['version'][1]}", field=f"quantizers/{grouped[0]}")
        total = 0
        for i in grouped:
            shapes = doc["quantizers"][i].get("member_shapes")
            total += len(shapes) if isinstance(shapes, list) else 0
            if total > MAX_GROUPED_MEMBERS:
                self.fail(f"grouped quantizers list more than {MAX_GROUPED_MEMBERS} members together",
                          field=f"quantizers/{i}/member_shapes")

    def check_version(self, doc: dict) -> None:
        if doc.get("format") != FORMAT:
            self.fail(f"not a te-serial manifest (format={doc.get('format')!r})", field="format")
        version = doc.get("version")
        if (not isinstance(version, list) or len(version) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)):
            self.fail(f"bad format version {version!r}", field="version")
        if version[0] > VERSION[0]:
            raise VersionError(f"checkpoint format version {version[0]}.{version[1]} is newer than this "
                               f"te-serial reads ({VERSION[0]}.x); upgrade te-serial", file=self.source,
                               field="version")
