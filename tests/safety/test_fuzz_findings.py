"""Regression tests for what the fuzzer (``test_fuzz.py``) and the sandboxed corpus
(``test_corpus_sandboxed.py``) found: each a small hand-made checkpoint that reproduces one
finding, run through the sandbox (3.5 GiB address space, time limit), so a memory bomb fails the
test instead of the test process. Each must be refused with the named CheckpointError subclass
(whose message names the file); until the reader is fixed, these fail.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import msgpack
import pytest

from te_serial.errors import CheckpointError, CheckpointFileError, ManifestError

from .corpus import _with_raw_field
from .safety_helpers import B, P, T, Ck, _pbuf, _proto, key_of, read_st, st_bytes
from .sandbox import Call

pytestmark = pytest.mark.sandbox


def _copy(golden: Path, tmp_path: Path, form: str) -> Ck:
    if form == "dir":
        return Ck(shutil.copytree(golden / "ckpt", tmp_path / "ckpt"))
    return Ck(shutil.copy(golden / "one.safetensors", tmp_path / "one.safetensors"))


def _refused(sandbox, ck: Ck, exc: type[CheckpointError], names: Path) -> None:
    """``load_quantized(ck.path)`` in the sandbox raises ``exc`` naming the file ``names``."""
    [out] = sandbox.run([Call("load", [str(ck.path)], {"verify": True})])
    assert out.problem() is None, out.problem()
    assert out.status == "raised", f"loaded: must be refused with {exc.__name__}"
    assert exc.__name__ in out.mro, f"want {exc.__name__}, got {out.describe()}"
    assert str(names) in out.message, f"{names} is not named: {out.message}"


# --- fuzz: manifest target, file target ---------------------------------------------------------
#: msgpack's timestamp extension (type -1) with seconds far outside datetime's range:
#: msgpack raises OverflowError while unpacking (timestamp=3 asks for datetime objects)
HUGE_TIMESTAMPS = {
    "ts96-seconds-2^62": b"\xc7\x0c\xff" + struct.pack(">Iq", 0, 2**62),
    "ts96-seconds--2^62": b"\xc7\x0c\xff" + struct.pack(">Iq", 0, -(2**62)),
    "ts96-seconds-max": b"\xc7\x0c\xff" + struct.pack(">Iq", 0, 2**63 - 1),
}


@pytest.mark.parametrize("where", ["tree", "producer", "future_field"])
@pytest.mark.parametrize("ts", list(HUGE_TIMESTAMPS))
@pytest.mark.parametrize("form", ["dir", "file"])
def test_msgpack_timestamp_with_huge_seconds(golden, tmp_path, sandbox, form, ts, where):
    """Found by fuzzing (manifest and file targets): OverflowError ("days=...; too large to
    convert to C int") from msgpack, anywhere in the manifest."""
    ck = _copy(golden, tmp_path, form)
    ck.write_raw(_with_raw_field(ck.doc(), where, HUGE_TIMESTAMPS[ts]))
    _refused(sandbox, ck, ManifestError, ck.source)


# --- fuzz: header target ------------------------------------------------------------------------
#: shard-header shapes that are not lists of non-negative ints: ``math.prod`` repeats a string
#: 1.2e9 times (1.1 GB), builds a list of 2^40 elements (MemoryError), or overflows
BAD_SHAPES = {
    "str-times-1.2e9": ["x", 1200000000],
    "list-times-2^40": [[0], 2**40],
    "str-int-overflow": [1, "0", 2**62],
    "float": [64.0, 64.0],
    "bool": [True, 64],
    "null": None,
    "string": "64",
}


@pytest.mark.parametrize("shape", list(BAD_SHAPES))
@pytest.mark.parametrize("entry", [(T, B), (P, "data")], ids=["F8-entry", "F32-entry"])
@pytest.mark.parametrize("form", ["dir", "file"])
def test_shard_header_shape_not_a_list_of_ints(golden, tmp_path, sandbox, form, entry, shape):
    """Found by fuzzing (header target): MemoryError from ``math.prod(info["shape"])`` in
    ``read_safetensors_header`` (issue 14, class 4); a 4-byte dtype turns the 1.2 GB string into
    4.8 GB; float shapes are accepted."""
    ck = _copy(golden, tmp_path, form)
    path = ck.file_of(*entry)
    header, data = read_st(path)
    header[key_of(*entry)]["shape"] = BAD_SHAPES[shape]
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    _refused(sandbox, ck, CheckpointFileError, path)


# --- sandboxed corpus: load_quantized(device="meta") --------------------------------------------
@pytest.mark.parametrize("tensor", ["plain", "quantized"])
@pytest.mark.parametrize("form", ["dir", "file"])
def test_meta_load_of_absurd_manifest_shape(golden, tmp_path, sandbox, form, tensor):
    """Found by the sandboxed corpus (cases ``manifest-*-shape-absurd-vs-file``): with
    ``device="meta"`` no file is read, and ``torch.empty`` of the manifest's shape leaks
    RuntimeError ("Storage size calculation overflowed"). Now the manifest itself is refused:
    a buffer may not need more bytes than the checkpoint's files hold."""
    from .corpus import _recompute_buffers
    ck = _copy(golden, tmp_path, form)
    doc = ck.doc()
    if tensor == "plain":
        _proto(doc, "bias")["shape"] = _pbuf(doc, "bias", "data")["shape"] = [1 << 40, 1 << 40]
    else:
        _proto(doc)["shape"] = [1 << 45, 1 << 20]
        _recompute_buffers(doc)
    ck.write(doc)
    [cpu, meta] = sandbox.run([Call("load", [str(ck.path)], {}), Call("load", [str(ck.path)], {"device": "meta"})])
    assert cpu.status == "raised" and "ManifestError" in cpu.mro, cpu.describe()
    assert meta.problem() is None, meta.problem()
    assert meta.status == "raised" and "CheckpointError" in meta.mro, \
        f"a meta load accepted a tensor the file cannot hold: {meta.describe()}"


def test_helpers_in_this_file_build_valid_msgpack():
    """The hand-made timestamps are what msgpack itself writes for such values."""
    assert msgpack.packb(msgpack.Timestamp(2**62, 0)) == HUGE_TIMESTAMPS["ts96-seconds-2^62"]
