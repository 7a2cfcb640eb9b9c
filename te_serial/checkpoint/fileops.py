"""Committing files safely: every write's errors named, temporary names, fsync, atomic renames,
the free-space check before the first byte, and the removal of what an interrupted or superseded
write left (used by every writer: checkpoints, conversions, DCP)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator


from ..errors import CheckpointError, CheckpointFileError, CheckpointWriteError


TMP_PREFIX = ".te_serial-tmp-"

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
            pwrite_all(fd, memoryview(data), 0)
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

def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n

@functools.lru_cache(maxsize=None)
def libc_function(name: str, argtypes: tuple) -> Callable | None:
    """A libc function by name (None where there is none: not Linux)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    return fn

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
