"""Reading checkpoints: ``te_serial.open`` (lazy handle), ``load_quantized``, ``read_protos``, ``verify``.

Order of work on open: read and validate the manifest (schema, registry, prototype ↔ buffer
agreement), check every file's size against the manifest, then — before any buffer is touched —
check each file's safetensors header (keys, dtypes, shapes) against the manifest. Buffers are
then read through safetensors' mmap: on CPU they are the file's pages (no copy); for another
device they are copied into buffers allocated from the tensor's prototype.
"""

from __future__ import annotations

import base64
import binascii
import gc
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..dtypes import SAFETENSORS_ITEMSIZE, safetensors_code
from ..errors import (ChecksumError, CheckpointError, CheckpointFileError, ManifestError,
                      TensorMismatchError)
from ..formats.base import QuantizedTensorStorage
from ..proto import TensorProto
from .manifest import (HEADER_KEY, MANIFEST_NAME, MAX_MANIFEST_BYTES, PLAIN_BUFFER, SELF_FILE, Manifest,
                       checksum, format_checksum)
from .tree import rebuild_tree
from .transfer import DeviceCopier


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _regular_file_size(path: Path, error: type[CheckpointError] = CheckpointFileError) -> int:
    """Size of a regular file (a FIFO or device would block or never end: refused)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise error("not a regular file", file=str(path))
    return st.st_size


def read_safetensors_header(path: Path, with_data_start: bool = False):
    """key → {dtype, shape, data_offsets} from a safetensors header, checked against the file size.

    One read and one JSON parse (cheaper than a slice lookup per key); a malformed or lying
    header is a :class:`CheckpointFileError` before any buffer is mapped.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointFileError(f"safetensors header length {n} does not fit the file "
                                          f"({size} bytes)", file=str(path))
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointFileError(f"unreadable safetensors header: {type(e).__name__}: {e}", file=str(path)) from None
    if not isinstance(header, dict):
        raise CheckpointFileError("safetensors header is not a JSON object", file=str(path))
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                for k, v in meta.items())):
        raise CheckpointFileError("safetensors __metadata__ must map strings to strings", file=str(path))
    data_len = size - 8 - n
    for key, info in header.items():
        try:
            start, end = info["data_offsets"]
            count = math.prod(info["shape"])
            width = SAFETENSORS_ITEMSIZE[info["dtype"]]
            ok = 0 <= start <= end <= data_len and end - start == count * width
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointFileError(f"safetensors entry {key!r} has bad offsets, shape or dtype",
                                      file=str(path), field=key)
    end = 0  # as safetensors requires: buffers tile the data section, no gaps, no overlaps
    for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        if info["data_offsets"][0] != end:
            raise CheckpointFileError(f"safetensors entry {key!r} overlaps another or leaves a gap",
                                      file=str(path), field=key)
        end = info["data_offsets"][1]
    if end != data_len:
        raise CheckpointFileError(f"safetensors data section is {data_len} bytes but its entries cover {end}",
                                  file=str(path))
    return (header, 8 + n) if with_data_start else header


def _safe_open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointFileError(f"not a readable safetensors file: {e}", file=str(path)) from None


