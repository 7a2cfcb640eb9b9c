"""Reading a hostile or damaged checkpoint is safe; writing one is atomic.

Every malformed input must end in a specific :class:`te_serial.CheckpointError` subclass whose
message names the file (and, where it applies, the tensor and field), quickly and without large
allocations; nothing in a checkpoint may run code or reach pickle; a save that dies part-way
(SIGKILL or an exception) must leave the previous checkpoint loadable bit-exactly.

Cases that showed te-serial bugs (all fixed) are kept as regression tests
with the bug in the reason, so the fix turns them into passes.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import importlib
import json
import marshal
import os
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_serial
from te_serial import (CheckpointError, CheckpointFileError, ChecksumError, ManifestError,
                       TensorMismatchError, VersionError)
from te_serial.checkpoint import tree as tree_mod
from te_serial.checkpoint import writer as writer_mod
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME, expected_buffers
from te_serial.checkpoint.tree import TensorRef
from te_serial.formats.base import QuantizedTensorStorage
from te_serial.proto import TensorProto

from conftest import same_bits

REPO = Path(te_serial.__file__).resolve().parents[1]

# --- budgets ----------------------------------------------------------------------------------
TIME_BUDGET_S = 2.0            # a malformed input is refused this fast
PEAK_BUDGET = 50 << 20         # tracemalloc peak while refusing it
DIR_PEAK = PEAK_BUDGET         # directory checkpoints: the same budget
RSS_BUDGET = 200 << 20         # growth of the process's peak RSS while refusing it
HANG_S = 20                    # past this an operation counts as a hang (SIGALRM)

T = "w_mx"       # a quantized (MXFP8) tensor every case can aim at
B = "_rowwise_data"
P = "bias"       # a plain tensor


class Hang(BaseException):
    """Raised by SIGALRM inside an operation that does not return (not caught as an Exception)."""


@contextlib.contextmanager
def alarm(seconds: float = HANG_S):
    def on_alarm(signum, frame):
        raise Hang(f"no answer after {seconds} s: hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextlib.contextmanager
def bounded(seconds: float = TIME_BUDGET_S, peak: int = PEAK_BUDGET):
    """Fails if the body takes ``seconds`` or more, or allocates ``peak`` bytes or more."""
    rss0 = _maxrss()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with alarm():
            yield
    finally:
        elapsed = time.perf_counter() - t0
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    grown = _maxrss() - rss0
    assert elapsed < seconds, f"took {elapsed:.2f} s (budget {seconds} s)"
    assert top < peak, f"allocated {top / 2**20:.1f} MiB at peak (budget {peak / 2**20:.0f} MiB)"
    assert grown < RSS_BUDGET, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def expect_error(call, exc: type[CheckpointError], *needles, peak: int = PEAK_BUDGET) -> CheckpointError:
    """``call()`` raises ``exc`` (a CheckpointError) naming every needle, within the budgets.

    Any other exception type propagates with its traceback, so a bug shows where it comes from.
    """
    with bounded(peak=peak):
        with pytest.raises(CheckpointError) as info:
            call()
    err = info.value
    assert isinstance(err, exc), f"want {exc.__name__}, got {type(err).__name__}: {err}"
    msg = str(err)
    for n in needles:
        assert str(n) in msg, f"{n!r} is not named in the message: {msg}"
    return err


# --- the small checkpoint every case starts from ------------------------------------------------
def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    return {
        T: te_serial.MXFP8Quantizer()(x),
        P: torch.randn(64, generator=g),
        "blocks": [
            {"w_fp4": te_serial.NVFP4Quantizer()(x * 2), "w_blk": te_serial.Float8BlockQuantizer()(x)},
            {"w_cs": te_serial.Float8CurrentScalingQuantizer()(x),
             "w_ds": te_serial.Float8Quantizer(torch.tensor(2.0), torch.tensor(3.0))(x)},
        ],
        "step": 3,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "run", "raw": b"\x00\x01", "none": None},
    }


def assert_same_state(got, want, where: str = "<root>") -> None:
    """Same structure, types, quantizers, shapes, dtypes and bytes."""
    if isinstance(want, QuantizedTensorStorage):
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert got.quantizer == want.quantizer, f"{where}: quantizer differs"
        assert tuple(got.logical_shape) == tuple(want.logical_shape), f"{where}: shape differs"
        gb, wb = got.buffers(), want.buffers()
        assert set(gb) == set(wb), f"{where}: buffers {sorted(gb)} != {sorted(wb)}"
        for n in wb:
            assert same_bits(gb[n], wb[n]), f"{where}.{n}: bytes differ"
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and not isinstance(got, QuantizedTensorStorage), where
        assert same_bits(got, want), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{where}.{i}")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def state() -> dict:
    return make_state(0)


@pytest.fixture(scope="module")
def golden(tmp_path_factory, state) -> Path:
    root = tmp_path_factory.mktemp("golden")
    te_serial.save_quantized(state, root / "ckpt", max_shard_size="12KB")
    te_serial.save_quantized(state, root / "one.safetensors")
    assert len([f for f in os.listdir(root / "ckpt") if f.endswith(".safetensors")]) >= 3
    for p in (root / "ckpt", root / "one.safetensors"):  # warm caches (schema compile, lazy imports)
        assert_same_state(te_serial.load_quantized(p, verify=True), state)
    return root


@pytest.fixture
def ckpt_dir(golden, tmp_path) -> Path:
    return Path(shutil.copytree(golden / "ckpt", tmp_path / "ckpt"))


@pytest.fixture
def ckpt_file(golden, tmp_path) -> Path:
    return Path(shutil.copy(golden / "one.safetensors", tmp_path / "one.safetensors"))


# --- editing checkpoints byte by byte -----------------------------------------------------------
def read_st(path) -> tuple[dict, bytes]:
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_bytes(header: dict, data: bytes, header_len: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian header length, JSON header (space-padded), data."""
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb) if header_len is None else header_len) + hb + data


def key_of(tensor: str = T, buffer: str = B) -> str:
    """The safetensors key of a buffer (schema: the tensor's name, or ``<name>.<buffer>``)."""
    return tensor if buffer == "data" else f"{tensor}.{buffer}"


# accessors into the columnar manifest (schema/manifest-v1.schema.json)
def _ti(doc, tensor=T) -> int:
    return doc["tensors"]["names"].index(tensor)


def _pi(doc, tensor=T) -> int:
    return doc["tensors"]["protos"][_ti(doc, tensor)]


def _proto(doc, tensor=T) -> dict:
    return doc["protos"][_pi(doc, tensor)]


def _qi(doc, tensor=T) -> int:
    return _proto(doc, tensor)["quantizer"]


def _quant(doc, tensor=T) -> dict:
    return doc["quantizers"][_qi(doc, tensor)]


def _bj(doc, tensor=T, buffer=B) -> int:
    return [b["name"] for b in _proto(doc, tensor)["buffers"]].index(buffer)


def _pbuf(doc, tensor=T, buffer=B) -> dict:
    return _proto(doc, tensor)["buffers"][_bj(doc, tensor, buffer)]


def _fidx(doc, tensor=T, buffer=B) -> int:
    return doc["tensors"]["files"][_ti(doc, tensor)][_bj(doc, tensor, buffer)]


