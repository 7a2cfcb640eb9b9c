"""When a save writes direct (``te_serial.checkpoint.direct_io``): the rule, on real file systems.

Buffered unless the checkpoint outgrows the page cache it can count on, on a file system that is
not memory-backed and whose direct writes keep up (a probe, once per file system); a buffered save
whose page cache falls behind the probe's direct writes goes direct for the rest; the
``TE_SERIAL_DIRECT_IO`` setting forces either.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial.checkpoint import direct_io, shards

DISK = direct_io.FileSystem(1, "ext4", True)
TMPFS = direct_io.FileSystem(2, "tmpfs", True)
NO_DIRECT = direct_io.FileSystem(3, "nfs", False)
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(direct_io.DIRECT_IO_ENV, raising=False)
    monkeypatch.setattr(direct_io, "_probes", {})
    monkeypatch.setattr(direct_io, "_file_systems", {})


FAST_DIRECT, SLOW_DIRECT = direct_io.Rates(1e9, 2e9), direct_io.Rates(2e9, 1e9)


class _Probe:
    def __init__(self, verdict: bool) -> None:
        self.rates, self.calls = {True: FAST_DIRECT, False: SLOW_DIRECT, None: None}[verdict], 0

    def __call__(self) -> direct_io.Rates:
        self.calls += 1
        return self.rates


@pytest.mark.parametrize("fs, total, verdict, want, probed", [
    (DISK, GIB, True, False, 0),          # fits in the page cache: buffered, no probe
    (DISK, 8 * GIB, True, True, 1),       # outgrows it: the probe decides
    (DISK, 8 * GIB, False, False, 1),
    (DISK, 8 * GIB, None, False, 1),      # the probe failed: buffered
    (TMPFS, 8 * GIB, True, False, 0),     # memory-backed: nothing to bypass
    (NO_DIRECT, 8 * GIB, True, False, 0),
])
def test_the_rule(fs, total, verdict: bool | None, want, probed):
    probe = _Probe(verdict)
    assert direct_io.decide(fs, total, 2 * GIB, probe) is want
    assert probe.calls == probed


@pytest.mark.parametrize("setting, fs, want", [("1", DISK, True), ("1", TMPFS, True), ("1", NO_DIRECT, False),
                                               ("0", DISK, False), ("", DISK, False), ("yes", DISK, False)])
def test_the_forced_settings(monkeypatch, setting, fs, want):
    """``1`` writes direct wherever the file system allows, ``0`` never; anything else decides
    (here: a checkpoint that fits the cache, so buffered)."""
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, setting)
    probe = _Probe(True)
    assert direct_io.decide(fs, GIB, 2 * GIB, probe) is want
    assert probe.calls == 0


def _count_direct_files(monkeypatch) -> list:
    made = []
    real = shards._DirectBlocks.__init__

    def init(self, path):
        real(self, path)
        made.append(path)
    monkeypatch.setattr(shards._DirectBlocks, "__init__", init)
    return made


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": ts.MXFP8Quantizer()(torch.randn(256, 512, generator=g)), "b": torch.randn(9000, generator=g)}


def _save_and_check(path: Path, sd) -> None:
    ts.save_quantized(sd, path)
    out = ts.load_quantized(path, verify=True)
    for k, v in sd.items():
        got, want = out[k], v
        if isinstance(want, torch.Tensor) and not hasattr(want, "quantizer"):
            assert torch.equal(got, want)
        else:
            for n, b in want.buffers().items():
                assert torch.equal(got.buffers()[n].view(torch.uint8), b.view(torch.uint8)), (k, n)


def test_a_checkpoint_that_fits_the_cache_is_written_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
    made = _count_direct_files(monkeypatch)
    _save_and_check(tmp_path / "ckpt", _state())
    assert made == []


def test_a_large_checkpoint_on_a_disk_follows_the_probe(tmp_path, monkeypatch):
    """The checkpoint's own file system, probed once per process: direct where the probe says so
    (the whole blocks through O_DIRECT), buffered where not; the bytes are the same either way."""
    fs = direct_io.file_system(tmp_path)
    assert fs.fstype  # found in /proc/self/mountinfo
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_io, "cache_budget", lambda: 0)  # nothing fits
    made = _count_direct_files(monkeypatch)
    calls = []
    monkeypatch.setattr(direct_io, "_measure", lambda d, direct: calls.append(d) or (2e9 if direct else 1e9))
    _save_and_check(tmp_path / "a", _state())
    _save_and_check(tmp_path / "b", _state())
    memory = fs.fstype in direct_io.MEMORY_FILE_SYSTEMS
    assert len(calls) == (0 if memory or not fs.direct else 2)  # probed once each way, then remembered
    assert bool(made) == (fs.direct and not memory)
    monkeypatch.setattr(direct_io, "_probes", {})
    monkeypatch.setattr(direct_io, "_measure", lambda d, direct: 1e9 if direct else 2e9)
    made.clear()
    _save_and_check(tmp_path / "c", _state())
    assert made == []


def test_the_probe_measures_both_ways_and_leaves_nothing(tmp_path):
    fd = direct_io._scratch(tmp_path)   # nameless while open: a process killed mid-probe leaves nothing
    try:
        assert os.write(fd, b"x") == 1 and list(tmp_path.iterdir()) == []
    finally:
        os.close(fd)
    rates = direct_io._probe(tmp_path, 99)
    if direct_io.file_system(tmp_path).direct:
        assert rates.buffered > 0 and rates.direct > 0 and rates.direct_wins == (rates.direct >= 0.9 * rates.buffered)
        assert direct_io._probes == {(99, False): rates.buffered, (99, True): rates.direct}
    else:
        assert rates is None   # the direct half refused
    assert list(tmp_path.iterdir()) == []


def _watch(monkeypatch, direct_rate: float | None) -> direct_io.PageCacheWatch:
    probes = []
    monkeypatch.setattr(direct_io, "_rate", lambda d, dev, direct: probes.append(direct) or direct_rate)
    watch = direct_io.PageCacheWatch(Path("."), 1)
    watch.probes = probes
    return watch


def test_a_watch_turns_direct_once_its_latest_writes_fell_behind_the_disk(monkeypatch):
    """The window is the latest WATCH_BYTES of timed writes: fast ones before it do not hide a slow
    run, nothing is decided (or probed) before a window is full, and the verdict then stays."""
    mib = 1 << 20
    piece = direct_io.WATCH_BYTES // 4
    watch = _watch(monkeypatch, direct_rate=1e9)
    for i in range(3):
        assert not watch.timed(piece, piece / 4e9) and watch.probes == [], i   # not a window yet
    assert not watch.timed(piece, piece / 4e9) and watch.probes == [True]    # a window at 4 GB/s; the disk's rate
    # one write at 0.5 GB/s: the window is 3 at 4 GB/s and it, 1.5 GB/s in all; a second: 0.9 GB/s
    assert not watch.timed(piece, piece / 0.5e9)
    assert watch.timed(piece, piece / 0.5e9)
    assert watch.timed(mib, mib / 100e9) and watch.direct   # stays direct
    steady = _watch(monkeypatch, direct_rate=1e9)
    assert not any(steady.timed(piece, piece / 1.2e9) for _ in range(12))   # keeps up: buffered throughout
    failed = _watch(monkeypatch, direct_rate=None)          # no probe verdict: buffered
    assert not any(failed.timed(piece, piece / 1e6) for _ in range(8))


def test_which_saves_are_watched(tmp_path, monkeypatch):
    fs = direct_io.file_system(tmp_path)
    watched = fs.direct and fs.fstype not in direct_io.MEMORY_FILE_SYSTEMS
    monkeypatch.setattr(direct_io, "cache_budget", lambda: GIB)   # what follows fits: buffered
    mib64 = 64 << 20
    direct, watch = direct_io.write_mode(tmp_path / "not" / "made", mib64, watch_from=mib64)
    assert not direct and (watch is not None) == watched
    assert direct_io.write_mode(tmp_path, mib64 - 1, watch_from=mib64) == (False, None)   # too small to go direct
    for setting in ("0", "1"):   # a forced choice is never second-guessed
        monkeypatch.setenv(direct_io.DIRECT_IO_ENV, setting)
        assert direct_io.write_mode(tmp_path, mib64, watch_from=0)[1] is None


def _big_state():
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(1000, 1031, generator=g).to(torch.bfloat16),   # odd sizes: unaligned offsets
            "w": ts.MXFP8Quantizer()(torch.randn(1024, 2048, generator=g)),
            "b": torch.randn(777, generator=g)}


@pytest.mark.parametrize("direct_rate, goes_direct", [(1e18, True), (1.0, False)])
def test_a_save_whose_page_cache_falls_behind_goes_direct_part_way(tmp_path, monkeypatch, direct_rate, goes_direct):
    """Buffered writes are timed piece by piece; once the window is slower than the disk (here: a disk
    said to be infinitely fast), the rest of the save, from inside the buffer being written, goes
    direct. The bytes are the same either way."""
    fs = direct_io.file_system(tmp_path)
    watched = fs.direct and fs.fstype not in direct_io.MEMORY_FILE_SYSTEMS
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(shards, "_WATCHED_PIECE", 256 << 10)
    monkeypatch.setattr(direct_io, "WATCH_BYTES", 512 << 10)
    monkeypatch.setattr(direct_io, "_measure", lambda d, direct: direct_rate if direct else 1e9)
    made = _count_direct_files(monkeypatch)
    pieces = []
    real = shards.pwrite_all
    monkeypatch.setattr(shards, "pwrite_all", lambda fd, view, off: pieces.append(len(view)) or real(fd, view, off))
    _save_and_check(tmp_path / "ckpt", _big_state())
    assert bool(made) == (watched and goes_direct)
    if watched and goes_direct:   # two timed pieces filled the window, then the first buffer went on direct
        assert pieces[:2] == [256 << 10] * 2 and sum(pieces) < 2_100_000
    elif watched:
        assert pieces.count(256 << 10) > 8   # every large buffer in timed pieces, all buffered


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_tmpfs_is_written_buffered_however_large(monkeypatch):
    work = Path("/dev/shm") / f"te-serial-test-{os.getpid()}"
    work.mkdir()
    try:
        fs = direct_io.file_system(work)
        assert fs.fstype == "tmpfs"
        monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
        monkeypatch.setattr(direct_io, "cache_budget", lambda: 0)
        monkeypatch.setattr(direct_io, "_measure", lambda d, direct: pytest.fail("probed a tmpfs"))
        made = _count_direct_files(monkeypatch)
        _save_and_check(work / "ckpt", _state())
        assert made == []
        monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "1")  # forced: direct where tmpfs takes O_DIRECT
        _save_and_check(work / "forced", _state())
        assert bool(made) == fs.direct
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def ext4_loop(tmp_path):
    """A 64 MiB ext4 file system on a loop device, where this process may make one (root, with
    mkfs.ext4 and loop devices); the test is skipped where it may not."""
    image, mount = tmp_path / "ext4.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot make an ext4 loop mount here: {e}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60)


def test_an_ext4_loop_mount(ext4_loop, monkeypatch):
    fs = direct_io.file_system(ext4_loop)
    assert fs.fstype == "ext4" and fs.direct and fs.device != os.stat(ext4_loop.parent).st_dev
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
    made = _count_direct_files(monkeypatch)
    _save_and_check(ext4_loop / "small", _state())
    assert made == []  # fits the cache
    monkeypatch.setattr(direct_io, "cache_budget", lambda: 0)
    rates = direct_io._probe(ext4_loop, fs.device)   # the real probe on the loop device
    _save_and_check(ext4_loop / "large", _state())
    assert bool(made) == rates.direct_wins
