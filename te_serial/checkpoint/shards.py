"""Writing planned safetensors files: :class:`ShardSet` plans the files of a checkpoint from the
(key, shape, dtype) of every buffer, before any data exists, then streams each buffer to its offset.

* Shards follow Hugging Face's rule: a shard holds buffers in order until the next one would take
  it over the limit, and goes over only when a single buffer is larger than the limit (it then
  stands alone).
* Large files are written a block at a time with ``O_DIRECT`` where :mod:`.direct_io` chooses it
  (:class:`_DirectBlocks`), the rest through the page cache, whose writeback starts at once; a
  buffered save whose page cache falls behind the disk goes direct for the rest
  (:class:`.direct_io.PageCacheWatch`).
* Files are written under temporary names (:data:`~.fileops.TMP_PREFIX`), fsync'd, renamed into
  place; the caller's manifest (or index) rename is the commit.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy
import torch
import xxhash

from ..errors import CheckpointError
from .direct_io import PageCacheWatch, write_mode
from .fileops import TMP_PREFIX, check_free_space, discard, libc_function, pwrite_all, writing
from .files import tensor_bytes
from .header import header_bytes, layout


#: where a save writes direct (:mod:`.direct_io`), files at least this large write the whole blocks
#: of each buffer with ``O_DIRECT``
DIRECT_MIN_BYTES = 64 << 20

_BLOCK = 4096          # O_DIRECT alignment of offsets, lengths and memory (a multiple of any sector)

_STAGE_BYTES = 8 << 20

class _DirectBlocks:
    """The whole blocks of a file, written with ``O_DIRECT`` from an aligned staging buffer.

    Used where :func:`.direct_io.write_mode` chose it (a checkpoint larger than the page cache
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
#: a watched save's buffered writes go in pieces this large, each timed (a buffer of 500 MB can
#: turn direct part way)
_WATCHED_PIECE = 8 << 20

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait

def _sync_file_range() -> Callable | None:
    return libc_function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))

