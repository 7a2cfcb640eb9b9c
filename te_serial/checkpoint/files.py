"""Safetensors files, the one way te-serial touches them: open, validate the header, read, write, commit.

Every path that reads or writes checkpoint files goes through here: ``load_quantized`` / ``open`` /
``verify`` / ``read_protos``, ``save_quantized`` / :class:`~te_serial.CheckpointWriter`, and
``convert`` (its sources and its outputs in every layout).

* :func:`read_header` is the one header validator: every field is type-checked before it is
  used, duplicate JSON keys are refused, entries must tile the data section exactly, and the work
  is bounded by the header's size.
* :class:`SafetensorsFile` opens a file without following a symlink (unless asked), keeps one
  descriptor, and reads a buffer as a view of the file's private mmap (CPU loads: no copy), as a
  mapping of the buffer's own pages (streaming conversion: no copy, and unmapped once freed, so
  the process does not grow with the file), or into fresh memory.
* Large files are written a block at a time with ``O_DIRECT`` where the file system allows it
  (:class:`_DirectBlocks`), the rest through the page cache.
* :class:`ShardSet` plans the files of a checkpoint from the (key, shape, dtype) of every buffer,
  before any data exists, then streams each buffer to its offset. Shards follow Hugging Face's
  rule: a shard holds buffers in order until the next one would take it over the limit, and goes
  over only when a single buffer is larger than the limit (it then stands alone).
* Files are written under temporary names (:data:`TMP_PREFIX`), fsync'd, renamed into place;
  the caller's manifest (or index) rename is the commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import errno
import gc
import itertools
import json
import math
import mmap
import operator
import os
import re
import secrets
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import numpy
import torch
import xxhash

from ..dtypes import dtype_from_code, safetensors_code
from ..errors import CheckpointError, CheckpointFileError, CheckpointWriteError
from ..proto import addressable
from .direct_io import use_direct_io

TMP_PREFIX = ".te_serial-tmp-"
#: safetensors' own limit on the header's JSON
MAX_HEADER_BYTES = 100 << 20
#: most dims a stored shape may have (safetensors has no limit; no tensor te-serial writes has more)
MAX_NDIM = 64
_ENTRY_FIELDS = frozenset(("dtype", "shape", "data_offsets"))
_json_string = json.encoder.encode_basestring_ascii  # as json.dumps quotes strings (ensure_ascii)
#: the ``__metadata__`` of every shard of a checkpoint directory (a single file holds its manifest there)
SHARD_METADATA = {"format": "pt"}


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 of a CPU tensor's bytes in C order (xxHash: memory speed; not a security hash)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(tensor_bytes(flat))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order (a view when it is already contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def fsync_path(path: Path, directory: bool = False) -> None:
    with writing(path):
        _fsync_path(path, directory)


def _fsync_path(path: Path, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_WRITE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                 errno.EROFS: "read-only file system"}


def write_error(err: OSError, path: Path | str) -> CheckpointWriteError:
    """te-serial's error for an operating-system error while writing ``path`` (``err`` chained)."""
    what = _WRITE_ERRORS.get(err.errno, f"cannot write: {err.strerror or err}")
    out = CheckpointWriteError(what, file=str(getattr(err, "filename", None) or path))
    out.errno, out.strerror = err.errno, err.strerror
    return out


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Operating-system errors inside become :class:`CheckpointWriteError` naming ``path``."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as e:
        raise write_error(e, path) from e


#: ``TE_SERIAL_SPACE_CHECK=0`` skips the free-space check a save makes before its first byte
SPACE_CHECK_ENV = "TE_SERIAL_SPACE_CHECK"
#: what a save wants free beyond its own bytes (file-system metadata): this, plus 1 % of them
SPACE_MARGIN_BYTES = 256 << 10


def check_free_space(root: Path, nbytes: int) -> None:
    """Refuse a save of ``nbytes`` into ``root`` that the file system cannot hold, before any byte
    is written. The previous checkpoint's files stay until the new one commits, so they count as
    used. A file system that gives no answer is not refused (its writes will say)."""
    if os.environ.get(SPACE_CHECK_ENV, "1").strip() == "0":
        return
    try:
        st = os.statvfs(root)
    except (OSError, AttributeError):
        return
    free = st.f_bavail * st.f_frsize
    need = nbytes + SPACE_MARGIN_BYTES + nbytes // 100
    if need > free:
        err = CheckpointWriteError(
            f"not enough space: the save needs {need:,} bytes ({nbytes:,} of data and a margin), the file "
            f"system has {free:,} free (free some, write elsewhere, or set {SPACE_CHECK_ENV}=0 to try anyway)",
            file=str(root))
        err.errno = errno.ENOSPC
        raise err


