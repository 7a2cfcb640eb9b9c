"""Manifest bytes that are not a valid manifest: truncation, trailing bytes, byte flips, broken
base64 in a single file, hostile msgpack (absurd lengths, deep nesting, unknown extensions)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import te_serial
from te_serial.errors import CheckpointError, ManifestError

from .corpus import (ABSURD, CUTS, HOSTILE_MSGPACK_PLACES, NOT_A_MAP, NOT_BASE64, drop_single_file_manifest,
                     hostile_msgpack, nested_tuples_in_tree, set_single_file_manifest, timestamp_in_tree,
                     truncate_manifest)
from .safety_helpers import Ck, _env, assert_same_state, bounded, expect_error


@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_truncated_manifest(ck, cut):
    truncate_manifest(ck, cut)
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


def test_manifest_with_trailing_bytes(ck):
    ck.write_raw(ck.raw() + b"\xc0")
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


@pytest.mark.parametrize("data", list(NOT_A_MAP.values()), ids=list(NOT_A_MAP))
def test_manifest_not_a_map(ck, data):
    ck.write_raw(data)
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


def test_manifest_random_byte_flips(ck, state):
    """Single-byte flips at 60 spread-out places: each loads or is refused with a CheckpointError."""
    raw = ck.raw()
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, len(raw), (60,), generator=g).tolist()
    values = torch.randint(1, 256, (60,), generator=g).tolist()
    for pos, xor in zip(positions, values):
        bad = bytearray(raw)
        bad[pos] ^= xor
        ck.write_raw(bytes(bad))
        with bounded(peak=ck.peak):
            try:
                ck.load(verify=True)
            except CheckpointError as e:
                assert ck.source in str(e) or str(ck.path) in str(e), str(e)
    ck.write_raw(raw)
    assert_same_state(ck.load(), state)


def test_single_file_header_without_manifest(ckpt_file):
    drop_single_file_manifest(ckpt_file)
    expect_error(lambda: te_serial.load_quantized(ckpt_file), ManifestError, ckpt_file)


@pytest.mark.parametrize("value", NOT_BASE64)
def test_single_file_manifest_not_base64(ckpt_file, value):
    set_single_file_manifest(ckpt_file, value)
    expect_error(lambda: te_serial.load_quantized(ckpt_file), ManifestError, ckpt_file)


@pytest.mark.parametrize("where", HOSTILE_MSGPACK_PLACES)
@pytest.mark.parametrize("kind", list(ABSURD))
def test_hostile_msgpack(ck, kind, where):
    hostile_msgpack(ck, kind, where)
    err = expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)
    assert "Traceback" not in str(err)


def test_timestamp_extension_in_tree_is_refused(ck):
    timestamp_in_tree(ck)
    expect_error(ck.load, ManifestError, ck.source, "tree", peak=ck.peak)


SUBPROCESS_LOAD = textwrap.dedent("""
    import sys, te_serial
    try:
        te_serial.load_quantized(sys.argv[1])
    except te_serial.errors.ManifestError as e:
        print("ManifestError", e)
        sys.exit(0)
    print("loaded")
    sys.exit(1)
""")


def test_deeply_nested_tuple_extensions_do_not_crash(ckpt_dir):
    """Run in a child process: the failure mode is a crash (SIGSEGV), not an exception."""
    ck = Ck(ckpt_dir)
    nested_tuples_in_tree(ck, 100_000)
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS_LOAD, str(ckpt_dir)], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"
    assert ck.source in proc.stdout


def test_moderately_nested_tuple_extensions_in_tree(ck):
    """100 nested tuples still unpack (no crash); the tree's depth check then refuses them."""
    nested_tuples_in_tree(ck, 100)
    expect_error(ck.load, ManifestError, ck.source, "tree", peak=ck.peak)
