"""When a save writes direct (``te_serial.checkpoint.direct_io``): the rule, on real file systems.

Buffered unless the checkpoint outgrows the page cache it can count on, on a file system that is
not memory-backed and whose direct writes keep up (a probe, once per file system); the
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


class _Probe:
    def __init__(self, verdict: bool) -> None:
        self.verdict, self.calls = verdict, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.verdict


@pytest.mark.parametrize("fs, total, verdict, want, probed", [
    (DISK, GIB, True, False, 0),          # fits in the page cache: buffered, no probe
    (DISK, 8 * GIB, True, True, 1),       # outgrows it: the probe decides
    (DISK, 8 * GIB, False, False, 1),
    (TMPFS, 8 * GIB, True, False, 0),     # memory-backed: nothing to bypass
    (NO_DIRECT, 8 * GIB, True, False, 0),
])
def test_the_rule(fs, total, verdict, want, probed):
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
    monkeypatch.setattr(direct_io, "_direct_wins", lambda d: calls.append(d) or True)
    _save_and_check(tmp_path / "a", _state())
    _save_and_check(tmp_path / "b", _state())
    memory = fs.fstype in direct_io.MEMORY_FILE_SYSTEMS
    assert len(calls) == (0 if memory or not fs.direct else 1)  # probed once, then remembered
    assert bool(made) == (fs.direct and not memory)
    monkeypatch.setattr(direct_io, "_probes", {})
    monkeypatch.setattr(direct_io, "_direct_wins", lambda d: False)
    made.clear()
    _save_and_check(tmp_path / "c", _state())
    assert made == []


def test_the_probe_measures_both_ways_and_leaves_nothing(tmp_path):
    verdict = direct_io._direct_wins(tmp_path)
    assert isinstance(verdict, bool)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_tmpfs_is_written_buffered_however_large(monkeypatch):
    work = Path("/dev/shm") / f"te-serial-test-{os.getpid()}"
    work.mkdir()
    try:
        fs = direct_io.file_system(work)
        assert fs.fstype == "tmpfs"
        monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
        monkeypatch.setattr(direct_io, "cache_budget", lambda: 0)
        monkeypatch.setattr(direct_io, "_direct_wins", lambda d: pytest.fail("probed a tmpfs"))
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
    verdict = direct_io._probe(ext4_loop, fs.device)   # the real probe on the loop device
    _save_and_check(ext4_loop / "large", _state())
    assert bool(made) == verdict
