"""``save_quantized``: a state dict → safetensors shards + msgpack manifest, atomically.

Atomicity: every file is written under a temporary name, fsync'd, then renamed. Shards carry a
per-save id in their names, so a new save never overwrites the shards the current manifest
points to; the manifest's own rename is the commit point, after which the old shards are
removed. A save killed at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import base64
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
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
TMP_PREFIX = ".te_serial-tmp-"
#: the temporary file safetensors' save_file writes before renaming (left behind by a kill)
SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6,8}$")
_UMASK = os.umask(0)
os.umask(_UMASK)


def _is_leftover(name: str, target: str | None = None) -> bool:
    """Temporary files of killed saves in a checkpoint directory (ours and safetensors'), or
    with ``target``: the temporary directories of killed saves of that single file."""
    if target is not None:
        return name.startswith(TMP_PREFIX) and name.endswith(f"-{target}.d")
    return bool(SAFETENSORS_TMP.match(name)) or name.startswith(TMP_PREFIX)


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
        # Checksums are computed on a worker thread (xxhash releases the GIL) while shards are
        # written; entries hold futures until the manifest is built.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="te-serial-xxh3") if checksums else None
        self.entries: dict[str, TensorEntry] = {}
        self.aliases: dict[str, str] = {}
        self.blobs: dict[str, torch.Tensor] = {}       # safetensors key → CPU tensor (stored dtype)
        self._by_identity: dict[tuple, str] = {}
        self._storages: set[int] = set()
        self._keys: set[str] = set()

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

    def flushed(self, keep_identities: bool) -> None:
        """The pending blobs are on disk: drop them (and, unless kept, what ties to them)."""
        self.blobs = {}
        self._storages = set()
        if not keep_identities:
            self._by_identity = {}

    def _buffer(self, key: str, b: torch.Tensor, tensor: str) -> BufferEntry:
        if key in self._keys:
            raise UnsupportedValueError(f"buffer key {key!r} of tensor {tensor!r} is taken by another tensor")
        cpu = b.to("cpu") if b.device.type != "cpu" else b
        if cpu.numel():
            storage = cpu.untyped_storage()
            partial = storage.nbytes() != cpu.numel() * cpu.element_size()
            if not cpu.is_contiguous() or partial or storage.data_ptr() in self._storages:
                cpu = cpu.clone(memory_format=torch.contiguous_format)  # safetensors refuses shared storage
            self._storages.add(cpu.untyped_storage().data_ptr())
        self.blobs[key] = cpu
        self._keys.add(key)
        return BufferEntry(SELF_FILE, key, tuple(cpu.shape), cpu.dtype,
                           self._hasher.submit(checksum, cpu) if self._hasher is not None else None)

    def resolved(self, key_file: Mapping[str, str] | None = None) -> dict[str, TensorEntry]:
        """The entries with checksums computed and (directory checkpoints) their final file names."""
        def fix(be: BufferEntry) -> BufferEntry:
            value = be.checksum.result() if isinstance(be.checksum, Future) else be.checksum
            return BufferEntry(key_file[be.key] if key_file else be.file, be.key, be.shape, be.dtype, value)
        out = {}
        for name, e in self.entries.items():
            out[name] = out.get(self.aliases.get(name)) or TensorEntry(e.proto, {b: fix(be) for b, be in e.buffers.items()})
        if self._hasher is not None:
            self._hasher.shutdown()
        return out


def _flat_tree(tree: Any) -> Any:
    """None when the tree is a flat dict of tensors stored under their own keys (the common case)."""
    if isinstance(tree, dict) and all(isinstance(v, TensorRef) and v.name == k for k, v in tree.items()):
        return None
    return tree


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(final: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                       atomic: bool = True) -> int:
    """Write and fsync one safetensors file. With ``atomic`` it is written inside a private
    temporary directory beside ``final`` (where safetensors' own temporary file lands too) and
    renamed into place at the end, so a killed write leaves only that directory behind."""
    if not atomic:
        save_file(tensors, str(final), metadata=metadata)
        os.chmod(final, 0o666 & ~_UMASK)  # safetensors' temporary file is 0600; follow the umask
        _fsync_path(final)
        return final.stat().st_size
    workdir = final.parent / f"{TMP_PREFIX}{secrets.token_hex(4)}-{final.name}.d"
    workdir.mkdir()
    try:
        size = _write_safetensors(workdir / final.name, tensors, metadata, atomic=False)
        os.replace(workdir / final.name, final)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return size


def _existing_shards(root: Path) -> set[str]:
    """Shard files the current manifest of ``root`` names (nothing if there is none)."""
    try:
        data = (root / MANIFEST_NAME).read_bytes()
        return set(Manifest.from_bytes(data, source=str(root / MANIFEST_NAME), strict=False).files)
    except (OSError, CheckpointError):
        return set()


class CheckpointWriter:
    """Writes a checkpoint tensor by tensor; a directory checkpoint flushes each shard as it fills.

    Used as a context manager: leaving the block normally commits (:meth:`close`), an exception
    aborts (temporary files removed, the previous checkpoint untouched). Tied tensors (same
    bytes, same prototype) are stored once; with ``dedupe_across_shards=False`` only within a
    shard, for callers that free tensors after adding them (storage addresses get reused).
    A single ``.safetensors`` file has its header first, so it is written at close.
    """

    def __init__(self, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                 metadata: Mapping[str, str] | None = None, checksums: bool = True,
                 dedupe_across_shards: bool = True) -> None:
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        bad = [k for k, v in self.metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise UnsupportedValueError(f"metadata must map str to str; bad keys {bad[:5]}", field="metadata")
        self.limit = parse_size(max_shard_size)
        self.single = self.path.suffix == ".safetensors"
        self.dedupe_across_shards = dedupe_across_shards
        self.tree: Any = None
        self._collector = _Collector(checksums)
        self._pending_bytes = 0
        self._save_id = secrets.token_hex(4)
        self._shards: list[tuple[Path, int, list[str]]] = []  # (temporary path, size, keys)
        self._closed = False
        if self.single:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        else:
            if self.path.exists() and not self.path.is_dir():
                raise CheckpointError("checkpoint path exists and is not a directory", file=str(self.path))
            self.path.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: Any) -> None:
        """Add one tensor (plain, te-serial quantized, or TE's) under its flat name."""
        if name in self._collector.entries:
            raise UnsupportedValueError(f"tensor {name!r} added twice")
        before = set(self._collector.blobs)
        self._collector.add(name, tensor)
        self._pending_bytes += sum(self._collector.blobs[k].numel() * self._collector.blobs[k].element_size()
                                   for k in set(self._collector.blobs) - before)
        if not self.single and self._pending_bytes >= self.limit:
            self._flush()

    def _flush(self) -> None:
        blobs = self._collector.blobs
        if not blobs:
            return
        keys = list(blobs)
        tmp = self.path / f"{TMP_PREFIX}{self._save_id}-{len(self._shards):05d}.safetensors"
        size = _write_safetensors(tmp, blobs, {"format": "pt"}, atomic=False)
        self._shards.append((tmp, size, keys))
        self._collector.flushed(keep_identities=self.dedupe_across_shards)
        self._pending_bytes = 0

    def close(self) -> Manifest:
        """Write what is pending, then commit: shards renamed to final names, manifest last."""
        if self._closed:
            raise CheckpointError("checkpoint writer already closed", file=str(self.path))
        self._closed = True
        c = self._collector
        if self.single:
            manifest = Manifest.from_entries(c.resolved(), {}, tree=self.tree, aliases=c.aliases,
                                             metadata=self.metadata, producer=_producer())
            # One metadata key only: safetensors writes metadata in hash order, and the same
            # tensors must always give the same bytes.
            header = {HEADER_KEY: base64.b64encode(manifest.to_bytes()).decode("ascii")}
            _write_safetensors(self.path, c.blobs, header)
            _fsync_path(self.path.parent, directory=True)
            for stale in self.path.parent.iterdir():  # leftovers of killed saves of this file
                if _is_leftover(stale.name, self.path.name):
                    shutil.rmtree(stale, ignore_errors=True)
            self.manifest = manifest
            return manifest
        try:
            self._flush()
            old_shards = _existing_shards(self.path)
            n = len(self._shards)
            files: dict[str, int] = {}
            key_file: dict[str, str] = {}
            for i, (tmp, size, keys) in enumerate(self._shards):
                name = f"model-{self._save_id}-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(tmp, self.path / name)  # still invisible: no manifest names it yet
                files[name] = size
                key_file.update({k: name for k in keys})
            manifest = Manifest.from_entries(c.resolved(key_file), files, tree=self.tree, aliases=c.aliases,
                                             metadata=self.metadata, producer=_producer())
            tmp = self.path / f"{TMP_PREFIX}{self._save_id}-{MANIFEST_NAME}"
            tmp.write_bytes(manifest.to_bytes())
            _fsync_path(tmp)
            os.replace(tmp, self.path / MANIFEST_NAME)  # the commit point
        except BaseException:
            self.abort()
            raise
        _fsync_path(self.path, directory=True)
        for stale in self.path.iterdir():  # the previous save's shards and leftovers of killed saves
            if (stale.name in old_shards and stale.name not in files) or _is_leftover(stale.name):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop everything written by this writer; the previous checkpoint stays as it was."""
        self._closed = True
        if self.single:
            return
        committed = _existing_shards(self.path)
        for p in self.path.glob(f"model-{self._save_id}-*.safetensors"):
            if p.name not in committed:
                p.unlink(missing_ok=True)
        for p in self.path.glob(f"{TMP_PREFIX}{self._save_id}-*"):
            p.unlink(missing_ok=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_quantized(obj: Any, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                   metadata: Mapping[str, str] | None = None, checksums: bool = True) -> Manifest:
    """Save a state dict (or ``nn.Module``) of plain and quantized tensors, without pickle.

    ``path`` ending in ``.safetensors`` → one file whose header carries the manifest;
    otherwise a directory of shards (each ≤ ``max_shard_size`` unless one buffer is larger)
    plus ``te_serial.msgpack``. Plain Python values in the state dict go into the manifest.
    Returns the manifest written.
    """
    tree, tensors = flatten_tree(obj)
    with CheckpointWriter(path, max_shard_size=max_shard_size, metadata=metadata,
                          checksums=checksums) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
        writer.tree = _flat_tree(tree)
    return writer.manifest
