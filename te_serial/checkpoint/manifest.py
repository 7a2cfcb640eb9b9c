"""The checkpoint manifest: dataclasses ↔ msgpack, validated against ``schema/`` before use.

Reading is validation first: the schema (fastjsonschema, compiled once from the versioned JSON
Schema), then each entry's invariants — the quantizer resolves through the registry, and every
buffer's name, shape and dtype equals what the prototype's quantizer describes — so a reader
never allocates from a manifest it has not checked.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

import fastjsonschema
import torch
import xxhash

from ..dtypes import dtype_from_name, dtype_name
from ..errors import ManifestError, TeSerialError, VersionError
from ..formats.base import resolve_storage
from ..proto import TensorProto
from . import tree as tree_mod

FORMAT = "te-serial"
VERSION = (1, 0)
MANIFEST_NAME = "te_serial.msgpack"
HEADER_KEY = "te_serial.manifest"
SCHEMA_FILE = "manifest-v1.schema.json"
MAX_MANIFEST_BYTES = 1 << 28
#: a buffer's ``file`` is this in a single-file checkpoint: the file carrying the manifest
SELF_FILE = ""
PLAIN_BUFFER = "data"


def checksum(t: torch.Tensor) -> str:
    """``xxh3_64:<hex>`` of a CPU tensor's bytes (xxHash: fast, well kept; not a security hash)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return "xxh3_64:" + xxhash.xxh3_64(b"").hexdigest()
    data = flat.view(torch.uint8) if flat.dtype.itemsize != 1 else flat
    return "xxh3_64:" + xxhash.xxh3_64(memoryview(data.view(torch.uint8).numpy())).hexdigest()


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    """The manifest's JSON Schema (schema/manifest-v1.schema.json)."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())


@functools.lru_cache(maxsize=1)
def _validator():
    return fastjsonschema.compile(schema())


@dataclass(frozen=True)
class BufferEntry:
    """Where one inner buffer lives: file, safetensors key, shape and stored (true) dtype."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_dict(self) -> dict:
        return {"file": self.file, "key": self.key, "shape": list(self.shape),
                "dtype": dtype_name(self.dtype), "checksum": self.checksum}

    @staticmethod
    def from_dict(d: Mapping) -> "BufferEntry":
        return BufferEntry(d["file"], d["key"], tuple(d["shape"]), dtype_from_name(d["dtype"]),
                           d.get("checksum"))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its prototype and its inner buffers (a plain tensor has one, ``data``)."""

    proto: TensorProto
    buffers: dict[str, BufferEntry]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def expected_buffers(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name → (shape, stored dtype) that the prototype demands."""
        return expected_buffers(self.proto)

    def to_dict(self) -> dict:
        q = self.proto.quantizer
        return {**self.proto.to_dict(),
                "storage": q.tensor_class.__name__ if q is not None else None,
                "scale_layout": "compact" if q is not None else None,
                "buffers": {n: b.to_dict() for n, b in self.buffers.items()}}


def expected_buffers(proto: TensorProto) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name → (shape, stored dtype) of each buffer a tensor of this prototype has on disk."""
    if proto.quantizer is None:
        return {PLAIN_BUFFER: (proto.shape, proto.dtype)}
    values = proto.quantizer.value_dtypes()
    return {n: (spec.shape, values[n]) for n, spec in proto.buffer_specs().items()}


def _entry_from_dict(name: str, d: Mapping) -> TensorEntry:
    proto = TensorProto.from_dict(d)
    storage = d.get("storage")
    if proto.quantizer is not None and storage is not None:
        cls = resolve_storage(storage)
        if cls not in (proto.quantizer.tensor_class, proto.quantizer.storage_class):
            raise ManifestError(f"storage {storage!r} does not hold {proto.quantizer.kind} tensors")
    elif proto.quantizer is None and storage is not None:
        raise ManifestError("a plain tensor has no storage class")
    buffers = {n: BufferEntry.from_dict(b) for n, b in d["buffers"].items()}
    want = expected_buffers(proto)
    if set(buffers) != set(want):
        raise ManifestError(f"buffers {sorted(buffers)} but its prototype has {sorted(want)}")
    for n, b in buffers.items():
        shape, dtype = want[n]
        if b.shape != shape or b.dtype != dtype:
            raise ManifestError(f"buffer {n} is {dtype_name(b.dtype)}{list(b.shape)} but its prototype "
                                f"needs {dtype_name(dtype)}{list(shape)}")
    return TensorEntry(proto, buffers)


@dataclass
class Manifest:
    """Everything a checkpoint says about itself, except the buffer bytes."""

    tensors: dict[str, TensorEntry]
    files: dict[str, int]
    tree: Any
    metadata: dict[str, str] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = VERSION
    #: tensors left out by a non-strict read, with the reason
    skipped: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "version": list(self.version), "producer": self.producer,
               "metadata": self.metadata, "files": self.files,
               "tensors": {n: e.to_dict() for n, e in self.tensors.items()}, "tree": self.tree}
        return tree_mod.pack(doc)

    @staticmethod
    def from_bytes(data: bytes, *, source: str, strict: bool = True) -> "Manifest":
        """Decode and validate; raises :class:`ManifestError` (naming ``source``) on any flaw."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit",
                                file=source)
        try:
            doc = tree_mod.unpack(data)
        except ManifestError as e:
            raise ManifestError(str(e), file=source) from None
        if not isinstance(doc, dict):
            raise ManifestError("manifest is not a map", file=source)
        _check_version(doc, source)
        tree = doc.pop("tree", None)
        try:
            _validator()(doc)
        except fastjsonschema.JsonSchemaException as e:
            raise ManifestError(f"manifest breaks the schema: {e.message}", file=source,
                                field=getattr(e, "name", None)) from None
        tensors, skipped = {}, {}
        for name, d in doc["tensors"].items():
            try:
                entry = _entry_from_dict(name, d)
                for b in entry.buffers.values():
                    if b.file != SELF_FILE and b.file not in doc["files"]:
                        raise ManifestError(f"buffer file {b.file!r} is not in the file list")
                tensors[name] = entry
            except TeSerialError as e:
                if strict:
                    raise ManifestError(str(e), file=source, tensor=name) from None
                skipped[name] = str(e)
        try:
            refs = tree_mod.tree_refs(tree)
        except ManifestError as e:
            raise ManifestError(str(e), file=source, field="tree") from None
        unknown = [r for r in refs if r not in tensors and r not in skipped]
        if unknown:
            raise ManifestError(f"tree refers to tensors not in the table: {unknown[:5]}", file=source,
                                field="tree")
        return Manifest(tensors, dict(doc["files"]), tree, dict(doc["metadata"]), dict(doc["producer"]),
                        tuple(doc["version"]), skipped)


def _check_version(doc: dict, source: str) -> None:
    if doc.get("format") != FORMAT:
        raise ManifestError(f"not a te-serial manifest (format={doc.get('format')!r})", file=source)
    version = doc.get("version")
    if (not isinstance(version, list) or len(version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)):
        raise ManifestError(f"bad format version {version!r}", file=source, field="version")
    if version[0] > VERSION[0]:
        raise VersionError(f"checkpoint format version {version[0]}.{version[1]} is newer than this "
                           f"te-serial reads ({VERSION[0]}.x); upgrade te-serial", file=source,
                           field="version")
