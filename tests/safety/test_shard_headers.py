"""Hostile safetensors headers (absurd lengths, offsets, shapes, dtypes, JSON) and headers that
disagree with the manifest are refused before any buffer is read."""

from __future__ import annotations

import pytest

from te_serial.errors import CheckpointFileError, TensorMismatchError

from .corpus import SAFETENSORS_EDITS, edit_shard_header, rename_shard_key, set_shard_entry
from .safety_helpers import B, T, Ck, expect_error


@pytest.mark.parametrize("edit", list(SAFETENSORS_EDITS))
def test_absurd_safetensors_header(ck, edit):
    path = edit_shard_header(ck, edit)
    expect_error(ck.load, CheckpointFileError, path, peak=ck.peak)


def test_safetensors_header_dtype_disagrees_with_manifest(ck):
    """A valid safetensors file whose buffer dtype is not the manifest's: refused before reading."""
    path = set_shard_entry(ck, "dtype", "U8")
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)


def test_safetensors_header_shape_disagrees_with_manifest(ck):
    path = set_shard_entry(ck, "shape", [32, 128])
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)


def test_shard_key_missing_from_file(ckpt_dir):
    ck = Ck(ckpt_dir)
    path = rename_shard_key(ck)
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)
