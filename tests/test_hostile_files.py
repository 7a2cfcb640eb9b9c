"""Hostile checkpoints, round two, in the one reader: shard headers, symlinks, duplicate keys,
key collisions and the manifest checksum. Each case is refused with te-serial's error class by
``load_quantized``, ``verify`` and ``convert`` alike, in bounded time and memory."""

from __future__ import annotations

import base64
import json
import os
import resource

import msgpack
import pytest
import torch

import te_serial as ts
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME, seal
from te_serial.checkpoint.tree import unpack
from te_serial.errors import CheckpointFileError, ManifestError

READERS = {
    "load": lambda p, tmp: ts.load_quantized(p),
    "verify": lambda p, tmp: ts.verify(p),
    "convert": lambda p, tmp: ts.convert(p, tmp / "converted"),
}


def _state():
    return {"w": ts.MXFP8Quantizer()(torch.randn(64, 64)), "b": torch.arange(8, dtype=torch.float32)}


def _split(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8:8 + n], raw[8 + n:]


def _write(path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def _fix_sizes(ckpt) -> None:
    """Re-record every shard's size (and re-seal) so a header edit reaches the header validator."""
    doc = unpack((ckpt / MANIFEST_NAME).read_bytes())
    for f in doc["files"]:
        f["size"] = (ckpt / f["name"]).stat().st_size
    (ckpt / MANIFEST_NAME).write_bytes(seal(doc))


def _edit_shard_header(ckpt, edit_text) -> None:
    shard = next(ckpt.glob("*.safetensors"))
    header, data = _split(shard)
    _write(shard, edit_text(header.decode().rstrip()).encode(), data)
    _fix_sizes(ckpt)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ck"
    ts.save_quantized(_state(), path)
    return path


def _refused(reader, path, tmp_path, exc, needle=None):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(exc, match=needle) as info:
        READERS[reader](path, tmp_path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: no bomb
    assert str(path) in str(info.value) or str(path.parent) in str(info.value)
    return info.value


def _replace_entry(field, value):
    """A header edit: ``field`` of the first tensor entry set to ``value``."""
    def edit(text):
        header = json.loads(text)
        key = next(k for k in header if k != "__metadata__")
        header[key][field] = value
        return json.dumps(header)
    return edit


SHAPES = {"str_times_huge": ["x", 1_200_000_000], "nested_list": [[0], 2 ** 40], "str_and_2_62": [1, "0", 2 ** 62],
          "bool": [True, 64], "float": [8.0], "negative": [-1, -8], "too_many_dims": [1] * 65}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shard_header_shapes_that_are_not_lists_of_ints(ckpt, tmp_path, reader, shape):
    _edit_shard_header(ckpt, _replace_entry("shape", SHAPES[shape]))
    _refused(reader, ckpt, tmp_path, CheckpointFileError)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("offsets", [[0.0, 32.0], [False, True], [0, "32"], [0], [0, 2 ** 70], None],
                         ids=["float", "bool", "str", "one", "huge", "null"])
def test_shard_header_offsets_of_the_wrong_type(ckpt, tmp_path, reader, offsets):
    _edit_shard_header(ckpt, _replace_entry("data_offsets", offsets))
    _refused(reader, ckpt, tmp_path, CheckpointFileError)


@pytest.mark.parametrize("reader", READERS)
def test_duplicate_keys_in_a_shard_header(ckpt, tmp_path, reader):
    def edit(text):
        # the same key twice; json.loads alone would silently keep the last one
        key, entry = next((k, v) for k, v in json.loads(text).items() if k != "__metadata__")
        return text[:-1] + "," + json.dumps(key) + ":" + json.dumps(entry) + "}"
    _edit_shard_header(ckpt, edit)
    _refused(reader, ckpt, tmp_path, CheckpointFileError, "duplicate key")


@pytest.mark.parametrize("reader", READERS)
def test_overlapping_entries_without_checksums_are_refused_by_every_reader(tmp_path, reader):
    """The disagreement the I/O core issue names: convert used to accept this."""
    path = tmp_path / "ck"
    ts.save_quantized({"a": torch.ones(8), "b": torch.zeros(8)}, path, checksums=False)

    def edit(text):
        header = json.loads(text)
        header["b"]["data_offsets"] = header["a"]["data_offsets"]
        return json.dumps(header)
    _edit_shard_header(path, edit)
    _refused(reader, path, tmp_path, CheckpointFileError, "overlaps")


@pytest.mark.parametrize("reader", READERS)
def test_a_shard_symlinked_outside_the_checkpoint_is_refused(ckpt, tmp_path, reader):
    shard = next(ckpt.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    os.symlink(outside, shard)
    _refused(reader, ckpt, tmp_path, CheckpointFileError, "symbolic link")


@pytest.mark.parametrize("reader", READERS)
def test_a_symlinked_manifest_is_refused(ckpt, tmp_path, reader):
    outside = tmp_path / "elsewhere.msgpack"
    (ckpt / MANIFEST_NAME).rename(outside)
    os.symlink(outside, ckpt / MANIFEST_NAME)
    _refused(reader, ckpt, tmp_path, ManifestError, "symbolic link")


def test_a_single_file_named_through_a_symlink_is_the_callers_choice(tmp_path):
    real = tmp_path / "real.safetensors"
    ts.save_quantized(_state(), real)
    link = tmp_path / "link.safetensors"
    os.symlink(real, link)
    assert list(ts.load_quantized(link)) == ["w", "b"]


def _flip_manifest_field(doc_edit, path):
    """Change the manifest without re-sealing it, as a flipped byte would."""
    data = (path / MANIFEST_NAME).read_bytes()
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    doc_edit(doc)
    (path / MANIFEST_NAME).write_bytes(msgpack.packb(doc, use_bin_type=True))


@pytest.mark.parametrize("reader", READERS)
def test_a_flipped_manifest_byte_is_caught_by_its_checksum(tmp_path, reader):
    path = tmp_path / "ck"
    ts.save_quantized({"w": ts.Float8BlockQuantizer(amax_epsilon=0.5)(torch.randn(128, 128))}, path)
    data = bytearray((path / MANIFEST_NAME).read_bytes())
    i = data.index(msgpack.packb(0.5)) + 3  # a byte of amax_epsilon's float64
    data[i] ^= 0x01
    (path / MANIFEST_NAME).write_bytes(bytes(data))
    _refused(reader, path, tmp_path, ManifestError, "checksum")


def test_a_single_files_manifest_checksum_is_checked(tmp_path):
    path = tmp_path / "w.safetensors"
    ts.save_quantized({"w": ts.Float8BlockQuantizer(amax_epsilon=0.5)(torch.randn(128, 128))}, path)
    header, data = _split(path)
    meta = json.loads(header)
    raw = bytearray(base64.b64decode(meta["__metadata__"][HEADER_KEY]))
    raw[raw.index(msgpack.packb(0.5)) + 3] ^= 0x01
    meta["__metadata__"][HEADER_KEY] = base64.b64encode(bytes(raw)).decode()
    _write(path, json.dumps(meta).encode(), data)
    with pytest.raises(ManifestError, match="checksum"):
        ts.load_quantized(path)


def test_a_stripped_checksum_on_a_1_1_manifest_is_refused(ckpt):
    _flip_manifest_field(lambda d: d.pop("manifest_checksum"), ckpt)
    with pytest.raises(ManifestError, match="must end with its manifest_checksum"):
        ts.load_quantized(ckpt)


def test_a_1_0_manifest_without_checksum_still_reads(ckpt):
    def to_1_0(d):
        d.pop("manifest_checksum")
        d["version"] = [1, 0]
    _flip_manifest_field(to_1_0, ckpt)
    assert list(ts.load_quantized(ckpt, verify=True)) == ["w", "b"]


@pytest.mark.parametrize("reader", READERS)
def test_a_plain_tensor_named_like_another_tensors_buffer_is_refused(tmp_path, reader):
    path = tmp_path / "ck"
    w = ts.Float8CurrentScalingQuantizer(columnwise=False)(torch.randn(4, 4))
    ts.save_quantized({"w": w, "w_data": torch.zeros(4, 4, dtype=torch.uint8)}, path)

    def rename(doc):
        names = doc["tensors"]["names"]
        names[names.index("w_data")] = "w._data"
    doc = unpack((path / MANIFEST_NAME).read_bytes())
    rename(doc)
    (path / MANIFEST_NAME).write_bytes(seal(doc))
    _refused(reader, path, tmp_path, ManifestError, "same safetensors key")


def test_the_writer_refuses_a_key_collision_and_the_metadata_key(tmp_path):
    w = ts.Float8CurrentScalingQuantizer(columnwise=False)(torch.randn(4, 4))
    with pytest.raises(ts.CheckpointError, match="same safetensors key"):
        ts.save_quantized({"w": w, "w._data": torch.zeros(4, 4, dtype=torch.uint8)}, tmp_path / "a")
    with pytest.raises(ts.CheckpointError, match="__metadata__"):
        ts.save_quantized({"__metadata__": torch.zeros(2)}, tmp_path / "b")
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