class Ck:
    """A checkpoint on disk (directory or single file) and ways to damage it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.is_dir = self.path.is_dir()

    @property
    def peak(self) -> int:
        return DIR_PEAK if self.is_dir else PEAK_BUDGET

    @property
    def source(self) -> str:
        """The file a manifest error must name."""
        return str(self.path / MANIFEST_NAME) if self.is_dir else str(self.path)

    def raw(self) -> bytes:
        if self.is_dir:
            return (self.path / MANIFEST_NAME).read_bytes()
        return base64.b64decode(read_st(self.path)[0]["__metadata__"][HEADER_KEY])

    def write_raw(self, data: bytes) -> None:
        if self.is_dir:
            (self.path / MANIFEST_NAME).write_bytes(data)
        else:
            header, body = read_st(self.path)
            header["__metadata__"][HEADER_KEY] = base64.b64encode(data).decode()
            self.path.write_bytes(st_bytes(header, body))

    def doc(self) -> dict:
        return tree_mod.unpack(self.raw())

    def write(self, doc: dict) -> None:
        self.write_raw(tree_mod.pack(doc))

    def edit(self, fn) -> None:
        doc = self.doc()
        fn(doc)
        self.write(doc)

    def file_of(self, tensor: str = T, buffer: str = B, doc: dict | None = None) -> Path:
        doc = doc or self.doc()
        if not self.is_dir:
            return self.path
        return self.path / doc["files"][_fidx(doc, tensor, buffer)]["name"]

    def sync_sizes(self) -> None:
        """After editing shards: make the manifest's file sizes agree, so the shard itself is read."""
        if self.is_dir:
            def fix(d):
                for f in d["files"]:
                    p = self.path / f["name"]
                    if os.path.lexists(p):
                        f["size"] = p.stat().st_size if not p.is_fifo() else 0
            self.edit(fix)

    def load(self, **kw):
        return te_serial.load_quantized(self.path, **kw)


@pytest.fixture(params=["dir", "file"])
def form(request) -> str:
    return request.param


@pytest.fixture
def ck(form, request) -> Ck:
    return Ck(request.getfixturevalue("ckpt_dir" if form == "dir" else "ckpt_file"))


def test_helpers_round_trip(ck, state):
    """Re-writing an unchanged manifest with these helpers keeps the checkpoint loadable, bit-exact."""
    ck.write(ck.doc())
    assert_same_state(ck.load(verify=True), state)
    assert te_serial.verify(ck.path) > 0


# ================================================================================================
# 1. malformed manifests: invariants, names, versions
# ================================================================================================
def _recompute_buffers(doc, tensor=T):
    """Make a prototype's buffer shapes agree with its (edited) shape."""
    d = _proto(doc, tensor)
    q = doc["quantizers"][d["quantizer"]] if d["quantizer"] is not None else None
    proto = TensorProto(tuple(d["shape"]), getattr(torch, d["dtype"]),
                        te_serial.Quantizer.from_dict(q) if q is not None else None)
    shapes = {n: list(s) for n, (s, _) in expected_buffers(proto).items()}
    for b in d["buffers"]:
        b["shape"] = shapes[b["name"]]


MANIFEST_CASES: list = []


def case(id: str, exc=ManifestError, forms=("dir", "file"), xfail: str | None = None):
    """Registers ``fn(doc, ck) -> needles`` as a manifest edit that must raise ``exc``."""
    def deco(fn):
        for f in forms:
            marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
            MANIFEST_CASES.append(pytest.param(fn, exc, f, id=f"{id}-{f}", marks=marks))
        return fn
    return deco


def _protos_field(doc, tensor=T) -> str:
    return f"protos/{_pi(doc, tensor)}"


def _quant_field(doc, tensor=T) -> str:
    return f"quantizers/{_qi(doc, tensor)}"


@case("buffer-shape-vs-proto")
def _(doc, ck):
    _pbuf(doc)["shape"] = [64, 32]
    return [ck.source, _protos_field(doc), B]


@case("buffer-dtype-vs-proto")
def _(doc, ck):
    _pbuf(doc)["dtype"] = "uint8"
    return [ck.source, _protos_field(doc), B]


@case("scale-shape-vs-proto")
def _(doc, ck):
    _pbuf(doc, T, "_rowwise_scale_inv")["shape"] = [4, 128]
    return [ck.source, _protos_field(doc), "_rowwise_scale_inv"]


@case("buffer-missing-from-proto")
def _(doc, ck):
    j = _bj(doc, T, "_columnwise_data")
    del _proto(doc)["buffers"][j]
    del doc["tensors"]["files"][_ti(doc)][j]
    del doc["tensors"]["checksums"][_ti(doc)][j]
    return [ck.source, _protos_field(doc)]


@case("buffer-extra-in-proto")
def _(doc, ck):
    _proto(doc)["buffers"].append(dict(_pbuf(doc), name="_evil"))
    doc["tensors"]["files"][_ti(doc)].append(0)
    doc["tensors"]["checksums"][_ti(doc)].append(0)
    return [ck.source, _protos_field(doc)]


@case("proto-shape-vs-buffers")
def _(doc, ck):
    _proto(doc)["shape"] = [32, 64]
    return [ck.source, _protos_field(doc)]


@case("proto-shape-not-quantizable")
def _(doc, ck):
    _proto(doc)["shape"] = [63, 64]
    return [ck.source, _protos_field(doc)]


