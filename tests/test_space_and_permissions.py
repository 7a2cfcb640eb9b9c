"""Full disks, quotas, read-only and permission-denied targets: te-serial's own error, naming the
file, the OS error chained; nothing of the new save left; the previous checkpoint loads and
verifies.

Each case runs on a real small file system where this process may mount one (a 2 MiB tmpfs;
read-only by remounting it), and always on a simulated one: ``os.statvfs`` reporting little
free space, and writes that fail with ENOSPC (or EDQUOT, EACCES, EROFS) at a chosen byte.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import te_serial as ts
from te_serial.checkpoint import fileops
from te_serial.errors import CheckpointFileError, CheckpointWriteError, TeSerialError

MIB = 1 << 20


def _state(mib: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * MIB) // 4
    return {"big": torch.randn(n, generator=g), "w": ts.MXFP8Quantizer()(torch.randn(64, 128, generator=g))}


def _same(a: dict, b: dict) -> bool:
    for k, v in b.items():
        x = a[k]
        if hasattr(v, "quantizer"):
            if any(not torch.equal(x.buffers()[n].view(torch.uint8), t.view(torch.uint8)) for n, t in v.buffers().items()):
                return False
        elif not torch.equal(x, v):
            return False
    return True


def _assert_old_intact(path: Path, old: dict, before: set[str]) -> None:
    assert set(os.listdir(path)) == before  # nothing of the failed save is left
    assert _same(ts.load_quantized(path, verify=True), old)
    assert ts.verify(path) > 0


# --- the simulated file system --------------------------------------------------------------------

class _Statvfs:
    def __init__(self, free: int) -> None:
        self.f_bavail, self.f_frsize = free // 4096, 4096


@pytest.fixture
def old_checkpoint(tmp_path):
    old = _state(0.5, seed=1)
    path = tmp_path / "ckpt"
    ts.save_quantized(old, path)
    return path, old, set(os.listdir(path))


def test_the_free_space_check_refuses_before_any_byte(old_checkpoint, monkeypatch):
    path, old, before = old_checkpoint
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(3 * MIB))
    writes = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: writes.append(p) or real_open(p, *a, **k))
    with pytest.raises(CheckpointWriteError) as e:
        ts.save_quantized(_state(8), path)
    msg = str(e.value)
    assert "not enough space" in msg and str(path) in msg and f"{3 * MIB:,}" in msg
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert not [w for w in writes if fileops.TMP_PREFIX in str(w)]  # not a byte written
    monkeypatch.undo()
    _assert_old_intact(path, old, before)


def test_the_check_can_be_skipped(old_checkpoint, monkeypatch):
    path, old, _ = old_checkpoint
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(0))
    monkeypatch.setenv(fileops.SPACE_CHECK_ENV, "0")
    new = _state(1, seed=2)
    ts.save_quantized(new, path)
    monkeypatch.undo()
    assert _same(ts.load_quantized(path), new)


def _fail_writes_after(monkeypatch, budget: int, code: int) -> None:
    """os.pwrite / os.write fail with ``code`` once ``budget`` bytes have been written."""
    left = [budget]
    for name in ("pwrite", "write"):
        real = getattr(os, name)

        def fake(fd, data, *a, _real=real):
            n = len(memoryview(data))
            if n > left[0]:
                raise OSError(code, os.strerror(code))
            left[0] -= n
            return _real(fd, data, *a)
        monkeypatch.setattr(os, name, fake)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS])
@pytest.mark.parametrize("at", [0, 300_000, 2 * MIB])
def test_a_write_that_fails_midway(old_checkpoint, monkeypatch, code, at):
    path, old, before = old_checkpoint
    monkeypatch.setenv("TE_SERIAL_DIRECT_IO", "0")
    _fail_writes_after(monkeypatch, at, code)
    with pytest.raises(CheckpointWriteError) as e:
        ts.save_quantized(_state(3, seed=3), path, max_shard_size="1MB")
    monkeypatch.undo()
    assert e.value.errno == code and isinstance(e.value.__cause__, OSError)
    assert e.value.file and Path(e.value.file).parent == path  # names the file being written
    _assert_old_intact(path, old, before)


def test_convert_and_dcp_save_on_a_full_file_system(tmp_path, monkeypatch):
    import te_serial.dcp as tdcp
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(256, 512).to(torch.bfloat16)},
              str(src / "model.safetensors"))
    out, dcp_dir = tmp_path / "out", tmp_path / "dcp"
    ts.convert(src, out, recipe="mxfp8")
    old_dcp = _state(0.5, seed=4)
    tdcp.save(old_dcp, dcp_dir)
    conv_before, dcp_before = set(os.listdir(out)), set(os.listdir(dcp_dir))
    conv_old = ts.load_quantized(out)
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(64 << 10))
    with pytest.raises(CheckpointWriteError, match="not enough space"):
        ts.convert(src, out, recipe="nvfp4", overwrite=True)
    with pytest.raises(TeSerialError, match="not enough space"):
        tdcp.save(_state(2, seed=5), dcp_dir)
    monkeypatch.undo()
    _assert_old_intact(out, conv_old, conv_before)
    assert set(os.listdir(dcp_dir)) == dcp_before and _same(ts.load_quantized(dcp_dir, verify=True), old_dcp)
    # and ENOSPC in the middle of each
    monkeypatch.setenv("TE_SERIAL_DIRECT_IO", "0")
    _fail_writes_after(monkeypatch, 100_000, errno.ENOSPC)
    with pytest.raises(CheckpointWriteError):
        ts.convert(src, out, recipe="nvfp4", overwrite=True)
    with pytest.raises(TeSerialError):
        tdcp.save(_state(2, seed=5), dcp_dir)
    monkeypatch.undo()
    _assert_old_intact(out, conv_old, conv_before)
    assert set(os.listdir(dcp_dir)) == dcp_before and _same(ts.load_quantized(dcp_dir, verify=True), old_dcp)


def test_permission_denied_on_open_and_read(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    ts.save_quantized(_state(0.1), path)
    real = os.open

    def denied(p, flags, *a, **k):
        if str(p).endswith(".safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real(p, flags, *a, **k)
    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CheckpointFileError, match="Permission denied") as e:
        ts.load_quantized(path)
    assert isinstance(e.value.__cause__, PermissionError) and ".safetensors" in e.value.file
    with pytest.raises(CheckpointWriteError, match="permission denied"):
        ts.save_quantized(_state(0.1), tmp_path / "other")


# --- a real small file system, where this process may mount one ------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here (the simulated cases above still run): {e}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_real_full_file_system(small_fs, monkeypatch):
    path = small_fs / "ckpt"
    old = _state(0.5, seed=6)
    ts.save_quantized(old, path)
    before = set(os.listdir(path))
    with pytest.raises(CheckpointWriteError, match="not enough space"):  # found before a byte
        ts.save_quantized(_state(1.5, seed=7), path)
    _assert_old_intact(path, old, before)
    monkeypatch.setenv(fileops.SPACE_CHECK_ENV, "0")  # past the check: the kernel's ENOSPC midway
    with pytest.raises(CheckpointWriteError) as e:
        ts.save_quantized(_state(1.5, seed=7), path)
    assert e.value.errno == errno.ENOSPC
    _assert_old_intact(path, old, before)


def test_a_real_read_only_file_system(small_fs):
    path = small_fs / "ckpt"
    old = _state(0.2, seed=8)
    ts.save_quantized(old, path)
    before = set(os.listdir(path))
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, timeout=30)
    if r.returncode:
        pytest.skip(f"cannot remount read-only: {r.stderr.decode()}")
    with pytest.raises(CheckpointWriteError) as e:
        ts.save_quantized(_state(0.2, seed=9), path)
    assert e.value.errno == errno.EROFS and "read-only" in str(e.value)
    _assert_old_intact(path, old, before)  # and it still reads
