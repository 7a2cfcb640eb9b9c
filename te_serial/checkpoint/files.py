"""Reading safetensors files, the one way te-serial does: :class:`SafetensorsFile` opens a file without
following a symlink (unless asked), keeps one descriptor, checks its header (:mod:`.header`), and reads
a buffer as a view of the file's private mmap (CPU loads: no copy), as a mapping of the buffer's own
pages (streaming conversion: no copy, and unmapped once freed, so the process does not grow with the
file), or into fresh memory.

Every path that reads checkpoint files goes through here (``load_quantized`` / ``open`` / ``verify`` /
``read_protos``, ``convert``'s sources); every path that writes them through :mod:`.shards`, committed
by :mod:`.fileops`.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import mmap
import os
import weakref
from pathlib import Path

import torch
import xxhash

from ..errors import CheckpointError, CheckpointFileError
from .fileops import libc_function, open_regular
from .header import Entry, PlannedHeader, read_header


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
                pages = own_pages(self._fd, base, start + e.nbytes - base)
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

@functools.cache
def _libc_mmap() -> tuple | None:
    """libc's (mmap, munmap), or None where there are none."""
    mm = libc_function("mmap", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int64))
    un = libc_function("munmap", (ctypes.c_void_p, ctypes.c_size_t))
    if mm is None or un is None:
        return None
    mm.restype = ctypes.c_void_p
    return mm, un


_MAP_FAILED = ctypes.c_void_p(-1).value


def own_pages(fd: int, offset: int, length: int):
    """A private, writable mapping of ``length`` bytes of file ``fd`` from ``offset`` (a multiple of
    the allocation granularity), unmapped once the object is freed. It holds no descriptor: Python's
    mmap keeps a duplicate per mapping, so a model holding thousands of mapped tensors would run out
    of descriptors. A ctypes array over libc's mapping; Python's mmap where libc has none."""
    fns = _libc_mmap()
    if fns is None:
        return mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    mm, un = fns
    addr = mm(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    pages = (ctypes.c_ubyte * length).from_address(addr)
    weakref.finalize(pages, un, addr, length)
    return pages


_MADV_PAGEOUT = 21  # <linux/mman.h> (Linux 5.4): reclaim the range's pages; never loses data

def release_pages(t: torch.Tensor) -> None:
    """Hint that the memory of CPU tensor ``t``, read and no longer needed, may leave the process:
    where it is a file's mapped pages (a safetensors file read through mmap), they stop counting
    in its resident memory, so reading a whole file a tensor at a time stays bounded by what is
    held. Only pages wholly inside ``t`` are named; memory that is not a file's is left as it is
    (no swap), and where the hint is refused nothing changes."""
    fn = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if fn is None or t.device.type != "cpu" or not t.numel():
        return
    start, page = t.data_ptr(), mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if end > first:
        fn(first, end - first, _MADV_PAGEOUT)