def discard(path: Path) -> None:
    """Remove a file (or a directory of files) te-serial wrote, best effort: a failed write's
    leftovers, whose removal the failure being reported (a read-only or vanished file system, say)
    may forbid too and must not mask; a committed save's stale files, which the next save removes."""
    try:
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                child.unlink(missing_ok=True)
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, fsync'd, then renamed into place."""
    with writing(path):
        _atomic_write(path, data)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{secrets.token_hex(4)}-{path.name}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def is_leftover(name: str) -> bool:
    """A temporary file of an interrupted te-serial write (never part of a committed checkpoint)."""
    return name.startswith(TMP_PREFIX)


# --- reading ---------------------------------------------------------------------------------------

class Entry(NamedTuple):
    """One tensor of a safetensors file: its dtype, shape and byte range in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Header(NamedTuple):
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    size: int


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic-GC pass inside: parsing or building many small objects at once would set one off
    (likelier the more objects the process holds), and it would cost more than the work itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _is_int(v) -> bool:
    return type(v) is int  # noqa: E721 - bool and float are refused on purpose


def read_header(fd: int, path: str, size: int, expected: PlannedHeader | None = None) -> Header:
    """The checked header of the safetensors file open at ``fd`` (``size`` bytes long); see
    :func:`_read_header`, parsed with the cyclic GC paused (:func:`gc_paused`).

    ``expected``: the header te-serial's writer gives this file (:func:`planned_header`). A file
    whose header's JSON is those bytes followed by nothing but the spaces that pad a header (a
    single file's header is padded to the room its writer reserved), at the size they plan, has
    that header: the bytes are compared instead of parsed and checked (the same guarantees, a
    fraction of the work); any other file goes through the full parse, which names what differs."""
    if expected is not None and _is_planned(fd, size, expected):
        return Header(expected.entries, dict(expected.metadata), size - expected.data_bytes, size)
    with gc_paused():
        return _read_header(fd, path, size)


def _is_planned(fd: int, size: int, expected: PlannedHeader) -> bool:
    """Whether the file holds ``expected``'s header, space-padded, and its data section's size."""
    n = len(expected.raw)
    head = os.pread(fd, 8 + n, 0)
    room = int.from_bytes(head[:8], "little") if len(head) == 8 + n else -1
    if room < n or room > MAX_HEADER_BYTES or size != 8 + room + expected.data_bytes \
            or not head.startswith(expected.raw, 8):
        return False
    pad = os.pread(fd, room - n, 8 + n) if room > n else b""
    return len(pad) == room - n and not pad.strip(b" ")


def header_json(fd: int, path: str, size: int) -> bytes:
    """The JSON of the safetensors header of the file open at ``fd`` (``size`` bytes long), read in
    one piece: its length must fit the file and :data:`MAX_HEADER_BYTES` (else
    :class:`CheckpointFileError`), so what is read is bounded by both. Not yet parsed or checked."""
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
        raise CheckpointFileError(f"safetensors header length {n} does not fit the file ({size} bytes)", file=path)
    return _pread_exact(fd, n, 8, path)


def _read_header(fd: int, path: str, size: int) -> Header:
    """The checked header of the safetensors file open at ``fd`` (``size`` bytes long).

    Refused with :class:`CheckpointFileError` naming the file and the entry: a header length
    that does not fit, JSON that is invalid, deeper than Python parses, or has duplicate keys;
    ``__metadata__`` that is not string → string; an entry that is not exactly ``dtype`` (a code
    te-serial knows), ``shape`` (at most 64 non-negative ints) and ``data_offsets`` (two ints);
    byte ranges that do not match shape × dtype or do not tile the data section without gaps
    or overlaps.
    """
    def fail(message: str, field: str | None = None):
        raise CheckpointFileError(message, file=path, field=field)

    raw = header_json(fd, path, size)
    n = len(raw)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        fail(f"unreadable safetensors header: {type(e).__name__}: {e}")
    if not isinstance(header, dict):
        fail("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        fail("safetensors __metadata__ must map strings to strings", "__metadata__")
    data_len = size - 8 - n
    entries = _entries_checked_by_columns(header, data_len)
    if entries is None:  # a flaw somewhere (or an unusual form): the loop below names it
        entries = _entries_checked_one_by_one(header, data_len, fail)
    return Header(entries, meta, 8 + n, size)


_get_dtype, _get_shape, _get_offsets = (operator.itemgetter(k) for k in ("dtype", "shape", "data_offsets"))
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def _ints(values: list) -> bool:
    return not values or set(map(type, values)) == {int}


def _entries_checked_by_columns(header: dict, data_len: int) -> dict[str, Entry] | None:
    """The entries, when every check :func:`_entries_checked_one_by_one` makes passes, made a
    field at a time over all entries with C-level builtins; None where any fails (then the
    one-by-one loop finds and names the first flaw)."""
    values = list(header.values())
    if not values:
        return {} if data_len == 0 else None
    if set(map(type, values)) != {dict} or set(map(len, values)) != {len(_ENTRY_FIELDS)}:
        return None
    try:  # three keys each, and these three: exactly the fields
        codes, shapes, offsets = (list(map(get, values)) for get in (_get_dtype, _get_shape, _get_offsets))
    except KeyError:
        return None
    if set(map(type, codes)) != {str}:
        return None
    known = {code: dtype_from_code(code) for code in set(codes)}
    dtypes = list(map(known.__getitem__, codes))
    if None in known.values() or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    if max(map(len, shapes)) > MAX_NDIM or set(map(len, offsets)) != {2}:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if not _ints(dims) or (dims and (min(dims) < 0 or max(dims) > data_len)):  # products stay small
        return None
    if 0 in dims and not all(map(addressable, shapes, map(operator.attrgetter("itemsize"), dtypes))):
        return None
    starts, ends = list(map(_first, offsets)), list(map(_second, offsets))
    if not (_ints(starts) and _ints(ends)) or min(starts) < 0 or max(ends) > data_len:
        return None
    itemsize = {code: dt.itemsize for code, dt in known.items()}
    sizes = list(map(operator.mul, map(math.prod, shapes), map(itemsize.__getitem__, codes)))
    if list(map(operator.sub, ends, starts)) != sizes:  # sizes are >= 0, so start <= end too
        return None
    spans = sorted(zip(starts, ends))  # the data section tiled: no gaps, no overlaps
    if spans[0][0] != 0 or spans[-1][1] != data_len or \
            list(map(_first, spans[1:])) != list(map(_second, spans[:-1])):
        return None
    return dict(zip(header, map(tuple.__new__, itertools.repeat(Entry), zip(dtypes, map(tuple, shapes), starts, ends))))


def _entries_checked_one_by_one(header: dict, data_len: int, fail: Callable) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for key, info in header.items():
        if not isinstance(info, dict) or info.keys() != _ENTRY_FIELDS:
            fail("safetensors entry must have exactly dtype, shape and data_offsets", key)
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = dtype_from_code(code) if isinstance(code, str) else None
        if dtype is None:
            fail(f"safetensors entry has dtype {code!r}, which te-serial does not read", key)
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(s) and s >= 0 for s in shape)):
            fail("safetensors entry shape must be a list of at most 64 non-negative integers", key)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            fail("safetensors entry data_offsets must be two integers", key)
        if not addressable(shape, dtype.itemsize):
            fail(f"safetensors entry shape {shape} is larger than torch can lay out", key)
        start, end = offsets
        if not 0 <= start <= end <= data_len:
            fail(f"safetensors entry data_offsets {offsets} lie outside the {data_len}-byte data section", key)
        count = 0 if 0 in shape else 1
        for s in shape if count else ():  # bounded: stops once the count exceeds what the range holds
            count *= s
            if count * dtype.itemsize > end - start:
                break
        if count * dtype.itemsize != end - start:
            fail(f"safetensors entry holds {end - start} bytes but its shape {shape} and dtype {code} "
                 "need a different number", key)
        entries[key] = Entry(dtype, tuple(shape), start, end)
    end = 0  # as safetensors requires: buffers tile the data section, no gaps, no overlaps
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != end:
            fail("safetensors entry overlaps another or leaves a gap", key)
        end = e.end
    if end != data_len:
        fail(f"safetensors data section is {data_len} bytes but its entries cover {end}")
    return entries


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise CheckpointFileError(f"file ends {n - got} bytes early", file=path)
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def open_regular(path: Path, *, follow_symlinks: bool = False, links_into: Path | None = None) -> tuple[int, int]:
    """(descriptor, size) of a regular file; a symlink (unless followed), FIFO or device is refused.
    ``links_into``: a symlink to a file directly inside that folder is followed (a hub cache
    snapshot's links to its repository's blobs), any other link refused."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    try:
        if not follow_symlinks and path.is_symlink():
            target = path.resolve() if links_into is not None else None
            if target is None or target.parent != links_into.resolve():
                raise CheckpointFileError("is a symbolic link; te-serial does not follow links inside a checkpoint"
                                          + (f" except to a file in {links_into}" if links_into is not None else ""),
                                          file=str(path))
            path = target  # opened without following a further link
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointFileError("file is missing", file=str(path)) from None
    except OSError as e:
        raise CheckpointFileError(f"cannot open: {e.strerror or e}", file=str(path)) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointFileError("not a regular file", file=str(path))
    return fd, st.st_size


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides of ``shape`` (a checkpoint holds few distinct shapes: computed once each)."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