def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` to disk now, without waiting. The
    pages stay cached (a load after the save reads memory), while the disk works beside whatever
    the writer computes next, instead of all at the final fsync: the kernel's own background
    writeback starts only once a tenth of memory is dirty. A hint: where it is refused, nothing
    changes."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)

class _PlannedFile:
    """One output file: entries laid out before any data exists; the header written first, or last
    into a reserved space when it depends on the data."""

    def __init__(self, final: Path, items: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: Mapping[str, str] | None, reserve: int | None, direct: bool = False,
                 watch: PageCacheWatch | None = None) -> None:
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
        self.watch = watch if not self.direct_wanted and self.size >= DIRECT_MIN_BYTES else None
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
                self._open_direct()

    def _open_direct(self) -> None:
        try:
            self.direct = _DirectBlocks(self.tmp)
        except OSError:  # refused after all: the page cache it is
            self.direct = None
        self.watch = None

    def write(self, keys: tuple[str, ...], data: memoryview, at: int = 0, last: bool = True) -> None:
        """Write ``data`` at the offset of ``keys[0]`` (plus ``at`` bytes): the bytes of the buffers
        ``keys``, laid out one after another, or (``last`` False) a part of one, written at last by
        the part that ends it."""
        self.open()
        self._write(data, 8 + self.header_len + self.offsets[keys[0]][2] + at)
        if last:
            self.written.update(keys)

    def _write(self, data: memoryview, offset: int) -> None:
        if self.watch is not None and self.watch.direct:
            self._open_direct()
        if self.direct is not None and len(data) >= 2 * _BLOCK:
            try:
                done = self.direct.write(data, offset)
            except OSError:  # refused (alignment, file system): this file goes buffered from here
                self._close_direct()
            else:
                head = -offset % _BLOCK
                pwrite_all(self.fd, data[:head], offset)
                pwrite_all(self.fd, data[head + done:], offset + head + done)
                return
        if self.watch is None or len(data) < _WRITEBACK_MIN_BYTES:
            self._write_buffered(data, offset)
            return
        for at in range(0, len(data), _WATCHED_PIECE):  # timed piece by piece; direct from where it falls behind
            piece = data[at:at + _WATCHED_PIECE]
            start = time.perf_counter()
            pwrite_all(self.fd, piece, offset + at)
            behind = self.watch.timed(len(piece), time.perf_counter() - start)
            start_writeback(self.fd, offset + at, len(piece))
            if behind and at + len(piece) < len(data):
                self._write(data[at + len(piece):], offset + at + len(piece))
                return

    def _write_buffered(self, data: memoryview, offset: int) -> None:
        pwrite_all(self.fd, data, offset)
        if len(data) >= _WRITEBACK_MIN_BYTES:
            start_writeback(self.fd, offset, len(data))

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
            pwrite_all(self.fd, memoryview(len(header).to_bytes(8, "little") + header), 0)
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
            pwrite_all(fd, memoryview(len(header).to_bytes(8, "little") + header), 0)
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
        direct, watch = write_mode(root, total, watch_from=DIRECT_MIN_BYTES)
        self.files = [_PlannedFile(final, items, metadata, reserve, direct, watch)
                      for final, items in zip(finals, groups)]
        self.file_of = {key: i for i, items in enumerate(groups) for key, _, _ in items}
        self._hasher: ThreadPoolExecutor | None = None
        self._parts: dict[str, tuple[int, xxhash.xxh3_64 | None]] = {}   # key → (bytes written, its hash so far)
        self._renamed: list[Path] = []

    @property
    def names(self) -> list[str]:
        return [f.final.name for f in self.files]

    def planned(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        f = self.files[self.file_of[key]]
        shape, dtype, _ = f.offsets[key]
        return shape, dtype

    def _planned_file(self, key: str) -> _PlannedFile:
        i = self.file_of.get(key)
        if i is None:
            raise CheckpointError("buffer is not in the planned layout", field=key)
        return self.files[i]

    def _hash(self, fn: Callable, data: memoryview):
        """``fn(data)`` on the hasher's one thread (in submission order): xxhash and pwrite both
        release the GIL, so a buffer is hashed while it is written."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="te-serial-xxh3")
        return self._hasher.submit(fn, data)

    @staticmethod
    def _write_to(f: _PlannedFile, keys: tuple[str, ...], data: memoryview, at: int = 0, last: bool = True) -> None:
        with writing(f.final):
            f.write(keys, data, at, last)
            if last and f.complete:  # a full shard is flushed now: its fsync overlaps the next shard's work
                f.finish()

    def write(self, key: str, t: torch.Tensor, *, with_checksum: bool = False) -> int | None:
        """Write one buffer (shape and dtype as planned) at its offset; its XXH3-64 if asked."""
        f = self._planned_file(key)
        shape, dtype, _ = f.offsets[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(f"buffer is {t.dtype}{list(t.shape)}, the plan says {dtype}{list(shape)}",
                                  file=str(f.final), field=key)
        if key in f.written:
            raise CheckpointError("buffer written twice", file=str(f.final), field=key)
        data = tensor_bytes(t)
        digest = self._hash(xxhash.xxh3_64_intdigest, data) if with_checksum else None
        self._write_to(f, (key,), data)
        return digest.result() if digest is not None else None

    def write_part(self, key: str, t: torch.Tensor, at: int, *, with_checksum: bool = False) -> int | None:
        """Write ``t`` (contiguous, the planned dtype's item size) at byte ``at`` of buffer ``key``: a
        buffer too large to hold at once, streamed in parts in order (each ``at`` is where the one
        before ended). Its XXH3-64 of every part, in order, with the part that ends it when asked
        (None before)."""
        f = self._planned_file(key)
        shape, dtype, _ = f.offsets[key]
        total, data = math.prod(shape) * dtype.itemsize, tensor_bytes(t)
        done, state = self._parts.get(key, (0, None))
        if key in f.written or t.element_size() != dtype.itemsize or at != done or at + len(data) > total:
            raise CheckpointError(f"a part of {len(data)} bytes at byte {at} does not continue the buffer "
                                  f"({done} of its {total} bytes written; parts come in order)",
                                  file=str(f.final), field=key)
        if at and with_checksum != (state is not None):
            raise CheckpointError("a buffer's parts are hashed all or none", file=str(f.final), field=key)
        if with_checksum and state is None:
            state = xxhash.xxh3_64()
        pending = self._hash(state.update, data) if with_checksum else None
        last = at + len(data) == total
        try:
            self._write_to(f, (key,), data, at, last)
        finally:
            if pending is not None:
                pending.result()
        if not last:
            self._parts[key] = (at + len(data), state)
            return None
        self._parts.pop(key, None)
        return state.intdigest() if with_checksum else None

    def write_run(self, keys: Sequence[str], t: torch.Tensor) -> bool:
        """Write the buffers ``keys`` with one write, where they lie one after another in one file (as
        planned) and ``t`` (contiguous) holds their bytes in order, e.g. a stack's experts cut by rows.
        False, with nothing written, where they do not (the caller writes them one by one)."""
        i = self.file_of.get(keys[0]) if keys else None
        if i is None or not t.is_contiguous():
            return False
        f = self.files[i]
        at = f.offsets[keys[0]][2]
        for key in keys:
            spec = f.offsets.get(key)
            if spec is None or spec[2] != at or key in f.written:
                return False
            at += math.prod(spec[0]) * spec[1].itemsize
        if at - f.offsets[keys[0]][2] != t.numel() * t.element_size():
            return False
        self._write_to(f, tuple(keys), tensor_bytes(t))
        return True

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
