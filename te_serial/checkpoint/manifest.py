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

import functools
import gc
import itertools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Iterator, Mapping

import jsonschema_rs
import msgpack
import torch
import xxhash

from ..dtypes import dtype_from_name, dtype_name
from ..errors import ManifestError, TeSerialError, VersionError
from ..formats.base import Quantizer, resolve_storage
from ..proto import TensorProto
from . import tree as tree_mod

FORMAT = "te-serial"
VERSION = (1, 1)
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


@dataclass
class Manifest:
    """Everything a checkpoint says about itself except the buffer bytes, as columns."""

    names: list[str]
    protos: list[TensorProto]              # distinct prototypes
    proto_index: list[int]                 # per tensor
    files: dict[str, int]                  # file name → size, in file-index order
    file_index: list[list[int]]            # per tensor, per buffer
    checksums: list[list[int]] | None      # per tensor, per buffer
    aliases: dict[int, int] = field(default_factory=dict)
    tree: Any = None                       # None: a flat dict of all tensors, in table order
    metadata: dict[str, str] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = VERSION
    skipped: dict[str, str] = field(default_factory=dict)  # non-strict reads: name → reason

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.names) if n not in self.skipped}
        self._file_names = list(self.files) or [SELF_FILE]
        self._layouts: dict[int, list] = {}
        self.tensors = _TensorTable(self)

    # --- per-tensor views ---------------------------------------------------------------------
    def proto(self, name: str) -> TensorProto:
        return self.protos[self.proto_index[self._index[name]]]

    def protos_by_name(self) -> dict[str, TensorProto]:
        protos, idx = self.protos, self.proto_index
        return {n: protos[idx[i]] for n, i in self._index.items()}

    def _layout(self, p: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(buffer name, shape, stored dtype) of prototype ``p``, in flatten order (cached)."""
        lay = self._layouts.get(p)
        if lay is None:
            lay = self._layouts[p] = [(n, s, d) for n, (s, d) in expected_buffers(self.protos[p]).items()]
        return lay

    def locations(self, name: str) -> list[tuple[str, str, str, tuple[int, ...], torch.dtype, int | None]]:
        """(buffer, file, key, shape, stored dtype, checksum) of each buffer of a tensor — the
        columns read directly, without building entries (the loader's hot path)."""
        i = self._index[name]
        src = self.aliases.get(i, i)
        src_name, files, sums = self.names[src], self.file_index[src], self.checksums
        return [(b, self._file_names[files[j]], buffer_key(src_name, b), shape, dtype,
                 sums[src][j] if sums is not None else None)
                for j, (b, shape, dtype) in enumerate(self._layout(self.proto_index[i]))]

    def buffers_by_file(self) -> dict[str, list[tuple[str, str, str, tuple[int, ...], torch.dtype]]]:
        """file → (tensor, buffer, key, shape, stored dtype) of every stored buffer (aliases once)."""
        out: dict[str, list] = {}
        for name, i in self._index.items():
            if i in self.aliases:
                continue
            files = self.file_index[i]
            for j, (b, shape, dtype) in enumerate(self._layout(self.proto_index[i])):
                out.setdefault(self._file_names[files[j]], []).append(
                    (name, b, buffer_key(name, b), shape, dtype))
        return out

    def _entry(self, i: int) -> TensorEntry:
        return TensorEntry(self.protos[self.proto_index[i]],
                           {b: BufferEntry(f, k, s, d, c) for b, f, k, s, d, c in self.locations(self.names[i])})

    def nbytes(self) -> int:
        """Bytes of all buffers (tied tensors counted once)."""
        per_proto = [sum(math.prod(s) * d.itemsize for s, d in expected_buffers(p).values()) if p is not None else 0
                     for p in self.protos]
        return sum(per_proto[self.proto_index[i]] for i in self._index.values() if i not in self.aliases)

    # --- building and encoding ------------------------------------------------------------------
    @staticmethod
    def from_entries(entries: Mapping[str, TensorEntry], files: Mapping[str, int], *, tree: Any = None,
                     aliases: Mapping[str, str] | None = None, metadata=None, producer=None) -> "Manifest":
        """Columns from per-tensor entries (``aliases``: tied name → the name it shares buffers with)."""
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
        has_sums = all(c is not None for row in sums for c in row)
        alias_idx = {index[a]: index[b] for a, b in (aliases or {}).items()}
        return Manifest(names, protos, proto_index, dict(files), file_index, sums if has_sums else None,
                        alias_idx, tree, dict(metadata or {}), dict(producer or {}))

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
        doc = {"format": FORMAT, "version": list(self.version), "producer": self.producer,
               "metadata": self.metadata, "files": [{"name": n, "size": s} for n, s in self.files.items()],
               "quantizers": [q.to_dict() for q in quantizers], "protos": protos, "tensors": tensors}
        if self.tree is not None:
            doc["tree"] = self.tree
        return seal(doc)

    # --- decoding and validation ----------------------------------------------------------------
    @staticmethod
    def from_bytes(data: bytes, *, source: str, strict: bool = True) -> "Manifest":
        """Decode and validate; raises :class:`ManifestError` naming ``source`` on any flaw."""
        # Decoding creates many small objects at once; a cyclic-GC pass in the middle of it
        # (likelier the more objects the process holds) would cost more than the decode.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return _Decoder(source, strict).decode(data)
        finally:
            if enabled:
                gc.enable()


class _Decoder:
    def __init__(self, source: str, strict: bool) -> None:
        self.source, self.strict = source, strict

    def fail(self, message: str, *, tensor: str | None = None, field: str | None = None):
        raise ManifestError(message, file=self.source, tensor=tensor, field=field)

    def decode(self, data: bytes) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            self.fail(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        seal_ok = sealed(data)
        if seal_ok is False:
            self.fail("manifest does not match its checksum (damaged or edited)", field=MANIFEST_CHECKSUM)
        try:
            doc = tree_mod.unpack(data)
        except ManifestError as e:
            self.fail(str(e))
        if not isinstance(doc, dict):
            self.fail("manifest is not a map")
        self.check_version(doc)
        if seal_ok is None and (MANIFEST_CHECKSUM in doc or tuple(doc["version"]) >= (1, 1)):
            self.fail(f"a format {doc['version'][0]}.{doc['version'][1]} manifest must end with its "
                      f"{MANIFEST_CHECKSUM}", field=MANIFEST_CHECKSUM)
        tree = doc.pop("tree", None)
        try:
            _validator().validate(doc)
        except jsonschema_rs.ValidationError as e:
            path = "/".join(map(str, e.instance_path))
            self.fail(f"manifest breaks the schema at /{path}: {e.message}", field=path or None)
        except (ValueError, TypeError) as e:  # a value no JSON type describes (bytes, ext types)
            self.fail(f"manifest holds a value of no JSON type: {e}")
        self.require_ints(doc)
        files = {}
        for f in doc["files"]:
            if f["name"] in files:
                self.fail(f"file {f['name']!r} listed twice", field="files")
            files[f["name"]] = f["size"]
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
        protos, bad_protos = self.protos(doc["protos"], quantizers, bad_quantizers)
        cols = doc["tensors"]
        names, proto_index, file_index = cols["names"], cols["protos"], cols["files"]
        checksums = cols.get("checksums")
        n = len(names)
        if len(proto_index) != n or len(file_index) != n or (checksums is not None and len(checksums) != n):
            self.fail("tensor columns have different lengths", field="tensors")
        if len(set(names)) != n:
            self.fail("tensor names are not unique", field="tensors/names")
        nbuf = [len(expected_buffers(p)) if p is not None else -1 for p in protos]
        n_files = max(len(files), 1)
        skipped = {}
        for i in range(n):
            p = proto_index[i]
            if p >= len(protos):
                self.fail(f"prototype index {p} out of range", tensor=names[i], field="tensors/protos")
            if p in bad_protos:
                if self.strict:  # unreachable: protos() already raised
                    self.fail(bad_protos[p], tensor=names[i])
                skipped[names[i]] = bad_protos[p]
                continue
            row = file_index[i]
            if len(row) != nbuf[p] or (checksums is not None and len(checksums[i]) != nbuf[p]):
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
        self.check_keys_unique(names, protos, proto_index, aliases, skipped)
        if tree is not None:
            try:
                refs = tree_mod.tree_refs(tree)
            except ManifestError as e:
                self.fail(str(e), field="tree")
            known = set(names)
            unknown = [r for r in refs if r not in known]
            if unknown:
                self.fail(f"tree refers to tensors not in the table: {unknown[:5]}", field="tree")
        return Manifest(names, protos, proto_index, files, file_index, checksums, aliases, tree,
                        dict(doc["metadata"]), dict(doc["producer"]), tuple(doc["version"]), skipped)

    def check_keys_unique(self, names, protos, proto_index, aliases, skipped) -> None:
        """No two stored buffers share a safetensors key. Buffer names hold no dot, so the only way
        is a plain tensor named ``<quantized tensor>.<one of its buffers>``."""
        position = None
        for i, name in enumerate(names):
            p = protos[proto_index[i]] if name not in skipped else None
            if p is None or p.quantizer is not None or i in aliases or "." not in name:
                continue
            prefix, suffix = name.rsplit(".", 1)
            if not suffix.startswith("_"):
                continue
            position = position or {n: j for j, n in enumerate(names)}
            j = position.get(prefix)
            if j is not None and j not in aliases and names[j] not in skipped \
                    and suffix in expected_buffers(protos[proto_index[j]]):
                self.fail(f"plain tensor {name!r} would read the same safetensors key as buffer {suffix} "
                          f"of tensor {prefix!r}", tensor=name, field="tensors/names")

    def require_ints(self, doc: dict) -> None:
        """Indices, sizes and shapes must be ints: JSON Schema's "integer" also admits 1.0."""
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
        for column, rows in (("protos", [cols["protos"]]), ("files", cols["files"]),
                             ("checksums", cols.get("checksums") or [])):
            if not ints(chain(rows)):  # slow path only on failure: name the tensor
                for i, row in enumerate(cols[column]):
                    if not ints(row if isinstance(row, list) else [row]):
                        self.fail("holds a number that is not an integer", field=f"tensors/{column}",
                                  tensor=cols["names"][i] if i < len(cols["names"]) else None)
        check(list(chain(cols.get("aliases", []))), "tensors/aliases")

    def protos(self, raw: list, quantizers: list, bad_quantizers: dict) -> tuple[list, dict]:
        protos: list[TensorProto | None] = []
        bad: dict[int, str] = {}
        for i, d in enumerate(raw):
            where = f"protos/{i}"
            try:
                q_idx = d["quantizer"]
                if q_idx is not None and q_idx >= len(quantizers):
                    raise ManifestError(f"quantizer index {q_idx} out of range")
                if q_idx in bad_quantizers:
                    raise ManifestError(bad_quantizers[q_idx])
                q = quantizers[q_idx] if q_idx is not None else None
                proto = TensorProto(tuple(d["shape"]), dtype_from_name(d["dtype"]), q, d["requires_grad"])
                storage = d.get("storage")
                if storage is not None:
                    if q is None:
                        raise ManifestError("a plain tensor has no storage class")
                    if resolve_storage(storage) not in (q.tensor_class, q.storage_class):
                        raise ManifestError(f"storage {storage!r} does not hold {q.kind} tensors")
                want = expected_buffers(proto)
                got = [(b["name"], tuple(b["shape"]), dtype_from_name(b["dtype"])) for b in d["buffers"]]
                expect = [(name, s, dt) for name, (s, dt) in want.items()]
                if got != expect:
                    raise ManifestError(
                        "buffers " + ", ".join(f"{b}:{dtype_name(dt)}{list(s)}" for b, s, dt in got)
                        + " disagree with the prototype's "
                        + ", ".join(f"{b}:{dtype_name(dt)}{list(s)}" for b, s, dt in expect))
                protos.append(proto)
            except TeSerialError as e:
                if self.strict:
                    self.fail(str(e), field=where)
                protos.append(None)
                bad[i] = str(e)
        return protos, bad

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
