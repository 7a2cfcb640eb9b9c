"""``save_quantized``: a state dict → safetensors shards + msgpack manifest, atomically.

Atomicity: every file is written under a temporary name, fsync'd, then renamed. Shards carry a
per-save id in their names, so a new save never overwrites the shards the current manifest
points to; the manifest's own rename is the commit point, after which the old shards are
removed. A save killed at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from .. import __version__
from ..errors import CheckpointError, UnsupportedValueError
from ..formats.base import QuantizedTensorStorage
from ..proto import TensorProto, to_tensor_proto
from ..te_interop import from_te, is_te_tensor
from .manifest import (HEADER_KEY, MANIFEST_NAME, PLAIN_BUFFER, SELF_FILE, BufferEntry, Manifest,
                       TensorEntry, buffer_key, checksum)
from .tree import TensorRef, flatten_tree

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SHARD_PATTERN = re.compile(r"^model-[0-9a-f]{8}-\d{5}-of-\d{5}\.safetensors$")
TMP_PREFIX = ".te_serial-tmp-"


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` / ``500MiB`` / an int (decimal units as in Hugging Face)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m:
            raise CheckpointError(f"cannot read size {size!r} (use e.g. '5GB', '500MiB' or bytes)",
                                  field="max_shard_size")
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if value <= 0:
        raise CheckpointError(f"size must be positive, got {size!r}", field="max_shard_size")
    return value


def _producer() -> dict[str, Any]:
    try:
        from importlib.metadata import version
        te_version = version("transformer-engine")
    except Exception:  # noqa: BLE001 - TE is optional
        te_version = None
    return {"te_serial": __version__, "torch": torch.__version__.split("+")[0],
            "transformer_engine": te_version}


def _identity(t: torch.Tensor) -> tuple:
    """Two tensors with equal identity hold the same bytes at the same place (tied weights)."""
    if t.numel() == 0:  # no storage to compare: only the very same object is "tied"
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


class _Collector:
    """Turns flat tensors into manifest entries and the buffers to write (tied tensors once)."""

    def __init__(self, checksums: bool) -> None:
        self.checksums = checksums
        self.entries: dict[str, TensorEntry] = {}
        self.aliases: dict[str, str] = {}
        self.blobs: dict[str, torch.Tensor] = {}       # safetensors key → CPU tensor (stored dtype)
        self._by_identity: dict[tuple, str] = {}
        self._storages: set[int] = set()

    def add(self, name: str, t: Any) -> None:
        if is_te_tensor(t):  # TE's own classes: converted on the way in, same bytes
            t = from_te(t)
        proto = to_tensor_proto(t)
        proto = TensorProto(proto.shape, proto.dtype, proto.quantizer, proto.requires_grad)
        if isinstance(t, QuantizedTensorStorage):
            q = proto.quantizer
            buffers = t.buffers()
            q.check_buffers(proto.shape, buffers, where=f"tensor {name!r}")
            values = q.value_dtypes()
            stored = {n: b.detach().view(values[n]) for n, b in buffers.items()}
        else:
            if t.layout != torch.strided:
                raise UnsupportedValueError(f"tensor {name!r} has layout {t.layout}; only dense tensors are saved")
            stored = {PLAIN_BUFFER: t.detach()}
        ident = (proto, tuple(_identity(b) for b in stored.values()))
        first = self._by_identity.get(ident)
        if first is not None:  # tied: the same tensor under another name
            self.aliases[name] = first
            self.entries[name] = self.entries[first]
            return
        self._by_identity[ident] = name
        entries = {bname: self._buffer(buffer_key(name, bname), b, name) for bname, b in stored.items()}
        self.entries[name] = TensorEntry(proto, entries)

    def _buffer(self, key: str, b: torch.Tensor, tensor: str) -> BufferEntry:
        if key in self.blobs:
            raise UnsupportedValueError(f"buffer key {key!r} of tensor {tensor!r} is taken by another tensor")
        cpu = b.to("cpu") if b.device.type != "cpu" else b
        if cpu.numel():
            storage = cpu.untyped_storage()
            partial = storage.nbytes() != cpu.numel() * cpu.element_size()
            if not cpu.is_contiguous() or partial or storage.data_ptr() in self._storages:
                cpu = cpu.clone(memory_format=torch.contiguous_format)  # safetensors refuses shared storage
            self._storages.add(cpu.untyped_storage().data_ptr())
        self.blobs[key] = cpu
        return BufferEntry(SELF_FILE, key, tuple(cpu.shape), cpu.dtype,
                           checksum(cpu) if self.checksums else None)


def _flat_tree(tree: Any) -> Any:
    """None when the tree is a flat dict of tensors stored under their own keys (the common case)."""
    if isinstance(tree, dict) and all(isinstance(v, TensorRef) and v.name == k for k, v in tree.items()):
        return None
    return tree


def _plan_shards(blobs: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in blobs.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(final: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    tmp = final.with_name(f"{TMP_PREFIX}{secrets.token_hex(4)}-{final.name}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        _fsync_path(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _existing_shards(root: Path) -> set[str]:
    """Shard files the current manifest of ``root`` names (nothing if there is none)."""
    try:
        data = (root / MANIFEST_NAME).read_bytes()
        return set(Manifest.from_bytes(data, source=str(root / MANIFEST_NAME), strict=False).files)
    except (OSError, CheckpointError):
        return set()


def save_quantized(obj: Any, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                   metadata: Mapping[str, str] | None = None, checksums: bool = True) -> Manifest:
    """Save a state dict (or ``nn.Module``) of plain and quantized tensors, without pickle.

    ``path`` ending in ``.safetensors`` → one file whose header carries the manifest;
    otherwise a directory of shards (each ≤ ``max_shard_size`` unless one buffer is larger)
    plus ``te_serial.msgpack``. Plain Python values in the state dict go into the manifest.
    Returns the manifest written.
    """
    path = Path(path)
    metadata = dict(metadata or {})
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise UnsupportedValueError(f"metadata must map str to str; bad keys {bad[:5]}", field="metadata")
    limit = parse_size(max_shard_size)
    tree, tensors = flatten_tree(obj)
    collector = _Collector(checksums)
    for name, t in tensors.items():
        collector.add(name, t)

    if path.suffix == ".safetensors":
        manifest = Manifest.from_entries(collector.entries, {}, tree=_flat_tree(tree), aliases=collector.aliases,
                                         metadata=metadata, producer=_producer())
        # One metadata key only: safetensors writes metadata in hash order, and the same
        # tensors must always give the same bytes.
        header = {HEADER_KEY: base64.b64encode(manifest.to_bytes()).decode("ascii")}
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_safetensors(path, collector.blobs, header)
        _fsync_path(path.parent, directory=True)
        return manifest

    if path.exists() and not path.is_dir():
        raise CheckpointError("checkpoint path exists and is not a directory", file=str(path))
    path.mkdir(parents=True, exist_ok=True)
    old_shards = _existing_shards(path)
    save_id = secrets.token_hex(4)
    plan = _plan_shards(collector.blobs, limit)
    files: dict[str, int] = {}
    key_file: dict[str, str] = {}
    for i, keys in enumerate(plan):
        name = f"model-{save_id}-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        files[name] = _write_safetensors(path / name, {k: collector.blobs[k] for k in keys}, {"format": "pt"})
        key_file.update({k: name for k in keys})
    entries = {n: TensorEntry(e.proto, {b: BufferEntry(key_file[be.key], be.key, be.shape, be.dtype, be.checksum)
                                        for b, be in e.buffers.items()})
               for n, e in collector.entries.items()}
    manifest = Manifest.from_entries(entries, files, tree=_flat_tree(tree), aliases=collector.aliases,
                                     metadata=metadata, producer=_producer())
    tmp = path / f"{TMP_PREFIX}{save_id}-{MANIFEST_NAME}"
    try:
        tmp.write_bytes(manifest.to_bytes())
        _fsync_path(tmp)
        os.replace(tmp, path / MANIFEST_NAME)  # the commit point
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path, directory=True)
    for stale in path.iterdir():  # the previous save's shards and leftovers of killed saves
        if (stale.name in old_shards and stale.name not in files) or stale.name.startswith(TMP_PREFIX):
            stale.unlink(missing_ok=True)
    return manifest