@case("plain-shape-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [8, 8]
    return [ck.file_of(P, "data", doc), P]


@case("plain-dtype-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc, P)["dtype"] = _pbuf(doc, P, "data")["dtype"] = "int32"
    return [ck.file_of(P, "data", doc), P]


@case("plain-shape-absurd-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1 << 40, 1 << 40]
    return [ck.file_of(P, "data", doc), P]


@case("quantized-shape-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc)["shape"] = [32, 128]
    _recompute_buffers(doc)
    return [ck.file_of(T, B, doc), T]


@case("quantized-shape-absurd-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc)["shape"] = [1 << 45, 1 << 20]
    _recompute_buffers(doc)
    return [ck.file_of(T, B, doc), T]


for _where in ("tensor", "buffer", "quantizer"):
    for _name in ("object", "torch.float32", "float", "os.system", "builtins.eval", ""):
        def _dtype_case(doc, ck, where=_where, name=_name):
            if where == "tensor":
                _proto(doc)["dtype"] = name
                return [ck.source, _protos_field(doc)]
            if where == "buffer":
                _pbuf(doc)["dtype"] = name
                return [ck.source, _protos_field(doc)]
            _quant(doc)["fp8_dtype"] = name
            return [ck.source, _quant_field(doc)]
        case(f"dtype-{_where}-{_name or 'empty'}")(_dtype_case)


def _quantizer_case(id, tensor, field, value, xfail=None):
    def fn(doc, ck):
        _quant(doc, tensor)[field] = value
        return [ck.source, _quant_field(doc, tensor)]
    case(id, xfail=xfail)(fn)


_quantizer_case("quantizer-kind-unknown", T, "kind", "fp8_from_the_future")
_quantizer_case("quantizer-kind-os.system", T, "kind", "os.system")
_quantizer_case("quantizer-kind-int", T, "kind", 5)
_quantizer_case("quantizer-unknown-field", T, "__reduce__", "os.system")
_quantizer_case("quantizer-rowwise-not-bool", T, "rowwise", "yes")
_quantizer_case("quantizer-fp8-dtype-int", T, "fp8_dtype", 5)
_quantizer_case("quantizer-fp8-dtype-e8m0", T, "fp8_dtype", "float8_e8m0fnu")
_quantizer_case("quantizer-block-dim-string", "blocks.0.w_blk", "block_scaling_dim", "os.system")
_quantizer_case("quantizer-block-dim-3", "blocks.0.w_blk", "block_scaling_dim", 3)
_quantizer_case("quantizer-epsilon-string", "blocks.1.w_cs", "amax_epsilon", "os.system")
_quantizer_case("quantizer-scale-string", "blocks.1.w_ds", "scale", "os.system")
_quantizer_case("quantizer-amax-string", "blocks.1.w_ds", "amax", "x")
_quantizer_case("quantizer-2d-string", T, "with_2d_quantization", "os.system")
_quantizer_case("quantizer-rht-string", "blocks.0.w_fp4", "with_rht", "os.system")
_quantizer_case("quantizer-pow2-int", "blocks.1.w_cs", "force_pow_2_scales", 7)


@case("quantizer-none-usage")
def _(doc, ck):
    _quant(doc)["rowwise"] = _quant(doc)["columnwise"] = False
    return [ck.source, _quant_field(doc)]


@case("quantizer-not-a-map")
def _(doc, ck):
    doc["quantizers"][_qi(doc)] = "os.system"
    return [ck.source, _quant_field(doc)]


@case("quantizer-index-out-of-range")
def _(doc, ck):
    _proto(doc)["quantizer"] = 99
    return [ck.source, _protos_field(doc)]


@case("quantizer-index-float")
def _(doc, ck):
    _proto(doc)["quantizer"] = float(_qi(doc))
    return [ck.source, _protos_field(doc)]


for _storage in ("os.system", "builtins.eval", "subprocess.Popen", "pickle.loads", "torch.load",
                 "__import__", "Float8Tensor", "NVFP4TensorStorage", "NoSuchStorage"):
    def _storage_case(doc, ck, storage=_storage):
        _proto(doc)["storage"] = storage
        return [ck.source, _protos_field(doc)]
    case(f"storage-{_storage}")(_storage_case)


@case("storage-on-plain-tensor")
def _(doc, ck):
    _proto(doc, P)["storage"] = "Float8Tensor"
    return [ck.source, _protos_field(doc, P)]


@case("storage-not-a-string")
def _(doc, ck):
    _proto(doc)["storage"] = ["os", "system"]
    return [ck.source, _protos_field(doc)]


def _outside_copy(ck) -> str:
    """An absolute path to a real, valid shard outside the checkpoint."""
    src = ck.file_of()
    dst = ck.path.parent / "outside" / src.name
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    return str(dst)


def _subdir_copy(ck) -> str:
    src = ck.file_of()
    dst = (ck.path if ck.is_dir else ck.path.parent) / "sub" / "dir.safetensors"
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    return "sub/dir.safetensors"


BAD_FILE_NAMES = {
    "dotdot": lambda ck: "..",
    "parent": lambda ck: "../outside.safetensors",
    "inner-dotdot": lambda ck: "a..b.safetensors",
    "etc-passwd": lambda ck: "/etc/passwd",
    "absolute-real-shard": _outside_copy,
    "subdir-real-shard": _subdir_copy,
    "dot-hidden": lambda ck: ".hidden.safetensors",
    "backslash": lambda ck: "..\\evil.safetensors",
    "nul": lambda ck: "model\x00.safetensors",
    "newline": lambda ck: "model.safetensors\n",
    "too-long": lambda ck: "m" * 300 + ".safetensors",
    "tilde": lambda ck: "~/evil.safetensors",
    "dot": lambda ck: ".",
    "empty": lambda ck: "",
    "int": lambda ck: 5,
}

for _id, _make in BAD_FILE_NAMES.items():
    def _file_case(doc, ck, make=_make):
        bad = make(ck)
        if ck.is_dir:
            doc["files"][_fidx(doc)]["name"] = bad
        else:
            doc["files"] = [{"name": bad, "size": 1}]
        return [ck.source, "files"]
    case(f"file-name-{_id}")(_file_case)


@case("file-name-manifest-itself", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    """A legal name: the manifest is then read as a shard, and refused as one."""
    doc["files"][_fidx(doc)]["name"] = MANIFEST_NAME
    doc["files"][_fidx(doc)]["size"] = (ck.path / MANIFEST_NAME).stat().st_size
    return [ck.path / MANIFEST_NAME]


@case("file-listed-missing", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    doc["files"].append({"name": "model-00000000-00009-of-00009.safetensors", "size": 1234})
    return [ck.path / "model-00000000-00009-of-00009.safetensors"]


@case("file-listed-twice", forms=("dir",))
def _(doc, ck):
    doc["files"].append(dict(doc["files"][0]))
    return [ck.source, "files"]


@case("file-size-vs-manifest", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    doc["files"][_fidx(doc)]["size"] += 1
    return [ck.file_of(T, B, doc)]


@case("file-size-negative", forms=("dir",))
def _(doc, ck):
    doc["files"][_fidx(doc)]["size"] = -1
    return [ck.source, "files"]


@case("file-list-empty", forms=("dir",))
def _(doc, ck):
    doc["files"] = []
    return [ck.source, "files"]


@case("single-file-lists-files", forms=("file",))
def _(doc, ck):
    doc["files"] = [{"name": "other.safetensors", "size": 10}]
    return [ck.source, "files"]


@case("file-index-out-of-range")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = 99
    return [ck.source, T]


@case("file-index-negative")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = -1
    return [ck.source, "tensors/files"]


@case("file-index-float")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = 0.0
    return [ck.source, T]


@case("buffer-in-wrong-file", TensorMismatchError, forms=("dir",))
def _(doc, ck):
    j, row = _bj(doc), doc["tensors"]["files"][_ti(doc)]
    row[j] = next(i for i in range(len(doc["files"])) if i != row[j])
    return [ck.path / doc["files"][row[j]]["name"], T, B]


@case("tensor-renamed", TensorMismatchError)
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = "w_renamed"
    doc["tree"]["w_mx"] = TensorRef("w_renamed")
    return [ck.file_of(T, B, ck.doc()), "w_renamed", B]


@case("tensor-names-duplicate")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc, P)] = T
    return [ck.source, "names"]


@case("tensor-name-empty")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = ""
    return [ck.source, "tensors/names"]


@case("tensor-name-not-a-string")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = 5
    return [ck.source, "tensors/names"]


@case("tensor-columns-differ")
def _(doc, ck):
    doc["tensors"]["protos"].pop()
    return [ck.source, "tensors"]


@case("proto-index-out-of-range")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = 99
    return [ck.source, T]


@case("proto-index-huge-float")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = 1e300
    return [ck.source, T]


@case("proto-index-float")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = float(_pi(doc))
    return [ck.source, T]


@case("proto-index-wrong-kind")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = _pi(doc, P)
    return [ck.source, T]


@case("file-row-too-short")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)].pop()
    return [ck.source, T]


@case("checksum-row-too-short")
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)].pop()
    return [ck.source, T]


@case("checksum-negative")
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)][0] = -1
    return [ck.source, "checksums"]


@case("checksum-string")
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)][0] = "xxh3_64:0123456789abcdef"
    return [ck.source, "checksums"]


for _id, _pairs in {"self": [[0, 0]], "out-of-range": [[0, 99]], "different-protos": [[0, 1]],
                    "chained": [[2, 3], [3, 4]], "negative": [[-1, 0]], "triple": [[0, 1, 2]]}.items():
    def _alias_case(doc, ck, pairs=_pairs):
        doc["tensors"]["aliases"] = pairs
        return [ck.source, "aliases"]
    case(f"alias-{_id}")(_alias_case)


@case("alias-float")
def _(doc, ck):
    doc["tensors"]["aliases"] = [[0.0, 1.0]]
    return [ck.source, "aliases"]


