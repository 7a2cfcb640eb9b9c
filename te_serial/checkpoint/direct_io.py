"""Whether a save writes its blocks with ``O_DIRECT``: decided from the file system and the size.

A buffered write leaves the checkpoint in the page cache, so the load that often follows a save
(evaluation, a resume on the same node, a conversion's next step) reads memory; a direct write
makes that load read the disk. Direct writes pay only where the checkpoint would not stay cached
anyway, and only where the file system writes direct blocks about as fast as buffered ones.
So, unless ``TE_SERIAL_DIRECT_IO=1`` / ``=0`` forces a choice:

1. a memory-backed file system (tmpfs, ramfs), or one that refuses ``O_DIRECT``: buffered;
2. a checkpoint that fits in half the memory the kernel reports available: buffered;
3. otherwise a short probe of the file system (buffered + fsync against direct, a few MiB in the
   checkpoint's directory, once per file system per process): direct where it is at least
   :data:`DIRECT_MARGIN` as fast.

A save that starts buffered on such a file system is watched (:class:`PageCacheWatch`): once its
last :data:`WATCH_BYTES` of large writes went into the page cache slower than the probe wrote
direct, the rest of the save writes direct. The cache is worth keeping only while it takes the
bytes faster than the disk: memory the kernel must first get back from a hypervisor (a VM whose
balloon reports free pages takes ~3 µs per 4 KiB page touched anew: 0.35 GB/s) or writeback
throttling of piled-up dirty pages make it slower, and no probe of a few MiB sees either coming.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import secrets
import threading
import time
from pathlib import Path

#: ``TE_SERIAL_DIRECT_IO=1`` writes direct wherever the file system allows, ``=0`` never
DIRECT_IO_ENV = "TE_SERIAL_DIRECT_IO"
#: file systems that keep files in memory: bypassing a cache there saves nothing
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
#: bytes written each way by the probe
PROBE_BYTES = 16 << 20
#: direct is chosen when its probe throughput is at least this fraction of the buffered one
DIRECT_MARGIN = 0.9
#: a watched save goes direct once this many bytes of its latest large buffered writes, timed
#: together, went into the page cache slower than the probe's direct writes
WATCH_BYTES = 32 << 20
_BLOCK = 4096


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the probe measured, in bytes per second: buffered writes + fsync, and direct ones."""

    buffered: float
    direct: float

    @property
    def direct_wins(self) -> bool:
        return self.direct >= DIRECT_MARGIN * self.buffered


_probes: dict[tuple[int, bool], float | None] = {}   # (st_dev, direct) → bytes/s (None: refused), this process
_file_systems: dict[int, "FileSystem"] = {}   # st_dev → what was found there, for this process
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class FileSystem:
    """What the choice needs to know about where a checkpoint is written."""

    device: int          # st_dev
    fstype: str          # as /proc/self/mountinfo names it ("" where unknown)
    direct: bool         # O_DIRECT opens succeed there


def file_system(directory: Path) -> FileSystem:
    """The file system holding ``directory`` (which exists); looked at once per process."""
    device = os.stat(directory).st_dev
    with _lock:
        fs = _file_systems.get(device)
    if fs is None:
        fs = FileSystem(device, _fstype(directory, device), _opens_direct(directory))
        with _lock:
            _file_systems[device] = fs
    return fs


def _fstype(directory: Path, device: int) -> str:
    """The mount's type from /proc/self/mountinfo: the entry whose device numbers are the
    directory's, else the longest mount point above it."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    real = os.path.realpath(directory)
    by_prefix, best = "", -1
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-")
            major, minor = map(int, fields[2].split(":"))
            point, fstype = fields[4].replace("\\040", " "), fields[sep + 1]
        except (ValueError, IndexError):
            continue
        if os.makedev(major, minor) == device:
            return fstype
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            by_prefix, best = fstype, len(point)
    return by_prefix


def _scratch(directory: Path, flags: int = 0) -> int:
    """An open file in ``directory`` that no name leads to, so a process killed while it writes
    leaves nothing behind: ``O_TMPFILE`` where the file system has it, else a name unlinked at once."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_WRONLY | flags, 0o600)
        except OSError:
            pass
    path = directory / f".te-serial-probe-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o600)
    path.unlink(missing_ok=True)
    return fd