class Checkpoint:
    """A lazily opened checkpoint (``te_serial.open(path)``): prototypes now, bytes on demand."""

    def __init__(self, path: str | os.PathLike, *, strict: bool = True) -> None:
        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        self._checked: set[str] = set()
        self._by_file: dict[str, list] | None = None
        self._metas: dict[int, Any] = {}  # id(prototype) → its unflatten context
        self._layouts: dict[str, tuple[dict, int]] = {}   # file → (checked header, data start)
        self._storages: dict[str, torch.UntypedStorage] = {}  # file → its private mmap
        if self.path.is_dir():
            self.root = self.path
            manifest_path = self.path / MANIFEST_NAME
            try:
                size = _regular_file_size(manifest_path, ManifestError)
                if size > MAX_MANIFEST_BYTES:
                    raise ManifestError(f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit",
                                        file=str(manifest_path))
                with open(manifest_path, "rb") as f:
                    data = f.read(size)
            except FileNotFoundError:
                raise ManifestError(f"no {MANIFEST_NAME} in checkpoint directory", file=str(self.path)) from None
            except OSError as e:
                raise ManifestError(f"cannot read manifest: {e}", file=str(manifest_path)) from None
            self.manifest = Manifest.from_bytes(data, source=str(manifest_path), strict=strict)
            self._check_file_sizes()
        elif self.path.is_file():
            self.root = self.path.parent
            _regular_file_size(self.path)
            handle = _safe_open(self.path)
            self._handles[SELF_FILE] = handle
            header = handle.metadata() or {}
            if HEADER_KEY not in header:
                raise ManifestError("safetensors file has no te-serial manifest in its header "
                                    "(use te_serial.convert to import plain safetensors)", file=str(self.path))
            try:
                data = base64.b64decode(header[HEADER_KEY], validate=True)
            except (binascii.Error, ValueError) as e:
                raise ManifestError(f"manifest in header is not base64: {e}", file=str(self.path)) from None
            self.manifest = Manifest.from_bytes(data, source=str(self.path), strict=strict)
            if self.manifest.files:
                raise ManifestError("a single-file checkpoint must not list other files", file=str(self.path),
                                    field="files")
        else:
            raise CheckpointFileError("no such checkpoint", file=str(self.path))
        self._protos = self.manifest.protos_by_name()

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
        for name, size in self.manifest.files.items():
            p = self._file_path(name)
            try:
                actual = _regular_file_size(p)
            except FileNotFoundError:
                raise CheckpointFileError("buffer file is missing", file=str(p)) from None
            if actual != size:
                raise CheckpointFileError(f"file is {actual} bytes, the manifest says {size} (truncated or "
                                          "replaced?)", file=str(p))

    def _ensure_checked(self, name: str) -> None:
        """Check a file's header against the manifest before its first buffer is touched."""
        if name not in self._checked:
            self._check_header(name)
            self._checked.add(name)

    def _handle(self, name: str):
        """safetensors' own reader of a file, for buffers the mmap view cannot serve."""
        self._ensure_checked(name)
        if name not in self._handles:
            self._handles[name] = _safe_open(self._file_path(name))
        return self._handles[name]

    def _check_header(self, name: str) -> None:
        """Every buffer the manifest puts in this file is there, with the manifest's dtype and shape."""
        path = self._file_path(name)
        header, data_start = read_safetensors_header(path, with_data_start=True)
        self._layouts[name] = (header, data_start)
        if self._by_file is None:
            self._by_file = self.manifest.buffers_by_file()
        for tname, bname, key, want_shape, want_dtype in self._by_file.get(name, []):
            info = header.get(key)
            if info is None:
                raise TensorMismatchError(f"buffer {bname} (key {key!r}) is not in the file",
                                          file=str(path), tensor=tname, field=bname)
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if shape != want_shape or dtype != safetensors_code(want_dtype):
                raise TensorMismatchError(
                    f"buffer {bname} is {dtype}{list(shape)} in the file but "
                    f"{safetensors_code(want_dtype)}{list(want_shape)} in the manifest",
                    file=str(path), tensor=tname, field=bname)

    def close(self) -> None:
        self._handles.clear()
        self._storages.clear()  # tensors handed out keep their mapping alive

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- reading tensors ------------------------------------------------------------------------
    def _mapped(self, file: str, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The buffer as a view of the file's private mmap (no copy; writes stay in memory), from the
        header already checked against the manifest; None where safetensors must do it."""
        header, data_start = self._layouts[file]
        start = data_start + header[key]["data_offsets"][0]
        if start % dtype.itemsize or math.prod(shape) == 0:
            return None
        storage = self._storages.get(file)
        if storage is None:
            path = self._file_path(file)
            storage = self._storages[file] = torch.UntypedStorage.from_file(
                str(path), shared=False, nbytes=path.stat().st_size)
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= dim
        return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape, tuple(reversed(strides)))

    def _read_buffer(self, tname: str, bname: str, file: str, key: str, expected: int | None,
                     verify: bool, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> torch.Tensor:
        self._ensure_checked(file)
        try:
            t = self._mapped(file, key, shape, dtype) if dtype is not None else None
            if t is None:
                t = self._handle(file).get_tensor(key)
        except (SafetensorError, RuntimeError, OSError) as e:
            raise CheckpointFileError(f"cannot read buffer {bname}: {e}", file=str(self._file_path(file)),
                                      tensor=tname, field=bname) from None
        if verify:
            if expected is None:
                raise ChecksumError("verify=True but the checkpoint was saved without checksums",
                                    file=str(self._file_path(file)), tensor=tname, field=bname)
            if checksum(t) != expected:
                raise ChecksumError(f"buffer {bname} does not match its checksum {format_checksum(expected)}",
                                    file=str(self._file_path(file)), tensor=tname, field=bname)
        return t

    def _assembly(self, proto: TensorProto) -> tuple[Any, dict[str, torch.dtype]]:
        """(unflatten context, in-memory dtype per buffer) of a prototype, worked out once."""
        found = self._metas.get(id(proto))
        if found is None:
            found = self._metas[id(proto)] = (proto.create_metadata(),
                                              {n: s.dtype for n, s in proto.buffer_specs().items()})
        return found

    def _load(self, name: str, device: torch.device, verify: bool, copier: DeviceCopier | None,
              cache: dict) -> torch.Tensor:
        where = self.manifest.locations(name)
        ident = tuple(loc[2] for loc in where)  # keys are unique to a stored tensor
        if ident in cache:  # tied tensors come back as one object
            return cache[ident]
        proto = self._protos[name]
        if device.type == "meta":
            out = proto.create_tensor(device="meta")
        else:
            raw = {b: self._read_buffer(name, b, f, k, c, verify, shape, dtype)
                   for b, f, k, shape, dtype, c in where}
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

    def get(self, name: str, device: str | torch.device = "cpu", *, verify: bool = False) -> torch.Tensor:
        """One tensor, reading only its own buffers."""
        if name not in self.manifest.tensors:
            raise CheckpointError(f"no tensor {name!r} in checkpoint", file=str(self.path), tensor=name)
        return self.load_tensors([name], device=device, verify=verify)[name]

    def load_tensors(self, names=None, device: str | torch.device = "cpu", *,
                     verify: bool = False, as_te: bool = False) -> dict[str, torch.Tensor]:
        """Tensors by flat name (all by default), on ``device``; TE's own classes if ``as_te``."""
        device = torch.device(device)
        names = list(self.manifest.tensors) if names is None else list(names)
        copier = DeviceCopier(device) if device.type not in ("cpu", "meta") else None
        cache: dict = {}
        enabled = gc.isenabled()
        gc.disable()  # many small objects at once; see Manifest.from_bytes
        try:
            out = {n: self._load(n, device, verify, copier, cache) for n in names}
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