@case("alias-chained-same-proto")
def _(doc, ck):
    n = len(doc["tensors"]["names"])
    p, row, sums = _pi(doc, P), doc["tensors"]["files"][_ti(doc, P)], doc["tensors"]["checksums"][_ti(doc, P)]
    for extra in ("tied_a", "tied_b"):
        doc["tensors"]["names"].append(extra)
        doc["tensors"]["protos"].append(p)
        doc["tensors"]["files"].append(list(row))
        doc["tensors"]["checksums"].append(list(sums))
    doc["tensors"]["aliases"] = [[n, _ti(doc, P)], [n + 1, n]]
    return [ck.source, "aliases"]


for _v in ([2, 0], [99, 7]):
    def _major(doc, ck, v=_v):
        doc["version"] = v
        return [ck.source, "version", f"{v[0]}.{v[1]}"]
    case(f"version-major-{_v[0]}", VersionError)(_major)

for _id, _v in {"string": "1.0", "short": [1], "long": [1, 0, 0], "bool": [True, 0], "negative": [-1, 0],
                "none": None, "float": [1.0, 0], "tuple-ext": (1, 0)}.items():
    def _bad_version(doc, ck, v=_v):
        doc["version"] = v
        return [ck.source, "version"]
    case(f"version-{_id}")(_bad_version)


@case("version-missing")
def _(doc, ck):
    del doc["version"]
    return [ck.source, "version"]


for _f in ("pickle", "te-serial2", "", None, 1):
    def _format(doc, ck, f=_f):
        doc["format"] = f
        return [ck.source, "format"]
    case(f"format-{_f!r}")(_format)

for _key in ("format", "tensors", "files", "producer", "metadata", "quantizers", "protos"):
    def _missing(doc, ck, key=_key):
        del doc[key]
        return [ck.source]
    case(f"missing-{_key}")(_missing)

for _key in ("names", "protos", "files"):
    def _missing_column(doc, ck, key=_key):
        del doc["tensors"][key]
        return [ck.source, "tensors"]
    case(f"missing-column-{_key}")(_missing_column)


@case("tensors-not-a-map")
def _(doc, ck):
    doc["tensors"] = [doc["tensors"]["names"]]
    return [ck.source, "tensors"]


@case("metadata-not-string")
def _(doc, ck):
    doc["metadata"] = {"a": 1}
    return [ck.source, "metadata"]


@case("metadata-int-key")
def _(doc, ck):
    doc["metadata"] = {1: "a"}
    return [ck.source]


@case("metadata-bytes-value")
def _(doc, ck):
    doc["metadata"] = {"a": b"os.system"}
    return [ck.source]


@case("requires-grad-not-bool")
def _(doc, ck):
    _proto(doc)["requires_grad"] = "yes"
    return [ck.source, _protos_field(doc)]


@case("shape-negative")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [-64]
    return [ck.source, _protos_field(doc, P)]


@case("shape-fraction")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [64.5]
    return [ck.source, _protos_field(doc, P)]


@case("shape-too-many-dims")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1] * 17 + [64]
    return [ck.source, _protos_field(doc, P)]


@case("shape-over-2^53")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1 << 60]
    return [ck.source, _protos_field(doc, P)]


@case("buffer-name-dunder")
def _(doc, ck):
    _pbuf(doc, P, "data")["name"] = "__class__"
    return [ck.source, _protos_field(doc, P)]


@case("buffer-name-path")
def _(doc, ck):
    _pbuf(doc, P, "data")["name"] = "../data"
    return [ck.source, _protos_field(doc, P)]


@case("tree-unknown-ref")
def _(doc, ck):
    doc["tree"]["ghost"] = TensorRef("ghost")
    return [ck.source, "tree", "ghost"]


@case("tree-too-deep")
def _(doc, ck):
    deep = TensorRef(T)
    for _ in range(200):
        deep = [deep]
    doc["tree"]["deep"] = deep
    return [ck.source, "tree"]


@case("tree-deep-dicts")
def _(doc, ck):
    deep = {"x": 1}
    for _ in range(900):  # below msgpack's own stack limit, above te-serial's MAX_DEPTH
        deep = {"x": deep}
    doc["tree"]["deep"] = deep
    return [ck.source, "tree"]


@case("tree-ref-in-metadata")
def _(doc, ck):
    doc["metadata"] = {"a": TensorRef(T)}
    return [ck.source]


@case("tree-ref-as-name")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = TensorRef(T)
    return [ck.source]


@pytest.mark.parametrize("mutate, exc, form", MANIFEST_CASES)
def test_manifest_edit_is_refused(mutate, exc, form, request):
    ck = Ck(request.getfixturevalue("ckpt_dir" if form == "dir" else "ckpt_file"))
    doc = ck.doc()
    needles = mutate(doc, ck)
    ck.write(doc)
    expect_error(ck.load, exc, *needles, peak=ck.peak)
    if exc is ManifestError or exc is VersionError:  # found from the manifest alone
        expect_error(lambda: te_serial.read_protos(ck.path), exc, *needles, peak=ck.peak)
        expect_error(lambda: te_serial.open(ck.path), exc, *needles, peak=ck.peak)


def test_quantizer_kind_from_the_future_is_skipped_when_not_strict(ck, state):
    """load_quantized's docstring: strict=False skips a tensor whose quantizer kind a newer
    te-serial wrote, instead of failing; the rest loads bit-exactly."""
    ck.edit(lambda d: _quant(d).update(kind="fp8_from_the_future"))
    expect_error(ck.load, ManifestError, ck.source, "fp8_from_the_future", peak=ck.peak)
    with bounded(peak=ck.peak):
        out = ck.load(strict=False, verify=True)
    assert T not in out
    want = dict(state)
    del want[T]
    assert_same_state(out, want)


@pytest.mark.parametrize("where", ["top", "producer", "tensor-column", "proto", "buffer", "file"])
def test_newer_minor_version_with_unknown_optional_field_loads(ck, state, where):
    def edit(doc):
        doc["version"] = [1, 9]
        extra = {"added_in": "1.9", "values": [1, 2.5, None, True]}
        if where == "top":
            doc["future_field"] = extra
        elif where == "producer":
            doc["producer"]["future_tool"] = "x"
        elif where == "tensor-column":
            doc["tensors"]["future_column"] = [1] * len(doc["tensors"]["names"])
        elif where == "proto":
            _proto(doc)["future_field"] = extra
        elif where == "buffer":
            _pbuf(doc)["future_field"] = 7
        elif ck.is_dir:
            doc["files"][0]["future_field"] = "x"
    ck.edit(edit)
    assert_same_state(ck.load(verify=True), state)
    assert te_serial.verify(ck.path) > 0


def test_directory_open_allocates_little(ckpt_dir):
    with bounded(peak=PEAK_BUDGET):
        assert te_serial.open(ckpt_dir).keys()


def test_missing_shard_file(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = ck.file_of()
    shard.unlink()
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)
    expect_error(lambda: te_serial.open(ck.path), CheckpointFileError, shard, peak=ck.peak)


def test_missing_manifest_and_missing_path(ckpt_dir, tmp_path):
    (ckpt_dir / MANIFEST_NAME).unlink()
    expect_error(lambda: te_serial.load_quantized(ckpt_dir), ManifestError, ckpt_dir, peak=DIR_PEAK)
    gone = tmp_path / "nothing-here.safetensors"
    expect_error(lambda: te_serial.load_quantized(gone), CheckpointFileError, gone)


def test_manifest_is_a_directory(ckpt_dir):
    (ckpt_dir / MANIFEST_NAME).unlink()
    (ckpt_dir / MANIFEST_NAME).mkdir()
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
    fifo = ckpt_dir / MANIFEST_NAME
    fifo.unlink()
    os.mkfifo(fifo)
    with fifo_watchdog(fifo):
        expect_error(lambda: te_serial.load_quantized(ckpt_dir), ManifestError, MANIFEST_NAME, peak=DIR_PEAK)


