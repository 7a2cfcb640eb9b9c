"""Streaming safetensors I/O for conversion: one tensor in memory at a time.

Reading copies each tensor's bytes from the file into fresh memory (``readinto``), instead of
mapping the file: a mapping keeps every page it touched resident while it is open, so reading a
whole shard through it would make the process as large as the shard. Freed tensors go back to
the allocator, and peak memory is set by the largest tensor, not by the checkpoint.

Writing lays out each file before any data exists (every output buffer's shape and dtype is
known from the conversion plan), writes the header first, then each buffer at its offset as it
is produced. A header that depends on the data (a single-file te-serial checkpoint carries its
manifest, with checksums, in the header) is given a reserved size and written last, padded with
spaces as safetensors itself pads headers.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..dtypes import safetensors_code
from ..errors import CheckpointFileError, ConversionError

__all__ = ["SafetensorsFile", "SafetensorsStreamWriter", "CODE_TO_DTYPE", "TMP_PREFIX"]

TMP_PREFIX = ".te_serial-tmp-"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

_KNOWN_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                 torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
                 torch.float8_e8m0fnu, torch.complex64)
#: safetensors dtype code → torch dtype (the codes te-serial's dtype table knows)
CODE_TO_DTYPE: dict[str, torch.dtype] = {safetensors_code(d): d for d in _KNOWN_DTYPES}


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order (a view when it is contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy())


class SafetensorsFile:
    """A safetensors file's header, and its tensors read one at a time into fresh memory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f = None
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                    raise CheckpointFileError(f"not a safetensors file: header length {n} does not fit "
                                              f"the file ({size} bytes)", file=str(self.path))
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointFileError(f"unreadable safetensors header: {e}", file=str(self.path)) from None
        if not isinstance(header, dict):
            raise CheckpointFileError("safetensors header is not a JSON object", file=str(self.path))
        meta = header.pop("__metadata__", None)
        self.metadata: dict[str, str] = meta if isinstance(meta, dict) else {}
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, dict] = {}
        for key, info in header.items():
            try:
                start, end = info["data_offsets"]
                shape = [int(s) for s in info["shape"]]
                code = info["dtype"]
                ok = (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_len
                      and all(s >= 0 for s in shape))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointFileError(f"safetensors entry {key!r} has bad offsets or shape",
                                          file=str(self.path), tensor=key)
            dtype = CODE_TO_DTYPE.get(code)
            if dtype is None:
                raise ConversionError(f"tensor has safetensors dtype {code!r}, which te-serial does not "
                                      f"read (known: {', '.join(sorted(CODE_TO_DTYPE))})",
                                      file=str(self.path), tensor=key)
            if end - start != math.prod(shape) * dtype.itemsize:
                raise CheckpointFileError(f"safetensors entry {key!r} holds {end - start} bytes, its shape "
                                          f"and dtype need {math.prod(shape) * dtype.itemsize}",
                                          file=str(self.path), tensor=key)
            self.entries[key] = {"dtype": dtype, "shape": tuple(shape), "offsets": (start, end)}

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key]["shape"]

    def nbytes(self, key: str) -> int:
        start, end = self.entries[key]["offsets"]
        return end - start

    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key``, in fresh (unmapped) memory."""
        info = self.entries.get(key)
        if info is None:
            raise CheckpointFileError("tensor is not in the file", file=str(self.path), tensor=key)
        out = torch.empty(info["shape"], dtype=info["dtype"])
        start, end = info["offsets"]
        if end == start:
            return out
        view = _as_bytes(out)
        try:
            if self._f is None:
                self._f = open(self.path, "rb", buffering=0)
            self._f.seek(self.data_start + start)
            got = 0
            while got < len(view):
                n = self._f.readinto(view[got:])
                if not n:
                    break
                got += n
        except OSError as e:
            raise CheckpointFileError(f"cannot read tensor: {e}", file=str(self.path), tensor=key) from None
        if got != len(view):
            raise CheckpointFileError(f"file ends inside the tensor ({got} of {len(view)} bytes)",
                                      file=str(self.path), tensor=key)
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _header_bytes(entries: Mapping[str, dict], metadata: Mapping[str, str] | None, pad_to: int = 0) -> bytes:
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    header.update(entries)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    size = max(len(raw), pad_to)
    size += (-size) % 8  # data starts 8-aligned, as safetensors writes it
    return raw + b" " * (size - len(raw))


class SafetensorsStreamWriter:
    """One safetensors file written buffer by buffer at offsets fixed up front.

    ``layout`` lists (key, shape, dtype) of every tensor the file will hold. Buffers are ordered
    by item size (largest first, as safetensors does) so each is aligned to its dtype. With
    ``reserve`` the header is written at :meth:`finish` (its metadata may depend on the data) and
    may take at most ``reserve`` bytes of metadata values.
    """

    def __init__(self, path: Path, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype]], *,
                 metadata: Mapping[str, str] | None = None, reserve: Mapping[str, int] | None = None) -> None:
        self.final = Path(path)
        self.tmp = self.final.with_name(f"{TMP_PREFIX}{secrets.token_hex(4)}-{self.final.name}")
        items = list(layout)
        order = sorted(range(len(items)), key=lambda i: -items[i][2].itemsize)  # stable
        self.entries: dict[str, dict] = {}
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
        offset = 0
        for i in order:
            key, shape, dtype = items[i]
            if key in self.entries:
                raise ConversionError("two output tensors have the same key", file=str(self.final), tensor=key)
            nbytes = math.prod(shape) * dtype.itemsize
            self.entries[key] = {"dtype": safetensors_code(dtype), "shape": list(shape),
                                 "data_offsets": [offset, offset + nbytes]}
            self.specs[key] = (tuple(shape), dtype, offset)
            offset += nbytes
        self.data_bytes = offset
        self.reserve = dict(reserve) if reserve else None
        if self.reserve is not None:
            placeholder = {k: "A" * n for k, n in self.reserve.items()}
            self.header_len = len(_header_bytes(self.entries, placeholder))
        else:
            header = _header_bytes(self.entries, metadata)
            self.header_len = len(header)
        self.data_start = 8 + self.header_len
        self.written: set[str] = set()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            if self.reserve is None:
                self._pwrite(len(header).to_bytes(8, "little") + header, 0)
            os.ftruncate(self.fd, self.data_start + self.data_bytes)
        except BaseException:
            self.abort()
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data)
        while len(view):
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write(self, key: str, t: torch.Tensor) -> None:
        spec = self.specs.get(key)
        if spec is None:
            raise ConversionError("tensor is not in the planned layout of the file", file=str(self.final), tensor=key)
        shape, dtype, offset = spec
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ConversionError(f"tensor is {t.dtype}{list(t.shape)}, the plan says {dtype}{list(shape)}",
                                  file=str(self.final), tensor=key)
        if key in self.written:
            raise ConversionError("tensor written twice", file=str(self.final), tensor=key)
        if t.numel():
            self._pwrite(_as_bytes(t), self.data_start + offset)
        self.written.add(key)

    def finish(self, metadata: Mapping[str, str] | None = None) -> int:
        """Write the header if it was reserved, fsync, close; returns the file size (still at ``tmp``)."""
        missing = set(self.specs) - self.written
        if missing:
            raise ConversionError(f"{len(missing)} planned tensors were never written", file=str(self.final),
                                  tensor=sorted(missing)[0])
        if self.reserve is not None:
            for k, n in self.reserve.items():
                if len((metadata or {}).get(k, "")) > n:
                    raise ConversionError(f"header metadata {k!r} outgrew its reserved {n} bytes",
                                          file=str(self.final))
            header = _header_bytes(self.entries, metadata, pad_to=self.header_len)
            if len(header) != self.header_len:
                raise ConversionError("header does not fit its reserved size", file=str(self.final))
            self._pwrite(len(header).to_bytes(8, "little") + header, 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return self.data_start + self.data_bytes

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)
