"""Per-buffer XXH3 checksums catch flipped data bytes and altered manifest checksums."""

from __future__ import annotations

import pytest
import torch

import te_serial
from te_serial.errors import ChecksumError
from te_serial.formats.tensors import QuantizedTensorStorage

from .corpus import FLIPPED_BUFFERS, _flip_data_byte, alter_checksum
from .safety_helpers import B, DIR_PEAK, PEAK_BUDGET, T, assert_same_state, expect_error


@pytest.mark.parametrize("tensor, buffer", FLIPPED_BUFFERS)
def test_flipped_data_byte_fails_checksum(ck, state, tensor, buffer):
    path, inside = _flip_data_byte(ck, tensor, buffer)
    expect_error(lambda: ck.load(verify=True), ChecksumError, path, tensor, buffer, peak=ck.peak)
    expect_error(lambda: te_serial.verify(ck.path), ChecksumError, path, tensor, buffer, peak=ck.peak)
    expect_error(lambda: te_serial.open(ck.path).get(tensor, verify=True), ChecksumError, path, tensor, buffer, peak=ck.peak)
    # without verification the load succeeds, and exactly that byte differs
    out = ck.load(verify=False)
    flat = te_serial.open(ck.path).get(tensor)
    want = state[tensor] if tensor in state else state["blocks"][0]["w_fp4"]
    got_b = flat.buffers()[buffer] if isinstance(flat, QuantizedTensorStorage) else flat
    want_b = want.buffers()[buffer] if isinstance(want, QuantizedTensorStorage) else want
    diff = (got_b.contiguous().view(torch.uint8).reshape(-1) != want_b.contiguous().view(torch.uint8).reshape(-1))
    assert diff.nonzero().reshape(-1).tolist() == [inside]
    assert_same_state(out["blocks"][1], state["blocks"][1])


def test_checksum_in_manifest_altered(ck):
    alter_checksum(ck)
    expect_error(lambda: te_serial.verify(ck.path), ChecksumError, ck.file_of(), T, B, peak=ck.peak)
    ck.load(verify=False)


def test_verify_without_checksums(tmp_path, state, form):
    path = tmp_path / ("ckpt" if form == "dir" else "x.safetensors")
    te_serial.save_quantized(state, path, checksums=False)
    assert_same_state(te_serial.load_quantized(path), state)
    expect_error(lambda: te_serial.load_quantized(path, verify=True), ChecksumError, "checksum", peak=DIR_PEAK if form == "dir" else PEAK_BUDGET)
    expect_error(lambda: te_serial.verify(path), ChecksumError, "checksum", peak=DIR_PEAK if form == "dir" else PEAK_BUDGET)


def test_verify_counts_buffers(ck):
    doc = ck.doc()
    n = sum(len(doc["protos"][p]["buffers"]) for p in doc["tensors"]["protos"])
    assert te_serial.verify(ck.path) == n