def test_shard_is_a_directory(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = ck.file_of()
    shard.unlink()
    shard.mkdir()
    ck.sync_sizes()
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


def test_shard_is_a_fifo(ckpt_dir):
    ck = Ck(ckpt_dir)
    shard = ck.file_of()
    shard.unlink()
    os.mkfifo(shard)
    ck.sync_sizes()
    with fifo_watchdog(shard):
        expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


def test_single_file_path_is_a_fifo(tmp_path):
    p = tmp_path / "fifo.safetensors"
    os.mkfifo(p)
    expect_error(lambda: te_serial.load_quantized(p), CheckpointFileError, p)


# ================================================================================================
# 1b. malformed manifest bytes: truncation, flips, hostile msgpack
# ================================================================================================
CUTS = [0, 1, 2, 3, 8, 0.25, 0.5, 0.75, -2, -1]


@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_truncated_manifest(ck, cut):
    raw = ck.raw()
    at = cut if isinstance(cut, int) and cut >= 0 else (len(raw) + cut if isinstance(cut, int)
                                                        else int(len(raw) * cut))
    ck.write_raw(raw[:at])
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


def test_manifest_with_trailing_bytes(ck):
    ck.write_raw(ck.raw() + b"\xc0")
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


@pytest.mark.parametrize("data", [b"", tree_mod.pack([1, 2]), tree_mod.pack(5), tree_mod.pack("te-serial"),
                                  tree_mod.pack(None), b"\xc1", b"\xff" * 16],
                         ids=["empty", "list", "int", "str", "nil", "reserved-byte", "ff"])
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
    header, data = read_st(ckpt_file)
    del header["__metadata__"][HEADER_KEY]
    ckpt_file.write_bytes(st_bytes(header, data))
    expect_error(lambda: te_serial.load_quantized(ckpt_file), ManifestError, ckpt_file)


@pytest.mark.parametrize("value", ["!!!not base64!!!", "QUJD", "QUJ", "", "=" * 8, "\u00e9t\u00e9"])
def test_single_file_manifest_not_base64(ckpt_file, value):
    header, data = read_st(ckpt_file)
    header["__metadata__"][HEADER_KEY] = value
    ckpt_file.write_bytes(st_bytes(header, data))
    expect_error(lambda: te_serial.load_quantized(ckpt_file), ManifestError, ckpt_file)


# hostile msgpack: headers that claim 2^32-1 (or just-allowed) elements with a few bytes behind them
ABSURD = {
    "array32-max": b"\xdd\xff\xff\xff\xff" + b"\x00" * 4,
    "map32-max": b"\xdf\xff\xff\xff\xff" + b"\x00" * 4,
    "str32-max": b"\xdb\xff\xff\xff\xff" + b"abcd",
    "bin32-max": b"\xc6\xff\xff\xff\xff" + b"abcd",
    "ext32-max": b"\xc9\xff\xff\xff\xff\x01abcd",
    "array32-4M": b"\xdd\x00\x40\x00\x00" + b"\x00" * 4,
    "map32-4M": b"\xdf\x00\x40\x00\x00" + b"\x00" * 4,
    "array32-4M-x64": b"\xdd\x00\x3f\xff\xff" * 64 + b"\xc0",
    "map32-4M-x64": b"\xdf\x00\x3f\xff\xff" * 64 + b"\xc0",
    "str32-16M": b"\xdb\x00\xff\xff\xff" + b"a",
    "nested-arrays-100000": b"\x91" * 100_000 + b"\xc0",
    "nested-maps-100000": b"\x81\xc0" * 100_000 + b"\xc0",
    "ext-unknown-42": b"\xd4\x2a\x00",
    "ext-negative-77": b"\xd4\xb3\x00",
    "ext-tensorref-bad-utf8": b"\xd4\x01\xff",
    "ext-tuple-not-msgpack": b"\xd4\x02\xc1",
    "ext-tuple-extra-data": b"\xd5\x02\x90\x90",
    "ext-tuple-not-a-list": b"\xd4\x02\x05",
}


def _with_raw_field(doc: dict, key: str, raw_value: bytes) -> bytes:
    """msgpack of ``doc`` with ``key`` set to the raw msgpack bytes ``raw_value``."""
    doc = dict(doc)
    doc.pop(key, None)
    body = tree_mod.pack(doc)
    assert 0x80 <= body[0] < 0x8f, "expected a small fixmap"
    return bytes([body[0] + 1]) + body[1:] + tree_mod.pack(key) + raw_value


@pytest.mark.parametrize("where", ["whole", "tree", "tensors", "tree-leaf"])
@pytest.mark.parametrize("kind", list(ABSURD))
def test_hostile_msgpack(ck, kind, where):
    raw_value = ABSURD[kind]
    if where == "whole":
        data = raw_value
    elif where == "tree-leaf":  # inside the tree's map, not at the manifest's top level
        doc = ck.doc()
        tree = dict(doc.pop("tree"))
        tree.pop("step")
        inner = tree_mod.pack(tree)
        assert 0x80 <= inner[0] < 0x8f
        data = _with_raw_field(doc, "tree", bytes([inner[0] + 1]) + inner[1:] + tree_mod.pack("step") + raw_value)
    else:
        data = _with_raw_field(ck.doc(), where, raw_value)
    ck.write_raw(data)
    err = expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)
    assert "Traceback" not in str(err)


def test_timestamp_extension_in_tree_is_refused(ck):
    ck.write_raw(_with_raw_field(ck.doc(), "tree", b"\xd6\xff\x00\x00\x00\x01"))
    expect_error(ck.load, ManifestError, ck.source, "tree", peak=ck.peak)


def _nested_tuple_ext(levels: int) -> bytes:
    """``levels`` tuples (msgpack ext type 2) nested inside each other, built without copying."""
    parts, inner = [], 1  # innermost: nil
    for _ in range(levels):
        body = 1 + inner  # fixarray(1) + inner
        if body < 1 << 8:
            head = b"\xc7" + bytes([body]) + b"\x02"
        elif body < 1 << 16:
            head = b"\xc8" + struct.pack(">H", body) + b"\x02"
        else:
            head = b"\xc9" + struct.pack(">I", body) + b"\x02"
        parts.append(head + b"\x91")
        inner = body + len(head)
    return b"".join(reversed(parts)) + b"\xc0"


SUBPROCESS_LOAD = textwrap.dedent("""
    import sys, te_serial
    try:
        te_serial.load_quantized(sys.argv[1])
    except te_serial.ManifestError as e:
        print("ManifestError", e)
        sys.exit(0)
    print("loaded")
    sys.exit(1)
""")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_deeply_nested_tuple_extensions_do_not_crash(ckpt_dir):
    """Run in a child process: the failure mode is a crash (SIGSEGV), not an exception."""
    ck = Ck(ckpt_dir)
    ck.write_raw(_with_raw_field(ck.doc(), "tree", _nested_tuple_ext(100_000)))
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS_LOAD, str(ckpt_dir)], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"
    assert ck.source in proc.stdout


def test_moderately_nested_tuple_extensions_in_tree(ck):
    """100 nested tuples still unpack (no crash); the tree's depth check then refuses them."""
    ck.write_raw(_with_raw_field(ck.doc(), "tree", _nested_tuple_ext(100)))
    expect_error(ck.load, ManifestError, ck.source, "tree", peak=ck.peak)


