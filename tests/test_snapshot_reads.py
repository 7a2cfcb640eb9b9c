"""An open checkpoint reads the version it opened, whatever later saves do to the directory.

``ts.open`` keeps a descriptor of every file the manifest lists; a save commits new files and
then removes the old ones, which the held descriptors keep readable. Another process saves into
the same directory while handles opened at different moments read every tensor bit for bit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial.checkpoint import reader as reader_mod
from te_serial.errors import CheckpointFileError

VERSIONS = 20


def version_state(v: int) -> dict:
    """The state dict of version ``v`` (the writer process and the test compute the same)."""
    g = torch.Generator().manual_seed(1000 + v)
    return {"w": ts.MXFP8Quantizer()(torch.randn(128, 256, generator=g)),
            "n": ts.NVFP4Quantizer()(torch.randn(64, 128, generator=g)),
            "b": torch.randn(300, generator=g).to(torch.bfloat16)}


def _same(got, want) -> bool:
    if hasattr(want, "quantizer"):
        return all(torch.equal(got.buffers()[k].view(torch.uint8), b.view(torch.uint8))
                   for k, b in want.buffers().items())
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _check_handle(h, cache: dict) -> int:
    v = int(h.metadata["version"])
    want = cache.get(v) or cache.setdefault(v, version_state(v))
    for name in want:
        assert _same(h.get(name), want[name]), (v, name)
    return v


_WRITER = textwrap.dedent("""
    import sys, torch, te_serial as ts
    sys.path.insert(0, sys.argv[2])
    from test_snapshot_reads import version_state
    for v in range(1, int(sys.argv[3]) + 1):
        ts.save_quantized(version_state(v), sys.argv[1], metadata={"version": str(v)}, max_shard_size="40KB")
""")


def test_a_reader_keeps_its_version_while_another_process_saves_20_times(tmp_path):
    path = tmp_path / "ckpt"
    ts.save_quantized(version_state(0), path, metadata={"version": "0"}, max_shard_size="40KB")
    first = ts.open(path)
    cache: dict = {}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(Path(__file__).parent), str(VERSIONS)],
                              stderr=subprocess.PIPE)
    seen = set()
    try:
        while writer.poll() is None:
            with ts.open(path) as h:  # opened at some moment of the saves: one version, whole
                time.sleep(0.01)
                seen.add(_check_handle(h, cache))
    finally:
        _, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err.decode()[-2000:]
    assert not set(first.manifest.files) & set(os.listdir(path))  # its files are gone from the directory
    assert _check_handle(first, cache) == 0  # the first handle still reads version 0
    first.close()
    with ts.open(path) as newest:
        assert _check_handle(newest, cache) == VERSIONS
    assert len(seen) >= 2  # the reads really overlapped the saves


def test_a_save_committed_between_the_manifest_and_its_files_is_read_whole(tmp_path, monkeypatch):
    """The race open closes: the manifest read, then a save commits and removes the old files
    before they are opened. The new manifest is read instead, never a mix."""
    path = tmp_path / "ckpt"
    ts.save_quantized(version_state(0), path, metadata={"version": "0"}, max_shard_size="40KB")
    real = reader_mod.Checkpoint._hold_files
    calls = []

    def hold_after_a_save(self):
        if not calls:
            ts.save_quantized(version_state(1), path, metadata={"version": "1"}, max_shard_size="40KB")
        calls.append(1)
        return real(self)
    monkeypatch.setattr(reader_mod.Checkpoint, "_hold_files", hold_after_a_save)
    with ts.open(path) as h:
        assert _check_handle(h, {}) == 1
    assert len(calls) == 2


def test_a_missing_file_that_no_save_explains_is_still_an_error(tmp_path):
    path = tmp_path / "ckpt"
    ts.save_quantized(version_state(0), path, max_shard_size="40KB")
    next(p for p in path.iterdir() if p.suffix == ".safetensors").unlink()
    with pytest.raises(CheckpointFileError, match="missing"):
        ts.open(path)


def test_holding_a_handle_never_blocks_a_save_and_close_releases_every_descriptor(tmp_path):
    path = tmp_path / "ckpt"
    ts.save_quantized(version_state(0), path, max_shard_size="40KB")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    h = ts.open(path)
    ts.save_quantized(version_state(1), path, max_shard_size="40KB")  # while held
    h.get("w")
    h.close()
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


# --- a DCP save of 2 ranks committing while a reader holds the checkpoint ------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dcp_rank(rank: int, world: int, port: int, path: str, versions: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import te_serial.dcp as tdcp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    for v in range(1, versions + 1):
        tdcp.save(version_state(v), path)  # replicated on both ranks, as DCP saves plain tensors
    dist.destroy_process_group()


def test_a_reader_holds_its_version_while_a_two_rank_dcp_save_commits(tmp_path):
    import torch.multiprocessing as mp
    import te_serial.dcp as tdcp
    path = tmp_path / "dcp"
    tdcp.save(version_state(0), path)  # one process: version 0
    held = ts.open(path)
    want0 = version_state(0)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dcp_rank, args=(r, 2, port, str(path), 3)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert not set(held.manifest.files) & set(os.listdir(path))  # its files are gone from the directory
    for name, t in want0.items():  # the handle opened before the saves reads version 0 whole
        assert _same(held.get(name), t), name
    held.close()
    with ts.open(path) as newest:
        want3 = version_state(3)
        for name, t in want3.items():
            assert _same(newest.get(name), t), name


def test_links_are_followed_only_into_the_folder_named(tmp_path):
    """``Checkpoint(links_into=folder)``: files that are symlinks to files directly in that folder
    (a hub cache snapshot and its blobs) are read; a link anywhere else, or without the option, is refused."""
    import shutil
    src, blobs, snap = tmp_path / "src", tmp_path / "blobs", tmp_path / "snap"
    sd = {"w": ts.MXFP8Quantizer()(torch.randn(64, 64)), "b": torch.randn(8)}
    ts.save_quantized(sd, src)
    blobs.mkdir(), snap.mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        os.symlink(blobs / f"blob{i}", snap / f.name)
    with pytest.raises(ts.errors.ManifestError, match="symbolic link"):  # the manifest, the first file opened
        reader_mod.Checkpoint(snap)
    got = reader_mod.Checkpoint(snap, links_into=blobs).load_tensors()
    assert torch.equal(got["b"], sd["b"]) and torch.equal(got["w"].dequantize(), sd["w"].dequantize())
    shard = next(p for p in snap.iterdir() if p.suffix == ".safetensors")
    (blobs / "deeper").mkdir()
    shutil.copyfile(shard, blobs / "deeper" / "x")
    shard.unlink()
    os.symlink(blobs / "deeper" / "x", shard)  # not directly in the folder
    with pytest.raises(CheckpointFileError, match="except to a file in"):
        reader_mod.Checkpoint(snap, links_into=blobs)
