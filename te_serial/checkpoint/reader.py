"""Reading checkpoints: ``te_serial.open`` (lazy handle), ``load_quantized``, ``read_protos``, ``verify``.

Order of work on open: read and validate the manifest (schema, registry, prototype ↔ buffer
agreement), check every file's size against the manifest, then — before any buffer is touched —
check each file's safetensors header (the one validator in :mod:`.files`; keys, dtypes, shapes)
against the manifest. On CPU, buffers are views of the file's private mmap (no copy); for another
device they are copied into buffers allocated from the tensor's prototype.
"""

from __future__ import annotations

import base64
import binascii
import gc
import os
import stat
from pathlib import Path
from typing import Any, Iterator

import torch

from ..dtypes import safetensors_code
from ..errors import ChecksumError, CheckpointError, CheckpointFileError, ManifestError, TensorMismatchError
from ..formats.base import QuantizedTensorStorage
from ..proto import TensorProto
from .files import SafetensorsFile, checksum, open_regular
from .manifest import HEADER_KEY, MANIFEST_NAME, MAX_MANIFEST_BYTES, PLAIN_BUFFER, SELF_FILE, Manifest, format_checksum
from .tree import rebuild_tree
from .transfer import DeviceCopier


class Checkpoint:
    """A lazily opened checkpoint (``te_serial.open(path)``): prototypes now, bytes on demand."""

    def __init__(self, path: str | os.PathLike, *, strict: bool = True) -> None:
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}   # file → opened, header checked against the manifest
        self._by_file: dict[str, list] | None = None
        self._metas: dict[int, Any] = {}  # id(prototype) → its unflatten context
        if self.path.is_dir():
            self.root = self.path
            self.manifest = Manifest.from_bytes(self._read_manifest(self.path / MANIFEST_NAME),
                                                source=str(self.path / MANIFEST_NAME), strict=strict)
            self._check_file_sizes()
        elif self.path.exists():
            self.root = self.path.parent
            f = SafetensorsFile(self.path, follow_symlinks=True)  # the path the caller named
            self._files[SELF_FILE] = f
            if HEADER_KEY not in f.metadata:
                raise ManifestError("safetensors file has no te-serial manifest in its header "
                                    "(use te_serial.convert to import plain safetensors)", file=str(self.path))
            try:
                data = base64.b64decode(f.metadata[HEADER_KEY], validate=True)
            except (binascii.Error, ValueError) as e:
                raise ManifestError(f"manifest in header is not base64: {e}", file=str(self.path)) from None
            self.manifest = Manifest.from_bytes(data, source=str(self.path), strict=strict)
            if self.manifest.files:
                raise ManifestError("a single-file checkpoint must not list other files", file=str(self.path),
                                    field="files")
            self._check_header(SELF_FILE, f)
        else:
            raise CheckpointFileError("no such checkpoint", file=str(self.path))
        self._protos = self.manifest.protos_by_name()

    @staticmethod
    def _read_manifest(path: Path) -> bytes:
        try:
            fd, size = open_regular(path)
        except CheckpointFileError as e:
            missing = not path.exists() and not path.is_symlink()
            raise ManifestError(f"no {MANIFEST_NAME} in checkpoint directory" if missing else str(e),
                                file=str(path.parent if missing else path)) from None
        try:
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit", file=str(path))
            data = os.pread(fd, size, 0)
        except OSError as e:
            raise ManifestError(f"cannot read manifest: {e}", file=str(path)) from None
        finally:
            os.close(fd)
        if len(data) != size:
            raise ManifestError("manifest changed while it was read", file=str(path))
        return data

    # --- what the handle tells without reading buffers ----------------------------------------
    @property
    def protos(self) -> dict[str, TensorProto]:
        return dict(self._protos)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.manifest.metadata)

    def keys(self) -> list[str]:
        return list(self.manifest.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def __len__(self) -> int:
        return len(self.manifest.tensors)

    # --- files ------------------------------------------------------------------------------------
    def _file_path(self, name: str) -> Path:
        return self.path if name == SELF_FILE else self.root / name

    def _check_file_sizes(self) -> None:
        """Every file the manifest lists is a regular file (no symlink) of the listed size."""
        for name, size in self.manifest.files.items():
            p = self._file_path(name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                raise CheckpointFileError("buffer file is missing", file=str(p)) from None
            except OSError as e:
                raise CheckpointFileError(f"cannot stat buffer file: {e.strerror or e}", file=str(p)) from None
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointFileError("is a symbolic link; te-serial does not follow links inside a "
                                          "checkpoint", file=str(p))
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointFileError("not a regular file", file=str(p))
            if st.st_size != size:
                raise CheckpointFileError(f"file is {st.st_size} bytes, the manifest says {size} (truncated or "
                                          "replaced?)", file=str(p))

    def _file(self, name: str) -> SafetensorsFile:
        """The file, opened and its header checked against the manifest before its first buffer is read."""
        f = self._files.get(name)
        if f is None:
            f = SafetensorsFile(self._file_path(name))
            try:
                if f.size != self.manifest.files[name]:
                    raise CheckpointFileError(f"file is {f.size} bytes, the manifest says {self.manifest.files[name]}",
                                              file=str(f.path))
                self._check_header(name, f)
            except BaseException:
                f.close()
                raise
            self._files[name] = f
        return f

    def _check_header(self, name: str, f: SafetensorsFile) -> None:
        """Every buffer the manifest puts in this file is there, with the manifest's dtype and shape."""
        if self._by_file is None:
            self._by_file = self.manifest.buffers_by_file()
        entries = f.entries
        for tname, bname, key, want_shape, want_dtype in self._by_file.get(name, []):
            e = entries.get(key)
            if e is None:
                raise TensorMismatchError(f"buffer {bname} (key {key!r}) is not in the file",
                                          file=str(f.path), tensor=tname, field=bname)
            if e.shape != want_shape or e.dtype != want_dtype:
                raise TensorMismatchError(
                    f"buffer {bname} is {safetensors_code(e.dtype)}{list(e.shape)} in the file but "
                    f"{safetensors_code(want_dtype)}{list(want_shape)} in the manifest",
                    file=str(f.path), tensor=tname, field=bname)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- reading tensors ------------------------------------------------------------------------
    def _read_buffer(self, tname: str, bname: str, file: str, key: str, expected: int | None,
                     verify: bool, mmap: bool = True) -> torch.Tensor:
        """One stored buffer: a view of the file's private mmap, or (``mmap=False``) a fresh copy."""
        f = self._file(file)
        t = f.mapped(key) if mmap else f.read(key)
        if verify:
            if expected is None:
                raise ChecksumError("cannot verify: the checkpoint was saved without checksums",
                                    file=str(f.path), tensor=tname, field=bname)
            if checksum(t) != expected:
                raise ChecksumError(f"buffer {bname} does not match its checksum {format_checksum(expected)}",
                                    file=str(f.path), tensor=tname, field=bname)
        return t

    def _assembly(self, proto: TensorProto) -> tuple[Any, dict[str, torch.dtype]]:
        """(unflatten context, in-memory dtype per buffer) of a prototype, worked out once."""
        found = self._metas.get(id(proto))
        if found is None:
            found = self._metas[id(proto)] = (proto.create_metadata(),
                                              {n: s.dtype for n, s in proto.buffer_specs().items()})
        return found

    def _load(self, name: str, device: torch.device, verify: bool, copier: DeviceCopier | None,
              cache: dict, mmap: bool = True) -> torch.Tensor:
        where = self.manifest.locations(name)
        ident = tuple(loc[2] for loc in where)  # keys are unique to a stored tensor
        if ident in cache:  # tied tensors come back as one object
            return cache[ident]
        proto = self._protos[name]
        if device.type == "meta":
            out = proto.create_tensor(device="meta")
        else:
            raw = {b: self._read_buffer(name, b, f, k, c, verify, mmap) for b, f, k, _, _, c in where}
            if proto.quantizer is not None:
                meta, dtypes = self._assembly(proto)
                raw = {n: t.view(dtypes[n]) for n, t in raw.items()}
            if copier is not None:  # allocate from the prototype on the target device, copy in
                dst = (proto.quantizer.alloc_tensors(proto.shape, device=device) if proto.quantizer is not None
                       else {PLAIN_BUFFER: torch.empty(proto.shape, dtype=proto.dtype, device=device)})
                for n, t in raw.items():
                    copier.copy(dst[n], t)
                raw = dst
            if proto.quantizer is None:
                out = raw[PLAIN_BUFFER]
                if proto.requires_grad:
                    out.requires_grad_(True)
            else:  # TensorProto's unflatten context + the storage class's __tensor_unflatten__
                out = QuantizedTensorStorage.__tensor_unflatten__(raw, meta, proto.shape, None)
        cache[ident] = out
        return out

    def get(self, name: str, device: str | torch.device = "cpu", *, verify: bool = False,
            mmap: bool = True) -> torch.Tensor:
        """One tensor, reading only its own buffers."""
        if name not in self.manifest.tensors:
            raise CheckpointError(f"no tensor {name!r} in checkpoint", file=str(self.path), tensor=name)
        return self.load_tensors([name], device=device, verify=verify, mmap=mmap)[name]

    def load_tensors(self, names=None, device: str | torch.device = "cpu", *,
                     verify: bool = False, as_te: bool = False, mmap: bool = True) -> dict[str, torch.Tensor]:
        """Tensors by flat name (all by default), on ``device``; TE's own classes if ``as_te``.

        On CPU the buffers are views of the files' private mmaps (no copy); ``mmap=False`` reads
        them into fresh memory instead, so streaming through a checkpoint keeps no file pages."""
        device = torch.device(device)
        names = list(self.manifest.tensors) if names is None else list(names)
        copier = DeviceCopier(device) if device.type not in ("cpu", "meta") else None
        cache: dict = {}
        enabled = gc.isenabled()
        gc.disable()  # many small objects at once; see Manifest.from_bytes
        try:
            out = {n: self._load(n, device, verify, copier, cache, mmap) for n in names}
        finally:
            if enabled:
                gc.enable()
        if copier is not None:
            copier.finish()
        if as_te:
            from ..te_interop import to_te
            converted: dict[int, Any] = {}  # keep tied tensors tied
            out = {n: converted.setdefault(id(t), to_te(t)) if isinstance(t, QuantizedTensorStorage) else t
                   for n, t in out.items()}
        return out

    def load(self, device: str | torch.device = "cpu", *, verify: bool = False, as_te: bool = False) -> Any:
        """The saved object with its structure: nested dicts, lists, tuples and plain values."""
        tensors = self.load_tensors(device=device, verify=verify, as_te=as_te)
        if self.manifest.tree is None:
            return tensors
        return rebuild_tree(self.manifest.tree, tensors)

    def verify(self) -> int:
        """Check every buffer against its checksum; returns the number of buffers checked."""
        checked = 0
        for name in self.manifest.tensors:
            for b, f, k, _, _, c in self.manifest.locations(name):
                self._read_buffer(name, b, f, k, c, verify=True)
                checked += 1
        return checked


def open_checkpoint(path: str | os.PathLike, *, strict: bool = True) -> Checkpoint:
    """Open a checkpoint lazily: ``.protos``, ``.metadata``, ``.keys()``, ``.get(name, device=)``."""
    return Checkpoint(path, strict=strict)


def load_quantized(path: str | os.PathLike, *, device: str | torch.device = "cpu", strict: bool = True,
                   verify: bool = False, as_te: bool = False) -> Any:
    """Load what ``save_quantized`` saved: same structure, keys, dtypes and bytes, on ``device``.

    ``strict=False`` skips tensors whose entry cannot be rebuilt (e.g. a quantizer kind from a
    newer te-serial) instead of failing; ``verify=True`` checks every buffer's checksum;
    ``as_te=True`` returns Transformer Engine's own tensor classes (TE must be importable).
    """
    with Checkpoint(path, strict=strict) as ckpt:
        return ckpt.load(device=device, verify=verify, as_te=as_te)


def read_protos(path: str | os.PathLike) -> dict[str, TensorProto]:
    """name → TensorProto, reading only the manifest (no buffer is touched)."""
    return Checkpoint(path).protos


def verify(path: str | os.PathLike) -> int:
    """Validate a checkpoint completely (schema, headers, checksums); returns buffers checked."""
    with Checkpoint(path) as ckpt:
        return ckpt.verify()