# ================================================================================================
# 1c. damaged safetensors files: truncation, absurd headers
# ================================================================================================
def _truncation_points(path: Path) -> dict[str, int]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return {"0": 0, "1": 1, "7": 7, "8": 8, "mid-header": 8 + n // 2, "end-of-header": 8 + n,
            "mid-data": 8 + n + (len(raw) - 8 - n) // 2, "size-1": len(raw) - 1}


TRUNCATIONS = ["0", "1", "7", "8", "mid-header", "end-of-header", "mid-data", "size-1"]


@pytest.mark.parametrize("sync", [False, True], ids=["size-as-saved", "size-synced"])
@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated_shard(ckpt_dir, where, sync):
    """sync=True also fixes the manifest's file size, so the truncated file itself is parsed."""
    ck = Ck(ckpt_dir)
    shard = ck.file_of()
    at = _truncation_points(shard)[where]
    with open(shard, "r+b") as f:
        f.truncate(at)
    if sync:
        ck.sync_sizes()
    expect_error(ck.load, CheckpointFileError, shard, peak=ck.peak)


@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated_single_file(ckpt_file, where):
    at = _truncation_points(ckpt_file)[where]
    with open(ckpt_file, "r+b") as f:
        f.truncate(at)
    expect_error(lambda: te_serial.load_quantized(ckpt_file), CheckpointFileError, ckpt_file)
    expect_error(lambda: te_serial.open(ckpt_file), CheckpointFileError, ckpt_file)


def _hdr_len(value):
    def edit(header, data, key):
        return st_bytes(header, data, header_len=value if isinstance(value, int) else None)
    return edit


def _set_entry(field, value):
    def edit(header, data, key):
        header[key][field] = value(header[key]) if callable(value) else value
        return st_bytes(header, data)
    return edit


def _header_json(text: bytes):
    def edit(header, data, key):
        hb = text + b" " * (-len(text) % 8)
        return struct.pack("<Q", len(hb)) + hb + data
    return edit


def _header_len_plus(delta):
    def edit(header, data, key):
        good = st_bytes(header, data)
        n = struct.unpack("<Q", good[:8])[0]
        return struct.pack("<Q", n + delta) + good[8:]
    return edit


def _overlap(header, data, key):
    other = next(k for k in header if k not in ("__metadata__", key))
    header[other]["data_offsets"] = list(header[key]["data_offsets"])
    header[other]["shape"], header[other]["dtype"] = header[key]["shape"], header[key]["dtype"]
    return st_bytes(header, data)


def _metadata_not_str(header, data, key):
    header.setdefault("__metadata__", {})["x"] = 5
    return st_bytes(header, data)


SAFETENSORS_EDITS = {
    "header-len-2^64-1": _hdr_len(2**64 - 1),
    "header-len-2^63": _hdr_len(2**63),
    "header-len-2^32": _hdr_len(2**32),
    "header-len-100MB+8": _hdr_len(100_000_008),
    "header-len-beyond-file": _header_len_plus(1 << 20),
    "header-len-short-by-1": _header_len_plus(-1),
    "header-len-zero": _hdr_len(0),
    "header-not-json": _header_json(b"{\"a\":"),
    "header-json-list": _header_json(b"[]"),
    "header-json-null": _header_json(b"null"),
    "header-json-deep": _header_json(b"[" * 100_000 + b"]" * 100_000),
    "offsets-beyond-file": _set_entry("data_offsets", lambda e: [e["data_offsets"][0], 1 << 40]),
    "offsets-u64-max": _set_entry("data_offsets", lambda e: [e["data_offsets"][0], 2**64 - 1]),
    "offsets-reversed": _set_entry("data_offsets", lambda e: e["data_offsets"][::-1]),
    "offsets-negative": _set_entry("data_offsets", lambda e: [-1, e["data_offsets"][1]]),
    "offsets-overlap": _overlap,
    "shape-absurd": _set_entry("shape", [1 << 40, 1 << 40]),
    "shape-overflow": _set_entry("shape", [1 << 32, 1 << 32, 1 << 32]),
    "dtype-unknown": _set_entry("dtype", "PICKLE"),
    "metadata-not-str": _metadata_not_str,
}


@pytest.mark.parametrize("edit", list(SAFETENSORS_EDITS))
def test_absurd_safetensors_header(ck, edit):
    path = ck.file_of()
    key = key_of()
    header, data = read_st(path)
    path.write_bytes(SAFETENSORS_EDITS[edit](header, data, key))
    ck.sync_sizes()
    expect_error(ck.load, CheckpointFileError, path, peak=ck.peak)


def test_safetensors_header_dtype_disagrees_with_manifest(ck):
    """A valid safetensors file whose buffer dtype is not the manifest's: refused before reading."""
    path = ck.file_of()
    key = key_of()
    header, data = read_st(path)
    header[key]["dtype"] = "U8"
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)


def test_safetensors_header_shape_disagrees_with_manifest(ck):
    path = ck.file_of()
    key = key_of()
    header, data = read_st(path)
    header[key]["shape"] = [32, 128]
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)


def test_shard_key_missing_from_file(ckpt_dir):
    ck = Ck(ckpt_dir)
    path = ck.file_of()
    key = key_of()
    header, data = read_st(path)
    header["renamed"] = header.pop(key)
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    expect_error(ck.load, TensorMismatchError, path, T, B, peak=ck.peak)


def test_shard_replaced_by_other_format(ckpt_dir, tmp_path):
    """A torch.save (zip + pickle) file where a shard should be: refused, never unpickled."""
    ck = Ck(ckpt_dir)
    path = ck.file_of()
    torch.save({"x": torch.ones(3)}, path)
    ck.sync_sizes()
    expect_error(ck.load, CheckpointFileError, path, peak=ck.peak)


# ================================================================================================
# 2. checksums
# ================================================================================================
def _flip_data_byte(ck: Ck, tensor=T, buffer=B) -> tuple[Path, int]:
    """Flip one byte in the middle of a buffer's data; returns (file, byte index inside the buffer)."""
    path = ck.file_of(tensor, buffer)
    key = key_of(tensor, buffer)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    inside = (end - start) // 2
    raw[8 + n + start + inside] ^= 0x5A
    path.write_bytes(bytes(raw))
    return path, inside


@pytest.mark.parametrize("tensor, buffer", [(T, B), (T, "_columnwise_scale_inv"), (P, "data"),
                                            ("blocks.0.w_fp4", "_amax_rowwise")])
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
    ck.edit(lambda d: d["tensors"]["checksums"][_ti(d)].__setitem__(_bj(d), 0x0123456789ABCDEF))
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


# ================================================================================================
# 3. property-based mutation: every outcome is a load or a CheckpointError
# ================================================================================================
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


# ================================================================================================
# 4. nothing in a checkpoint runs code; no load touches pickle
# ================================================================================================
_AUDIT_LOG: list | None = None
_AUDIT_INSTALLED = False
_AUDIT_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                 "subprocess.Popen", "pickle.find_class", "marshal.loads", "marshal.load", "ctypes.dlopen",
                 "exec", "compile", "import")


def _audit(event: str, args) -> None:
    log = _AUDIT_LOG
    if log is not None and event.startswith(_AUDIT_EVENTS):
        log.append((event, repr(args[:1])[:200]))


@contextlib.contextmanager
def audited():
    """Records code-running audit events (a hook cannot be removed; it does nothing when idle)."""
    global _AUDIT_LOG, _AUDIT_INSTALLED
    if not _AUDIT_INSTALLED:
        sys.addaudithook(_audit)
        _AUDIT_INSTALLED = True
    _AUDIT_LOG = log = []
    try:
        yield log
    finally:
        _AUDIT_LOG = None