def _opens_direct(directory: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(_scratch(directory, os.O_DIRECT))
    except OSError:
        return False
    return True


def cache_budget() -> int:
    """Bytes of page cache a checkpoint may count on: half of what the kernel reports available."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError):
        return 0


def forced() -> bool | None:
    """The setting of ``TE_SERIAL_DIRECT_IO``: True (``1``), False (``0``) or None (decide)."""
    value = os.environ.get(DIRECT_IO_ENV, "").strip()
    return {"1": True, "0": False}.get(value)


def decide(fs: FileSystem, total_bytes: int, budget: int, probe=None) -> bool:
    """The choice for a checkpoint of ``total_bytes`` on ``fs`` with ``budget`` bytes of page
    cache (the rule in the module docstring); ``probe()`` (the file system's :class:`Rates`, or
    None) runs only where it decides."""
    if not _may_go_direct(fs):
        return False
    if forced():
        return True
    if total_bytes <= budget:
        return False
    rates = probe() if probe is not None else None
    return rates is not None and rates.direct_wins


def _may_go_direct(fs: FileSystem) -> bool:
    """Whether any write there can be direct: O_DIRECT taken, not forced off, and either forced on
    or a file system that keeps its files on a device."""
    force = forced()
    return fs.direct and force is not False and (force or fs.fstype not in MEMORY_FILE_SYSTEMS)


def _where(directory: Path) -> Path:
    """The directory a save into ``directory`` lands in: itself, or the nearest one above that exists."""
    directory = Path(directory)
    while not directory.is_dir() and directory.parent != directory:  # not made yet: where it will be
        directory = directory.parent
    return directory


def write_mode(directory: Path, total_bytes: int, watch_from: int) -> "tuple[bool, PageCacheWatch | None]":
    """How a save of ``total_bytes`` into ``directory`` writes: whether its whole blocks go with
    O_DIRECT from the start, and else the watch that may turn it direct on the way (a save of at
    least ``watch_from`` bytes where it could go direct and no setting forces a choice), or None."""
    if forced() is False or not hasattr(os, "O_DIRECT"):
        return False, None
    directory = _where(directory)
    fs = file_system(directory)
    if decide(fs, total_bytes, cache_budget(), probe=lambda: _probe(directory, fs.device)):
        return True, None
    watched = forced() is None and total_bytes >= watch_from and _may_go_direct(fs)
    return False, PageCacheWatch(directory, fs.device) if watched else None


class PageCacheWatch:
    """Times one save's large buffered writes; :attr:`direct` turns True (and stays) once the last
    :data:`WATCH_BYTES` of them went into the page cache slower than the file system's probe
    wrote direct (the module docstring says why). Shared by the save's writing threads."""

    def __init__(self, directory: Path, device: int) -> None:
        self.directory, self.device = directory, device
        self.direct = False
        self._window: collections.deque[tuple[int, float]] = collections.deque()
        self._bytes, self._seconds = 0, 0.0
        self._lock = threading.Lock()

    def timed(self, nbytes: int, seconds: float) -> bool:
        """Record a buffered write of ``nbytes`` that took ``seconds``; whether the save goes direct now."""
        with self._lock:
            if self.direct:
                return True
            self._window.append((nbytes, seconds))
            self._bytes, self._seconds = self._bytes + nbytes, self._seconds + seconds
            while self._bytes - self._window[0][0] >= WATCH_BYTES:
                n, t = self._window.popleft()
                self._bytes, self._seconds = self._bytes - n, self._seconds - t
            if self._bytes >= WATCH_BYTES:
                disk = _rate(self.directory, self.device, direct=True)
                self.direct = disk is not None and self._bytes < disk * self._seconds
            return self.direct


def _probe(directory: Path, device: int) -> Rates | None:
    """The :class:`Rates` of the file system holding ``directory`` (None where a write was refused)."""
    buffered = _rate(directory, device, direct=False)
    disk = _rate(directory, device, direct=True)
    return None if buffered is None or disk is None else Rates(buffered, disk)


def _rate(directory: Path, device: int, direct: bool) -> float | None:
    """Bytes/s of a write of :data:`PROBE_BYTES` + fsync in ``directory``, buffered or direct;
    measured once per file system per process (None where refused)."""
    with _lock:
        if (device, direct) not in _probes:
            _probes[device, direct] = _measure(directory, direct)
        return _probes[device, direct]


def _measure(directory: Path, direct: bool) -> float | None:
    data = mmap.mmap(-1, PROBE_BYTES)            # page-aligned, as O_DIRECT needs
    data.write(secrets.token_bytes(_BLOCK) * (PROBE_BYTES // _BLOCK))
    try:
        start = time.perf_counter()
        fd = _scratch(directory, os.O_DIRECT if direct else 0)
        try:
            with memoryview(data) as view:
                done = 0
                while done < PROBE_BYTES:
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        return PROBE_BYTES / max(time.perf_counter() - start, 1e-9)
    except OSError:
        return None
    finally:
        data.close()
