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
"""

from __future__ import annotations

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
_BLOCK = 4096

_probes: dict[int, bool] = {}   # st_dev → the probe's verdict (direct wins), for this process
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


def _opens_direct(directory: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / f".te-serial-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        path.unlink(missing_ok=True)
        return False
    os.close(fd)
    path.unlink(missing_ok=True)
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
    cache (the rule in the module docstring); ``probe()`` runs only where it decides."""
    force = forced()
    if not fs.direct or force is False:
        return False
    if force:
        return True
    if fs.fstype in MEMORY_FILE_SYSTEMS or total_bytes <= budget:
        return False
    return bool(probe()) if probe is not None else False


def use_direct_io(directory: Path, total_bytes: int) -> bool:
    """Whether a save of ``total_bytes`` into ``directory`` writes its whole blocks with O_DIRECT."""
    if forced() is False or not hasattr(os, "O_DIRECT"):
        return False
    directory = Path(directory)
    while not directory.is_dir() and directory.parent != directory:  # not made yet: where it will be
        directory = directory.parent
    fs = file_system(directory)
    return decide(fs, total_bytes, cache_budget(), probe=lambda: _probe(directory, fs.device))


def _probe(directory: Path, device: int) -> bool:
    """Buffered + fsync against direct writes of :data:`PROBE_BYTES` here (once per file system)."""
    with _lock:
        verdict = _probes.get(device)
        if verdict is None:
            verdict = _probes[device] = _direct_wins(directory)
        return verdict


def _direct_wins(directory: Path) -> bool:
    data = mmap.mmap(-1, PROBE_BYTES)            # page-aligned, as O_DIRECT needs
    data.write(secrets.token_bytes(_BLOCK) * (PROBE_BYTES // _BLOCK))
    path = directory / f".te-serial-probe-{secrets.token_hex(4)}"
    try:
        timings = {}
        for direct in (False, True):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            start = time.perf_counter()
            fd = os.open(path, flags, 0o600)
            try:
                with memoryview(data) as view:
                    done = 0
                    while done < PROBE_BYTES:
                        done += os.write(fd, view[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
            timings[direct] = time.perf_counter() - start
            path.unlink()
        return timings[True] * DIRECT_MARGIN <= timings[False]
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)
        data.close()
