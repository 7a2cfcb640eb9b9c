"""Files that are missing, truncated, of the wrong kind (directory, FIFO, torch.save zip) where a
manifest or shard should be."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import te_serial
from te_serial.errors import CheckpointFileError, ManifestError
from te_serial.checkpoint.manifest import MANIFEST_NAME

from .corpus import (TRUNCATIONS, manifest_is_a_directory, manifest_is_a_fifo, missing_shard,
                     shard_is_a_directory, shard_is_a_fifo, shard_replaced_by_torch_save, truncate_file,
                     truncate_shard)
from .safety_helpers import DIR_PEAK, PEAK_BUDGET, Ck, bounded, expect_error


def test_directory_open_allocates_little(ckpt_dir):
    with bounded(peak=PEAK_BUDGET):
        assert te_serial.open(ckpt_dir).keys()


def test_missing_shard_file(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = missing_shard(ck)
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)
    expect_error(lambda: te_serial.open(ck.path), CheckpointFileError, shard, peak=ck.peak)


def test_missing_manifest_and_missing_path(ckpt_dir, tmp_path):
    (ckpt_dir / MANIFEST_NAME).unlink()
    expect_error(lambda: te_serial.load_quantized(ckpt_dir), ManifestError, ckpt_dir, peak=DIR_PEAK)
    gone = tmp_path / "nothing-here.safetensors"
    expect_error(lambda: te_serial.load_quantized(gone), CheckpointFileError, gone)


def test_manifest_is_a_directory(ckpt_dir):
    manifest_is_a_directory(Ck(ckpt_dir))
    expect_error(lambda: te_serial.load_quantized(ckpt_dir), ManifestError, MANIFEST_NAME, peak=DIR_PEAK)


FIFO_UNBLOCKER = textwrap.dedent("""
    import os, sys, time
    time.sleep(float(sys.argv[2]))
    while True:
        try:
            os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
            print("unblocked", flush=True)
        except OSError:  # no reader (yet)
            pass
        time.sleep(0.05)
""")


@contextlib.contextmanager
def fifo_watchdog(fifo: Path, after: float = 1.0):
    """Fails if the body blocks on ``fifo``. A helper process opens the FIFO's writing end after
    ``after`` s, so the test never hangs, even in native code that holds the GIL and retries
    open() on EINTR (where neither SIGALRM nor a thread can help)."""
    helper = subprocess.Popen([sys.executable, "-S", "-c", FIFO_UNBLOCKER, str(fifo), str(after)],
                              stdout=subprocess.PIPE)
    try:
        yield
    finally:
        helper.kill()
        out = helper.communicate()[0]
    assert b"unblocked" not in out, f"blocked for over {after} s opening the FIFO {fifo}"


def test_manifest_is_a_fifo(ckpt_dir):
    fifo = manifest_is_a_fifo(Ck(ckpt_dir))
    with fifo_watchdog(fifo):
        expect_error(lambda: te_serial.load_quantized(ckpt_dir), ManifestError, MANIFEST_NAME, peak=DIR_PEAK)


def test_shard_is_a_directory(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = shard_is_a_directory(ck)
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


def test_shard_is_a_fifo(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = shard_is_a_fifo(ck)
    with fifo_watchdog(shard):
        expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


def test_single_file_path_is_a_fifo(tmp_path):
    p = tmp_path / "fifo.safetensors"
    os.mkfifo(p)
    expect_error(lambda: te_serial.load_quantized(p), CheckpointFileError, p)


@pytest.mark.parametrize("sync", [False, True], ids=["size-as-saved", "size-synced"])
@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated_shard(ckpt_dir, where, sync):
    """sync=True also fixes the manifest's file size, so the truncated file itself is parsed."""
    ck = Ck(ckpt_dir)
    shard = truncate_shard(ck, where, sync)
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated_single_file(ckpt_file, where):
    truncate_file(ckpt_file, where)
    expect_error(lambda: te_serial.load_quantized(ckpt_file), CheckpointFileError, ckpt_file)
    expect_error(lambda: te_serial.open(ckpt_file), CheckpointFileError, ckpt_file)


def test_shard_replaced_by_other_format(ckpt_dir, tmp_path):
    """A torch.save (zip + pickle) file where a shard should be: refused, never unpickled."""
    ck = Ck(ckpt_dir)
    path = shard_replaced_by_torch_save(ck)
    expect_error(ck.load, CheckpointFileError, path, peak=ck.peak)
