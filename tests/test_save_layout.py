"""The one writer's file layout and commit: shard limits, streaming memory, kill windows, leftovers."""

from __future__ import annotations

import multiprocessing
import os
import re
import threading

import pytest
import torch
from safetensors import safe_open

import te_serial as ts
from te_serial import errors as tse
from te_serial.checkpoint import writer as writer_mod
from te_serial.checkpoint.files import SafetensorsFile
from te_serial.checkpoint.writer import SHARD_NAME
from helpers import assert_same_tensor


def _shards(path):
    return sorted(p.name for p in path.iterdir() if p.suffix == ".safetensors")


def _data_bytes(path):
    with SafetensorsFile(path) as f:
        return sum(e.nbytes for e in f.entries.values())


def test_max_shard_size_is_kept_buffer_by_buffer(tmp_path):
    """Three tensors of 14,336 bytes in all, limit 8,192: no shard holds more than the limit."""
    sd = {f"t{i}": torch.zeros(1194, dtype=torch.float32) for i in range(3)}  # 4,776 bytes each
    sd["t2"] = torch.zeros(1196, dtype=torch.float32)  # 14,336 in all
    ts.save_quantized(sd, tmp_path / "c", max_shard_size=8192)
    shards = _shards(tmp_path / "c")
    assert len(shards) == 3
    assert all(_data_bytes(tmp_path / "c" / s) <= 8192 for s in shards)


def test_oversized_buffer_stands_alone_and_units_are_decimal(tmp_path):
    sd = {"small": torch.zeros(10, dtype=torch.uint8), "big": torch.zeros(2000, dtype=torch.uint8),
          "tail": torch.zeros(10, dtype=torch.uint8)}
    ts.save_quantized(sd, tmp_path / "c", max_shard_size="1KB")  # 1,000 bytes, not 1,024
    sizes = [_data_bytes(tmp_path / "c" / s) for s in _shards(tmp_path / "c")]
    assert sizes == [10, 2000, 10]
    assert writer_mod.parse_size("1KB") == 1000 and writer_mod.parse_size("1KiB") == 1024


def test_a_quantized_tensors_buffers_may_span_shards(tmp_path):
    t = ts.MXFP8Quantizer()(torch.randn(128, 128))
    ts.save_quantized({"w": t}, tmp_path / "c", max_shard_size=20_000)
    files = ts.open(tmp_path / "c").manifest.tensors["w"].buffers
    assert len({b.file for b in files.values()}) > 1
    assert_same_tensor(ts.load_quantized(tmp_path / "c", verify=True)["w"], t)


def test_buffers_are_aligned_and_readable_by_safetensors(tmp_path):
    t = ts.Float8BlockQuantizer(block_scaling_dim=1)(torch.randn(200, 300))
    path = tmp_path / "one.safetensors"
    ts.save_quantized({"w": t, "b": torch.arange(5, dtype=torch.int64)}, path)
    with SafetensorsFile(path) as f:
        assert all((f.header.data_start + e.start) % e.dtype.itemsize == 0 for e in f.entries.values())
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("b"), torch.arange(5))
        assert torch.equal(f.get_tensor("w._rowwise_scale_inv"), t._rowwise_scale_inv)


def _child(target, *args):
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(60)
    return p.exitcode


def _save_killed_before_commit(path):
    writer_mod.atomic_write = lambda *a, **k: os._exit(137)  # dies where the manifest would be renamed
    ts.save_quantized({"new": torch.ones(1000)}, path, max_shard_size=1000)


def _save_killed_during_cleanup(path):
    real = os.unlink
    dying = threading.Lock()  # the cleanup removes files in parallel: the others wait here, then die with it

    def dying_unlink(p, *a, **k):
        if SHARD_NAME.fullmatch(os.path.basename(p)):
            with dying:
                real(p, *a, **k)
                os._exit(137)  # one old shard removed, the rest left behind
        return real(p, *a, **k)
    os.unlink = dying_unlink
    ts.save_quantized({"newer": torch.ones(2000)}, path, max_shard_size=1000)


def test_a_save_killed_before_its_commit_leaves_shards_the_next_save_removes(tmp_path):
    path = tmp_path / "c"
    ts.save_quantized({"old": torch.zeros(3000)}, path, max_shard_size=1000)
    old = set(_shards(path))
    assert _child(_save_killed_before_commit, path) == 137
    orphans = set(_shards(path)) - old
    assert orphans and all(SHARD_NAME.fullmatch(n) for n in orphans)  # renamed, never committed
    assert torch.equal(ts.load_quantized(path)["old"], torch.zeros(3000))
    (path / "notes.txt").write_text("mine")  # not te-serial's naming: never touched
    (path / "model-00001-of-00002.safetensors").write_bytes(b"x")  # Hugging Face naming: not ours
    ts.save_quantized({"next": torch.ones(5)}, path)
    files = sorted(p.name for p in path.iterdir())
    manifest_files = set(ts.open(path).manifest.files)
    assert set(files) == manifest_files | {"te_serial.msgpack", "notes.txt", "model-00001-of-00002.safetensors"}


def test_a_save_killed_during_cleanup_leaves_old_shards_the_next_save_removes(tmp_path):
    path = tmp_path / "c"
    ts.save_quantized({f"old{i}": torch.zeros(300) for i in range(4)}, path, max_shard_size=1000)
    assert len(_shards(path)) == 4
    assert _child(_save_killed_during_cleanup, path) == 137
    assert list(ts.load_quantized(path)) == ["newer"]  # committed before the cleanup
    committed = set(ts.open(path).manifest.files)
    assert set(_shards(path)) - committed  # old shards still there
    ts.save_quantized({"last": torch.ones(1)}, path)
    assert set(_shards(path)) == set(ts.open(path).manifest.files)
    assert not [p for p in path.iterdir() if p.name.startswith(".te_serial-tmp-")]


def test_a_failed_single_file_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "w.safetensors"
    ts.save_quantized({"old": torch.zeros(4)}, path)
    before = path.read_bytes()
    with pytest.raises(tse.UnsupportedValueError):
        ts.save_quantized({"a": torch.ones(4), "b": object()}, path)
    assert path.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".te_serial-tmp-")]


def test_shard_names_follow_one_pattern(tmp_path):
    ts.save_quantized({"a": torch.ones(300), "b": torch.ones(300)}, tmp_path / "c", max_shard_size=1000)
    names = _shards(tmp_path / "c")
    ids = {re.fullmatch(r"model-([0-9a-f]{8})-\d{5}-of-(\d{5})\.safetensors", n).groups() for n in names}
    assert len(ids) == 1 and int(next(iter(ids))[1]) == len(names) == 2
