"""Property-based mutation (hypothesis): every mutated manifest, shard or single file either
loads or is refused with a CheckpointError, in bounded time."""

from __future__ import annotations

import shutil
import struct
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_serial
from te_serial.errors import CheckpointError
from te_serial.checkpoint.manifest import MANIFEST_NAME

from .safety_helpers import Ck, alarm, assert_same_state


OVERWRITES = [b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 2**63), b"\xdd\xff\xff\xff\xff",
              b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x02",
              b"\x91" * 32, b"\xd4\x02\x91", b'"data_offsets":[0,99999999999]', b"[[[[[[[[", b"\xc1"]


def _mutations(size: int, hot: int):
    """1-4 edits: byte xor, truncation, insertion, deletion, overwrite with hostile bytes."""
    anywhere = st.integers(0, size - 1)
    pos = st.one_of(st.integers(0, max(1, min(hot, size)) - 1), anywhere)
    op = st.one_of(
        st.tuples(st.just("xor"), pos, st.integers(1, 255)),
        st.tuples(st.just("truncate"), anywhere, st.just(None)),
        st.tuples(st.just("insert"), pos, st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from(OVERWRITES))),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("overwrite"), pos, st.sampled_from(OVERWRITES)),
    )
    return st.lists(op, min_size=1, max_size=4)


def _apply(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, arg in ops:
        if not b:
            break
        pos = min(pos, len(b) - 1)
        if kind == "xor":
            b[pos] ^= arg
        elif kind == "truncate":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "delete":
            del b[pos:pos + arg]
        else:
            b[pos:pos + len(arg)] = arg
    return bytes(b)


def _load_or_refuse(path: Path, verify: bool):
    """Load; None on a CheckpointError. Anything else (or a hang) fails the property."""
    t0 = time.perf_counter()
    try:
        with alarm():
            return te_serial.load_quantized(path, verify=verify)
    except CheckpointError:
        return None
    finally:
        assert time.perf_counter() - t0 < 5, "took over 5 s"


HYPO = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@HYPO
@given(data=st.data(), verify=st.booleans())
def test_mutated_manifest_loads_or_refuses(golden, data, verify):
    raw = (golden / "ckpt" / MANIFEST_NAME).read_bytes()
    ops = data.draw(_mutations(len(raw), len(raw)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(shutil.copytree(golden / "ckpt", Path(tmp) / "ckpt"))
        (path / MANIFEST_NAME).write_bytes(_apply(raw, ops))
        _load_or_refuse(path, verify)


@HYPO
@given(data=st.data(), verify=st.booleans(), sync=st.booleans())
def test_mutated_shard_loads_or_refuses(golden, state, data, verify, sync):
    """sync=True fixes the manifest's size for the shard, so the damaged file is parsed.

    With verify=True a successful load must hand back exactly the saved bytes.
    """
    ck0 = Ck(golden / "ckpt")
    shard = ck0.file_of()
    raw = shard.read_bytes()
    hot = 8 + struct.unpack("<Q", raw[:8])[0]
    ops = data.draw(_mutations(len(raw), hot + 8))
    with tempfile.TemporaryDirectory() as tmp:
        ck = Ck(shutil.copytree(golden / "ckpt", Path(tmp) / "ckpt"))
        (ck.path / shard.name).write_bytes(_apply(raw, ops))
        if sync:
            ck.sync_sizes()
        out = _load_or_refuse(ck.path, verify)
        if out is not None and verify:
            assert_same_state(out, state)


@HYPO
@given(data=st.data(), verify=st.booleans())
def test_mutated_single_file_loads_or_refuses(golden, data, verify):
    raw = (golden / "one.safetensors").read_bytes()
    hot = 8 + struct.unpack("<Q", raw[:8])[0]
    ops = data.draw(_mutations(len(raw), hot + 8))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.safetensors"
        path.write_bytes(_apply(raw, ops))
        _load_or_refuse(path, verify)