PROBE = textwrap.dedent("""
    import os, pathlib
    pathlib.Path(os.environ["TE_SERIAL_PROBE_MARKER"]).write_text("imported")

    class Evil:
        def __init__(self, *a, **k):
            pathlib.Path(os.environ["TE_SERIAL_PROBE_MARKER"]).write_text("called")

    def boom(*a, **k):
        pathlib.Path(os.environ["TE_SERIAL_PROBE_MARKER"]).write_text("called")
""")
PROBE_MODULE = "te_serial_evil_probe"


class _Forbidden(AssertionError):
    pass


@pytest.fixture
def no_code_execution(monkeypatch, tmp_path):
    """Booby-traps every way to run code from data; yields the list of attempted calls."""
    calls: list[str] = []
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / f"{PROBE_MODULE}.py").write_text(PROBE)
    marker = tmp_path / "probe-marker"
    monkeypatch.setenv("TE_SERIAL_PROBE_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(probe_dir))
    sys.modules.pop(PROBE_MODULE, None)

    def trap(name):
        def f(*a, **k):
            calls.append(name)
            raise _Forbidden(f"{name} called during a load")
        return f

    for mod, attr in [(os, "system"), (os, "popen"), (os, "execv"), (os, "execve"), (os, "posix_spawn"),
                      (subprocess, "Popen"), (subprocess, "run"), (builtins, "eval"), (builtins, "exec"),
                      (pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (marshal, "loads"),
                      (torch, "load"), (torch.serialization, "load"), (importlib, "import_module")]:
        monkeypatch.setattr(mod, attr, trap(f"{mod.__name__}.{attr}"))
    with audited() as events:
        yield calls, events
    assert not calls, f"code-running calls during a load: {calls}"
    assert not marker.exists(), f"the probe module ran: {marker.read_text()}"
    assert PROBE_MODULE not in sys.modules
    bad = [e for e in events if e[0] != "import" or PROBE_MODULE in e[1] or "pickle" in e[1]]
    assert not bad, f"code-running audit events during a load: {bad}"


EVIL_NAMES = [PROBE_MODULE, f"{PROBE_MODULE}.Evil", f"{PROBE_MODULE}:Evil", f"{PROBE_MODULE}.boom",
              "os.system", "builtins.eval", "subprocess.Popen", "pickle.loads", "torch.load"]

EVIL_PLACES = {
    "storage": lambda d, v: _proto(d).update(storage=v),
    "quantizer-kind": lambda d, v: _quant(d).update(kind=v),
    "quantizer-dtype": lambda d, v: _quant(d).update(fp8_dtype=v),
    "quantizer-extra": lambda d, v: _quant(d).update(__reduce__=v),
    "tensor-dtype": lambda d, v: _proto(d).update(dtype=v),
    "buffer-dtype": lambda d, v: _pbuf(d).update(dtype=v),
    "buffer-name": lambda d, v: _pbuf(d).update(name=v),
    "scale-layout": lambda d, v: _proto(d).update(scale_layout=v),
    "file-name": lambda d, v: d["files"] and d["files"][0].update(name=v),
    "format": lambda d, v: d.update(format=v),
    "producer": lambda d, v: d["producer"].update(te_serial=v, torch=v, transformer_engine=v),
    "metadata": lambda d, v: d["metadata"].update({v: v}),
    "tree-string": lambda d, v: d["tree"].update(evil=v),
    "tree-key": lambda d, v: d["tree"].update({v: 1}),
    "tree-ref": lambda d, v: d["tree"].update(evil=TensorRef(v)),
    "tensor-name": lambda d, v: d["tensors"]["names"].__setitem__(_ti(d), v),
}


@pytest.mark.parametrize("place", list(EVIL_PLACES))
def test_manifest_names_never_imported_or_called(ck, no_code_execution, place):
    raw = ck.raw()
    for name in EVIL_NAMES:
        ck.write_raw(raw)
        doc = ck.doc()
        EVIL_PLACES[place](doc, name)
        ck.write(doc)
        with bounded(peak=ck.peak):
            try:
                ck.load(verify=True)
                te_serial.open(ck.path).protos
            except CheckpointError:
                pass


class _Reduce:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


PICKLE_PAYLOAD = pickle.dumps(_Reduce(), protocol=2)


def test_pickle_bytes_in_a_checkpoint_stay_bytes(ck, state, no_code_execution):
    """Pickle bytes in the tree come back as bytes; as the manifest or a buffer they are refused."""
    ck.edit(lambda d: d["tree"].update(payload=PICKLE_PAYLOAD))
    out = ck.load(verify=True)
    assert out["payload"] == PICKLE_PAYLOAD
    ck.write_raw(PICKLE_PAYLOAD)
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


def test_pickle_bytes_as_buffer_data_stay_data(ckpt_dir, no_code_execution):
    ck = Ck(ckpt_dir)
    path = ck.file_of(P, "data")
    key = key_of(P, "data")
    header, data = read_st(path)
    start, end = header[key]["data_offsets"]
    payload = PICKLE_PAYLOAD[: end - start].ljust(end - start, b".")
    path.write_bytes(st_bytes(header, data[:start] + payload + data[end:]))
    ck.sync_sizes()
    expect_error(lambda: ck.load(verify=True), ChecksumError, P, peak=ck.peak)
    assert bytes(ck.load()[P].view(torch.uint8).numpy()) == payload


def test_torch_save_file_is_never_unpickled(tmp_path, no_code_execution):
    p = tmp_path / "model.safetensors"
    with open(p, "wb") as f:  # a torch.save zip/pickle file under a .safetensors name
        f.write(b"PK\x03\x04" + PICKLE_PAYLOAD)
    expect_error(lambda: te_serial.load_quantized(p), CheckpointFileError, p)
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / MANIFEST_NAME).write_bytes(b"\x80\x02" + PICKLE_PAYLOAD)
    expect_error(lambda: te_serial.load_quantized(d), ManifestError, d / MANIFEST_NAME, peak=DIR_PEAK)


def test_valid_loads_never_touch_pickle(ck, state, no_code_execution):
    assert_same_state(ck.load(verify=True), state)
    handle = te_serial.open(ck.path)
    assert set(handle.protos) == set(handle.keys())
    assert_same_state(handle.get(T, device="cpu"), state[T])
    assert te_serial.read_protos(ck.path)[T].quantizer == state[T].quantizer
    assert te_serial.verify(ck.path) > 0
    meta = te_serial.load_quantized(ck.path, device="meta")
    assert meta[T].device.type == "meta"


# ================================================================================================
# 5. atomic save
# ================================================================================================
CHILD = textwrap.dedent("""
    import sys, torch, te_serial
    path, tag, mib = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    n = mib * (1 << 20) // 4 // 8
    sd = {f"big.{i}": torch.full((n,), tag + i) for i in range(8)}
    sd["w_mx"] = te_serial.MXFP8Quantizer()(torch.full((64, 64), tag, dtype=torch.bfloat16))
    print("ready", flush=True)
    te_serial.save_quantized(sd, path, max_shard_size="30MB")
    print("saved", flush=True)
""")
#: when to SIGKILL a child saving over an existing checkpoint: as soon as safetensors' own
#: temporary file (save_file writes ``.tmpXXXXXX`` and renames it) or te-serial's first temporary
#: file appears, or this many seconds after the child starts saving (~1 s for 200 MB here)
KILL_MOMENTS = ["safetensors-tmp", "te-serial-tmp", 0.1, 0.5]
SAFETENSORS_TMP = ".tmp"
BIG_MIB = 200


def _is_new(out, tag: float) -> bool:
    if set(out) != {f"big.{i}" for i in range(8)} | {"w_mx"}:
        return False
    n = BIG_MIB * (1 << 20) // 4 // 8
    for i in range(8):
        t = out[f"big.{i}"]
        assert t.shape == (n,) and bool((t == tag + i).all()), f"new checkpoint, but big.{i} is wrong"
    return True


@pytest.fixture(scope="module")
def killed_saves(golden, tmp_path_factory) -> dict:
    """Children saving 200 MB over existing checkpoints (both forms), SIGKILLed at KILL_MOMENTS.

    They run side by side to keep the file fast. Returns form → [(path, tag, moment, saw_tmp)],
    ``saw_tmp``: a temporary file of the killed save was on disk right after the kill.
    """
    root = tmp_path_factory.mktemp("killed")
    child = root / "child.py"
    child.write_text(CHILD)
    jobs = []
    for form in ("dir", "file"):
        for i, moment in enumerate(KILL_MOMENTS):
            tag = 10.0 * (len(jobs) + 1)
            if form == "dir":
                path = Path(shutil.copytree(golden / "ckpt", root / f"ckpt{i}"))
                watch = path
            else:
                (root / f"d{i}").mkdir()
                path = Path(shutil.copy(golden / "one.safetensors", root / f"d{i}" / "one.safetensors"))
                watch = path.parent
            proc = subprocess.Popen([sys.executable, str(child), str(path), str(tag), str(BIG_MIB)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
            jobs.append((form, path, watch, tag, moment, proc))
    errors: list[str] = []
    saw_tmp: dict[int, bool] = {}

    def has_tmp(watch: Path, prefixes=(writer_mod.TMP_PREFIX, SAFETENSORS_TMP)) -> bool:
        return any(n.startswith(prefixes) for n in os.listdir(watch))

    def kill(k, watch, moment, proc):
        try:
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                errors.append(f"child did not start: {line!r} {proc.stderr.read()[-2000:]!r}")
                return
            if isinstance(moment, str):
                prefix = SAFETENSORS_TMP if moment == "safetensors-tmp" else writer_mod.TMP_PREFIX
                deadline = time.monotonic() + 30
                while not has_tmp(watch, (prefix,)) and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.0002)
            else:
                time.sleep(moment)
        finally:
            proc.kill()  # SIGKILL, this child only
            proc.wait()
            saw_tmp[k] = has_tmp(watch)

    threads = [threading.Thread(target=kill, args=(k, w, m, p)) for k, (_, _, w, _, m, p) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for *_, proc in jobs:
        proc.stdout.close()
        proc.stderr.close()
    assert not errors, errors
    out: dict[str, list] = {"dir": [], "file": []}
    for k, (form, path, _, tag, moment, _) in enumerate(jobs):
        out[form].append((path, tag, moment, saw_tmp[k]))
    return out


@pytest.mark.slow
def test_killed_save_leaves_old_checkpoint(killed_saves, state, form):
    """SIGKILLed at any moment, a save over an existing checkpoint leaves the old checkpoint
    bit-exactly, or (killed after the commit point) the complete new one; never anything else."""
    survived = 0
    for path, tag, moment, _ in killed_saves[form]:
        out = te_serial.load_quantized(path, verify=True)
        if not _is_new(out, tag):  # else killed after the commit point: the new one is whole
            assert_same_state(out, state, f"<killed at {moment}>")
            survived += 1
        assert te_serial.verify(path) > 0
        if form == "dir":  # whatever the manifest names is there and whole
            names = {f["name"] for f in tree_mod.unpack((path / MANIFEST_NAME).read_bytes())["files"]}
            assert names <= set(os.listdir(path))
    assert survived >= 1, "every child finished before its kill: the test did not test anything"


@pytest.mark.slow
def test_next_save_cleans_up_after_killed_directory_save(killed_saves, state):
    assert any(saw for *_, saw in killed_saves["dir"]), "no kill left a temporary file behind"
    for path, *_ in killed_saves["dir"]:
        manifest = te_serial.save_quantized(state, path, max_shard_size="12KB")
        assert set(os.listdir(path)) == {MANIFEST_NAME, *manifest.files}
        assert_same_state(te_serial.load_quantized(path, verify=True), state)


@pytest.mark.slow
def test_next_save_cleans_up_after_killed_single_file_save(killed_saves, state):
    assert any(saw for *_, saw in killed_saves["file"]), "no kill left a temporary file behind"
    for path, *_ in killed_saves["file"]:
        te_serial.save_quantized(state, path)
        assert_same_state(te_serial.load_quantized(path, verify=True), state)
        assert os.listdir(path.parent) == [path.name]


def _failing_save_file(fail_on: int, exc: BaseException, partial: bool = False):
    real = writer_mod.save_file
    count = [0]

    def save_file(tensors, filename, metadata=None):
        count[0] += 1
        if count[0] == fail_on:
            if partial:  # a half-written file under the temporary name, then the error
                Path(filename).write_bytes(b"\x00" * 1000)
            raise exc
        return real(tensors, filename, metadata=metadata)
    return save_file


FAILURES = {
    "oserror-2nd-shard": (2, OSError(28, "No space left on device (injected)"), False),
    "oserror-2nd-shard-partial": (2, OSError(28, "No space left on device (injected)"), True),
    "keyboardinterrupt-3rd-shard": (3, KeyboardInterrupt(), True),
    "oserror-1st-shard": (1, OSError(5, "I/O error (injected)"), True),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_save_leaves_old_checkpoint(ckpt_dir, state, monkeypatch, failure):
    fail_on, exc, partial = FAILURES[failure]
    before = sorted(os.listdir(ckpt_dir))
    monkeypatch.setattr(writer_mod, "save_file", _failing_save_file(fail_on, exc, partial))
    with pytest.raises(type(exc)):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), state)
    assert te_serial.verify(ckpt_dir) > 0
    after = os.listdir(ckpt_dir)
    assert not [n for n in after if n.startswith(writer_mod.TMP_PREFIX)], after
    assert set(before) <= set(after)


def test_failed_manifest_commit_leaves_old_checkpoint(ckpt_dir, state, monkeypatch):
    real = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst).name == MANIFEST_NAME:
            raise OSError(5, "I/O error (injected)")
        return real(src, dst, *a, **k)
    monkeypatch.setattr(writer_mod.os, "replace", replace)
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), state)
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(writer_mod.TMP_PREFIX)]