class SafetensorsFile:
    """One safetensors file: its checked header, and its buffers read as mmap views or fresh copies."""

    def __init__(self, path: str | os.PathLike, *, follow_symlinks: bool = False,
                 fd: tuple[int, int] | None = None, expected: PlannedHeader | None = None) -> None:
        """``fd``: (descriptor, size) of ``path`` opened earlier (this object takes it over), so the
        file read is the one opened then, whatever has happened to the path since; ``expected``: the
        header the file should have (see :func:`read_header`)."""
        self.path = Path(path)
        self._fd, size = fd if fd is not None else open_regular(self.path, follow_symlinks=follow_symlinks)
        self._storage: torch.UntypedStorage | None = None
        #: bytes of tensor data read with ``read`` / ``read_box`` (mmap'd views are not counted)
        self.bytes_read = 0
        try:
            self.header = read_header(self._fd, str(self.path), size, expected)
        except BaseException:
            self.close()
            raise
        self.entries = self.header.entries
        self.metadata = self.header.metadata
        #: the header is exactly the one expected (its entries are the expected ones)
        self.as_planned = expected is not None and self.header.entries is expected.entries

    @property
    def size(self) -> int:
        return self.header.size

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def _entry(self, key: str) -> Entry:
        e = self.entries.get(key)
        if e is None:
            raise CheckpointFileError("tensor is not in the file", file=str(self.path), field=key)
        return e

    def mapped(self, key: str, dtype: torch.dtype | None = None, *, own: bool = False) -> torch.Tensor:
        """The buffer as a view of the file's private mmap (no copy; writes stay in memory), as
        ``dtype`` (same item size) if given; a fresh copy where the offset is not aligned.

        ``own``: a mapping of this buffer's pages alone, unmapped when the last view is freed (a
        streaming reader's memory stays bounded by what it holds); else the whole file's mapping,
        kept while the file is open."""
        e = self.entries.get(key) or self._entry(key)  # the second names a missing key
        dtype = dtype or e.dtype
        start = self.header.data_start + e.start
        if start % dtype.itemsize or e.nbytes == 0:
            return self.read(key).view(dtype)
        if own:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            try:
                pages = mmap.mmap(self._fd, start + e.nbytes - base, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
            except OSError:  # a file system that cannot map: the same bytes, read
                return self.read(key).view(dtype)
            # the tensor holds the mapping (a buffer export) until it is freed
            return torch.frombuffer(pages, dtype=torch.uint8, count=e.nbytes, offset=start - base) \
                .view(dtype).reshape(e.shape)
        if self._storage is None:
            # the descriptor's own file, so a path swapped after the checks cannot be mapped instead
            proc = f"/proc/self/fd/{self._fd}"
            src = proc if os.path.exists(proc) else str(self.path)
            try:
                self._storage = torch.UntypedStorage.from_file(src, shared=False, nbytes=self.header.size)
            except RuntimeError as e:
                raise CheckpointFileError(f"cannot map the file: {e}", file=str(self.path)) from None
        return torch.empty(0, dtype=dtype).set_(self._storage, start // dtype.itemsize, e.shape,
                                                _contiguous_strides(e.shape))

    def read(self, key: str) -> torch.Tensor:
        """The buffer in fresh (unmapped) memory: the process does not keep the file's pages."""
        e = self._entry(key)
        out = torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            offset, got = self.header.data_start + e.start, 0
            while got < e.nbytes:
                try:
                    n = os.preadv(self._fd, [view[got:]], offset + got)
                except OSError as err:
                    raise CheckpointFileError(f"cannot read: {err}", file=str(self.path), field=key) from None
                if not n:
                    raise CheckpointFileError(f"file ends inside the tensor ({got} of {e.nbytes} bytes)",
                                              file=str(self.path), field=key)
                got += n
        self.bytes_read += e.nbytes
        return out

    def read_box(self, key: str, view: tuple[int, ...], offsets, sizes, out: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``offsets`` / ``sizes`` of the entry seen as an array of shape ``view`` (same
        element count), read with one ``pread`` per contiguous run: only the box's bytes are read
        (counted in :attr:`bytes_read`). Into ``out`` (contiguous, same item size) if given."""
        e = self._entry(key)
        view, offsets, sizes = tuple(view), tuple(offsets), tuple(sizes)
        if math.prod(view) != math.prod(e.shape) or len(offsets) != len(view) or len(sizes) != len(view) or any(
                o < 0 or s < 0 or o + s > v for o, s, v in zip(offsets, sizes, view)):
            raise CheckpointFileError(f"box {list(offsets)}+{list(sizes)} does not fit {list(view)} "
                                      f"(entry {list(e.shape)})", file=str(self.path), field=key)
        if out is None:
            out = torch.empty(sizes, dtype=e.dtype)
        elif not out.is_contiguous() or out.dtype.itemsize != e.dtype.itemsize or out.numel() != math.prod(sizes):
            raise CheckpointError("read_box needs a contiguous output of the box's size and item size",
                                  file=str(self.path), field=key)
        if out.numel() == 0:
            return out
        item = e.dtype.itemsize
        nd = len(view)
        strides = [1] * nd
        for d in range(nd - 2, -1, -1):
            strides[d] = strides[d + 1] * view[d + 1]
        k = nd - 1  # runs cover dims k.. : every dim after k is full
        while k > 0 and offsets[k] == 0 and sizes[k] == view[k]:
            k -= 1
        run = sizes[k] * strides[k] * item if nd else item
        dst = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        base = self.header.data_start + e.start + (sum(o * s for o, s in zip(offsets, strides)) * item if nd else 0)
        pos = 0
        for idx in itertools.product(*(range(s) for s in sizes[:k])) if nd else [()]:
            offset = base + sum(i * s for i, s in zip(idx, strides)) * item
            self._pread_into(dst[pos:pos + run], offset, key)
            pos += run
        self.bytes_read += pos
        return out

    def _pread_into(self, view: memoryview, offset: int, key: str) -> None:
        got = 0
        while got < len(view):
            try:
                n = os.preadv(self._fd, [view[got:]], offset + got)
            except OSError as err:
                raise CheckpointFileError(f"cannot read: {err}", file=str(self.path), field=key) from None
            if not n:
                raise CheckpointFileError("file ends inside the tensor", file=str(self.path), field=key)
            got += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._storage = None  # tensors handed out keep their mapping alive

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)


# --- writing ---------------------------------------------------------------------------------------

def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


#: where a save writes direct (:mod:`.direct_io`), files at least this large write the whole blocks
#: of each buffer with ``O_DIRECT``
DIRECT_MIN_BYTES = 64 << 20
_BLOCK = 4096          # O_DIRECT alignment of offsets, lengths and memory (a multiple of any sector)
_STAGE_BYTES = 8 << 20


class _DirectBlocks:
    """The whole blocks of a file, written with ``O_DIRECT`` from an aligned staging buffer.

    Used where :func:`.direct_io.use_direct_io` chose it (a checkpoint larger than the page cache
    it can count on, on a file system whose direct writes keep up): there buffered writes of
    computed data can slow down several times once the dirty pages pile up, where direct ones keep
    the disk's speed. A buffer's partial first and last blocks go through the page cache
    (:class:`_PlannedFile` writes them), so no block is ever written both ways. Where a write is
    refused, the rest of the file is buffered.
    """

    _stages = threading.local()  # one page-aligned staging buffer per writing thread, reused

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_DIRECT)

    def write(self, view: memoryview, offset: int) -> int:
        """Write the whole blocks of ``view`` (at file ``offset``); returns how many bytes, from the
        first block boundary on, were written (0: none, the caller writes the rest buffered)."""
        stage = getattr(self._stages, "buffer", None)
        if stage is None:  # an mmap: page-aligned, as O_DIRECT needs
            stage = self._stages.buffer = numpy.frombuffer(mmap.mmap(-1, _STAGE_BYTES), dtype=numpy.uint8)
        data = numpy.frombuffer(view, dtype=numpy.uint8)
        start = -offset % _BLOCK
        end = start + (len(view) - start) // _BLOCK * _BLOCK
        pos = start
        while pos < end:
            n = min(_STAGE_BYTES, end - pos)
            # numpy's copy releases the GIL; an mmap slice assignment holds it for the whole copy,
            # which slowed the conversion's compute thread 3x (a copy overlapped with the previous
            # pwrite on a helper thread gained nothing measurable)
            numpy.copyto(stage[:n], data[pos:pos + n])
            with memoryview(stage) as staged:
                written = os.pwrite(self.fd, staged[:n], offset + pos)
            if written != n:
                raise OSError(errno.EIO, "short direct write")
            pos += n
        return end - start

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: buffered writes at least this large start their writeback at once (:func:`start_writeback`)
_WRITEBACK_MIN_BYTES = 1 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


@functools.lru_cache(maxsize=None)
def _libc(name: str, argtypes: tuple) -> Callable | None:
    """A libc function by name (None where there is none: not Linux)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    return fn


def _sync_file_range() -> Callable | None:
    return _libc("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))


_MADV_PAGEOUT = 21  # <linux/mman.h> (Linux 5.4): reclaim the range's pages; never loses data


def release_pages(t: torch.Tensor) -> None:
    """Hint that the memory of CPU tensor ``t``, read and no longer needed, may leave the process:
    where it is a file's mapped pages (a safetensors file read through mmap), they stop counting
    in its resident memory, so reading a whole file a tensor at a time stays bounded by what is
    held. Only pages wholly inside ``t`` are named; memory that is not a file's is left as it is
    (no swap), and where the hint is refused nothing changes."""
    fn = _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if fn is None or t.device.type != "cpu" or not t.numel():
        return
    start, page = t.data_ptr(), mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if end > first:
        fn(first, end - first, _MADV_PAGEOUT)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` to disk now, without waiting. The
    pages stay cached (a load after the save reads memory), while the disk works beside whatever
    the writer computes next, instead of all at the final fsync: the kernel's own background
    writeback starts only once a tenth of memory is dirty. A hint: where it is refused, nothing
    changes."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class Layout(NamedTuple):
    """Where each buffer of a file goes, and the header entries saying so (JSON text)."""

    entries: dict[str, Entry]
    entries_json: str
    data_bytes: int


def layout(items: list[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
    """The one layout rule for the files te-serial writes: the widest dtypes first (every buffer
    aligned to its item size), in the given order otherwise, packed. The entries' JSON is what
    ``json.dumps`` gives for them, formatted directly (a tenth of the time for 10,000 tensors)."""
    kinds: dict[tuple, tuple[int, str]] = {}  # (shape, dtype) → (bytes, the entry's JSON up to its offsets)
    for _, shape, dtype in items:
        if (shape, dtype) not in kinds:
            kinds[shape, dtype] = (math.prod(shape) * dtype.itemsize, f'{{"dtype":"{safetensors_code(dtype)}",'
                                   f'"shape":[{",".join(map(str, shape))}],"data_offsets":[')
    ordered = sorted(items, key=lambda item: -item[2].itemsize)  # a stable sort
    sizes = [kinds[shape, dtype][0] for _, shape, dtype in ordered]
    ends = list(itertools.accumulate(sizes))
    starts = [0, *ends[:-1]]
    entries = {key: Entry(dtype, tuple(shape), start, end)
               for (key, shape, dtype), start, end in zip(ordered, starts, ends)}
    text = ",".join([f"{_json_string(key)}:{kinds[shape, dtype][1]}{start},{end}]}}"
                     for (key, shape, dtype), start, end in zip(ordered, starts, ends)])
    return Layout(entries, text, ends[-1] if ends else 0)


def _metadata_json(metadata: Mapping[str, str]) -> str:
    """The ``__metadata__`` member of a header te-serial writes (compact ``json.dumps``)."""
    return '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"))


def header_bytes(planned: Layout, metadata: Mapping[str, str] | None, pad_to: int = 0) -> bytes:
    """A safetensors header (JSON, space-padded so the data starts 8-aligned, at least ``pad_to`` long)."""
    head = "" if metadata is None else _metadata_json(metadata)
    raw = ("{" + ",".join(p for p in (head, planned.entries_json) if p) + "}").encode("utf-8")
    size = max(len(raw), pad_to)
    size += (-size) % 8
    return raw + b" " * (size - len(raw))


class PlannedHeader(NamedTuple):
    """The header the writer gives a file of these buffers: its bytes and what they parse to."""

    raw: bytes
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_bytes: int


def planned_header(items: list[tuple[str, tuple[int, ...], torch.dtype]],
                   metadata: Mapping[str, str] | None) -> PlannedHeader | None:
    """The header :class:`ShardSet` writes for ``items`` (key, shape, dtype) and ``metadata``. A file
    whose header is these exact bytes needs no parse and no check (:func:`read_header`). None where
    a key repeats: no writer plans that, and the parse refuses it."""
    with gc_paused():
        planned = layout(items)
    if len(planned.entries) != len(items):
        return None
    return PlannedHeader(header_bytes(planned, metadata), planned.entries, dict(metadata or {}), planned.data_bytes)


#: the characters a JSON string holds as they are, in ``json.dumps``' ASCII output (no escape)
_JSON_PLAIN = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')


def leading_metadata(raw: bytes, key: str) -> str | None:
    """``__metadata__[key]`` of a header whose JSON ``raw`` begins as :func:`header_bytes` writes a
    header whose metadata is that one key — ``{"__metadata__":{"<key>":"<value>"}`` then ``,`` or
    ``}`` — with a value of plain printable ASCII (no escape): read without a parse (a single
    file's manifest, before its header is checked; the value's own size bounds the work). Where
    the whole header is valid, this is the value its parse gives (a duplicate ``__metadata__``
    later on is refused by that parse). None where the header begins otherwise: parse it."""
    member = _metadata_json({key: ""}).encode("ascii")  # "__metadata__":{"<key>":""}
    start = 1 + len(member) - 2
    if not raw.startswith(b"{" + member[:-2]):
        return None
    end = raw.find(b'"', start)
    if end < 0 or raw[end + 1:end + 2] != b"}" or raw[end + 2:end + 3] not in (b",", b"}"):
        return None
    value = raw[start:end]
    return None if value.translate(None, _JSON_PLAIN) else value.decode("ascii")


class _PlannedFile:
    """One output file: entries laid out before any data exists; the header written first, or last
    into a reserved space when it depends on the data."""

    def __init__(self, final: Path, items: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: Mapping[str, str] | None, reserve: int | None, direct: bool = False) -> None:
        self.final = final
        self.tmp = final.with_name(f"{TMP_PREFIX}{secrets.token_hex(4)}-{final.name}")
        self.layout = layout(items)
        self.data_bytes = self.layout.data_bytes
        self.offsets: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {
            key: (e.shape, e.dtype, e.start) for key, e in self.layout.entries.items()}
        self.metadata = metadata
        self.reserve = reserve
        placeholder = {"": "A" * reserve} if reserve is not None else metadata
        self.header_len = len(header_bytes(self.layout, placeholder))
        self.fd = -1
        self.direct_wanted = direct and self.size >= DIRECT_MIN_BYTES
        self.direct: _DirectBlocks | None = None
        self.written: set[str] = set()
        self.done = False

    @property
    def size(self) -> int:
        return 8 + self.header_len + self.data_bytes

    def open(self) -> None:
        if self.fd < 0:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            os.ftruncate(self.fd, self.size)
            if self.direct_wanted:
                try:
                    self.direct = _DirectBlocks(self.tmp)
                except OSError:  # refused after all: the page cache it is
                    self.direct = None

    def write(self, key: str, data: memoryview) -> None:
        self.open()
        offset = 8 + self.header_len + self.offsets[key][2]
        if self.direct is not None and len(data) >= 2 * _BLOCK:
            try:
                done = self.direct.write(data, offset)
            except OSError:  # refused (alignment, file system): this file goes buffered from here
                self._close_direct()
            else:
                head = -offset % _BLOCK
                _pwrite_all(self.fd, data[:head], offset)
                _pwrite_all(self.fd, data[head + done:], offset + head + done)
                self.written.add(key)
                return
        _pwrite_all(self.fd, data, offset)
        if len(data) >= _WRITEBACK_MIN_BYTES:
            start_writeback(self.fd, offset, len(data))
        self.written.add(key)

    def _close_direct(self) -> None:
        if self.direct is not None:
            self.direct.close()
            self.direct = None

    @property
    def complete(self) -> bool:
        """Every planned buffer written, and the header known without more data (no reserve)."""
        return self.reserve is None and len(self.written) == len(self.offsets)

    def finish(self, metadata: Mapping[str, str] | None = None) -> int:
        """Write the header, fsync and close (the file stays at its temporary name); returns its size.
        A second call (the file was finished as soon as it was complete) only returns the size."""
        if self.done:
            return self.size
        missing = set(self.offsets) - self.written
        if missing:
            raise CheckpointError(f"{len(missing)} planned buffers were never written, e.g. {sorted(missing)[0]!r}",
                                  file=str(self.final))
        self.open()
        self._close_direct()  # every buffer is written
        header = header_bytes(self.layout, metadata if self.reserve is not None else self.metadata,
                              pad_to=self.header_len)
        if len(header) != self.header_len:  # the data-dependent header outgrew its room: rewrite
            self._rewrite(header)
        else:
            _pwrite_all(self.fd, memoryview(len(header).to_bytes(8, "little") + header), 0)
        os.fsync(self.fd)  # the buffered edges and the metadata; a device cache flush for the blocks too
        os.close(self.fd)
        self.fd = -1
        self.done = True
        return self.size

    def _rewrite(self, header: bytes) -> None:
        """Copy the data behind a larger header (rare: only when a reserve was too small)."""
        new = self.tmp.with_name(self.tmp.name + ".grow")
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _pwrite_all(fd, memoryview(len(header).to_bytes(8, "little") + header), 0)
            src_off, dst_off, left = 8 + self.header_len, 8 + len(header), self.data_bytes
            while left:
                n = os.copy_file_range(self.fd, fd, left, src_off, dst_off)
                if not n:
                    raise CheckpointError("short copy while growing a header", file=str(self.final))
                src_off, dst_off, left = src_off + n, dst_off + n, left - n
        except BaseException:
            os.close(fd)
            new.unlink(missing_ok=True)
            raise
        os.close(self.fd)
        os.replace(new, self.tmp)
        self.fd, self.header_len = fd, len(header)

    def abort(self) -> None:
        self._close_direct()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        discard(self.tmp)


class ShardSet:
    """The safetensors files of one checkpoint, planned up front and written buffer by buffer.

    ``layout``: (key, shape, dtype) of every buffer, in checkpoint order. ``shard_name(i, n)``
    names shard ``i`` of ``n`` (ignored with ``single``, the one file's path). ``metadata`` goes
    in every header; with ``reserve`` (single file only) the header is written at :meth:`finish`
    and its metadata may depend on the data. :meth:`write` streams one buffer to its offset
    (and returns its checksum when asked); :meth:`finish` fsyncs everything, :meth:`commit`
    renames the files to their final names.
    """

    def __init__(self, root: Path, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype]], *,
                 limit: int, shard_name: Callable[[int, int], str], single: Path | None = None,
                 metadata: Mapping[str, str] | None = None, reserve: int | None = None) -> None:
        self.root = root
        groups: list[list] = [[]]
        used = 0
        seen: set[str] = set()
        for key, shape, dtype in layout:
            if key in seen or key == "__metadata__":
                raise CheckpointError("two buffers would have the same safetensors key"
                                      if key in seen else "a tensor cannot be named __metadata__", field=key)
            seen.add(key)
            nbytes = math.prod(shape) * dtype.itemsize
            if single is None and groups[-1] and used + nbytes > limit:
                groups.append([])
                used = 0
            groups[-1].append((key, tuple(shape), dtype))
            used += nbytes
        n = len(groups)
        finals = [single] if single is not None else [root / shard_name(i, n) for i in range(n)]
        total = sum(math.prod(shape) * dtype.itemsize for items in groups for _, shape, dtype in items)
        check_free_space(root, total + sum(1024 + 160 * len(items) for items in groups))  # data and headers
        direct = use_direct_io(root, total)
        self.files = [_PlannedFile(final, items, metadata, reserve, direct) for final, items in zip(finals, groups)]
        self.file_of = {key: i for i, items in enumerate(groups) for key, _, _ in items}
        self._hasher: ThreadPoolExecutor | None = None
        self._renamed: list[Path] = []

    @property
    def names(self) -> list[str]:
        return [f.final.name for f in self.files]

    def planned(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        f = self.files[self.file_of[key]]
        shape, dtype, _ = f.offsets[key]
        return shape, dtype

    def write(self, key: str, t: torch.Tensor, *, with_checksum: bool = False) -> int | None:
        """Write one buffer (shape and dtype as planned) at its offset; its XXH3-64 if asked."""
        i = self.file_of.get(key)
        if i is None:
            raise CheckpointError("buffer is not in the planned layout", field=key)
        f = self.files[i]
        shape, dtype, _ = f.offsets[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(f"buffer is {t.dtype}{list(t.shape)}, the plan says {dtype}{list(shape)}",
                                  file=str(f.final), field=key)
        if key in f.written:
            raise CheckpointError("buffer written twice", file=str(f.final), field=key)
        data = tensor_bytes(t)
        digest = None
        if with_checksum:
            if self._hasher is None:  # xxhash and pwrite both release the GIL: hash while writing
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="te-serial-xxh3")
            digest = self._hasher.submit(xxhash.xxh3_64_intdigest, data)
        with writing(f.final):
            f.write(key, data)
            if f.complete:  # a full shard is flushed now: its fsync overlaps the next shard's work
                f.finish()
        return digest.result() if digest is not None else None

    def finish(self, metadata: Mapping[str, str] | None = None) -> dict[str, int]:
        """fsync every file (``metadata``: the data-dependent header of a single file); name → size."""
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        sizes = {}
        for f in self.files:
            with writing(f.final):
                sizes[f.final.name] = f.finish(metadata)
        return sizes

    def commit(self) -> None:
        """Rename every file to its final name (invisible to readers until a manifest names them)."""
        for f in self.files:
            with writing(f.final):
                os.replace(f.tmp, f.final)
            self._renamed.append(f.final)

    def abort(self) -> None:
        """Remove every file written, renamed ones too (a failure before the manifest's commit)."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        for f in self.files:
            f.abort()
        for final in self._renamed:
            discard(final)
        self._renamed = []


def clean_directory(root: Path, keep: set[str], ours: re.Pattern, *, leftovers: bool = True) -> None:
    """After a commit: remove files of te-serial's own naming (``ours``, and with ``leftovers`` any
    temporary file of an interrupted write) that the committed manifest does not name. Nothing
    else is touched. Several files are removed in parallel (freeing a large file's cached pages
    takes a while; ``unlink`` releases the GIL)."""
    stale = [p for p in root.iterdir()
             if p.name not in keep and ((leftovers and is_leftover(p.name)) or ours.fullmatch(p.name))]
    if len(stale) > 1:
        with ThreadPoolExecutor(min(8, len(stale)), thread_name_prefix="te-serial-clean") as pool:
            list(pool.map(discard, stale))
    elif stale:
        discard(stale[0])