def test_failed_save_leftovers_are_cleaned(ckpt_dir, state, monkeypatch):
    monkeypatch.setattr(writer_mod, "save_file", _failing_save_file(2, OSError(28, "injected")))
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    manifest = te_serial.save_quantized(state, ckpt_dir, max_shard_size="12KB")
    assert set(os.listdir(ckpt_dir)) == {MANIFEST_NAME, *manifest.files}


@pytest.mark.parametrize("partial", [False, True])
def test_failed_single_file_save_leaves_old_file(ckpt_file, state, monkeypatch, partial):
    monkeypatch.setattr(writer_mod, "save_file", _failing_save_file(1, OSError(28, "injected"), partial))
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_file)
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_file, verify=True), state)
    assert os.listdir(ckpt_file.parent) == [ckpt_file.name]


def test_save_over_existing_checkpoint_replaces_it(ckpt_dir, ckpt_file):
    """The good path the failure tests compare with: a new save fully replaces the old one."""
    new = make_state(1)
    manifest = te_serial.save_quantized(new, ckpt_dir, max_shard_size="12KB")
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), new)
    assert set(os.listdir(ckpt_dir)) == {MANIFEST_NAME, *manifest.files}
    te_serial.save_quantized(new, ckpt_file)
    assert_same_state(te_serial.load_quantized(ckpt_file, verify=True), new)
    assert sorted(os.listdir(ckpt_file.parent)) == sorted([ckpt_file.name, ckpt_dir.name])
