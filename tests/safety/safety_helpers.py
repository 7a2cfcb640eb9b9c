"""Machinery shared by the checkpoint-safety tests: budgets, the small checkpoint every case
starts from, byte-level editing of checkpoints (:class:`Ck`) and ``expect_error``.

Fixtures built from these live in ``conftest.py`` beside this file; the hostile cases themselves
in ``corpus.py``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import signal
import struct
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash

import te_serial
from te_serial.errors import CheckpointError
from te_serial.checkpoint import tree as tree_mod
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME
from te_serial.formats.tensors import QuantizedTensorStorage

try:  # format 1.1: a manifest ends with its own checksum
    from te_serial.checkpoint.manifest import MANIFEST_CHECKSUM
except ImportError:  # a format 1.0 reader
    MANIFEST_CHECKSUM = None

from helpers import same_bits

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


def seal_raw(data: bytes) -> bytes:
    """``data``, the msgpack of a manifest map without its checksum, with the checksum appended as
    its last field the way te-serial writes it (XXH3-64, big-endian, of every byte before it).

    The checksum detects damage, not edits: whoever edits a manifest can seal it again, so the
    hostile cases seal theirs and reach the checks behind the checksum.
    """
    if MANIFEST_CHECKSUM is None or not data:
        return data
    if 0x80 <= data[0] < 0x8f:
        head, rest = bytes([data[0] + 1]), data[1:]
    elif data[0] == 0xde:
        head, rest = b"\xde" + (int.from_bytes(data[1:3], "big") + 1).to_bytes(2, "big"), data[3:]
    else:  # not a map: nothing to seal
        return data
    body = head + rest + msgpack.packb(MANIFEST_CHECKSUM) + b"\xcf"
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "big")


def pack_manifest(doc: dict) -> bytes:
    """msgpack of a (possibly edited) manifest document, sealed with its checksum."""
    return seal_raw(tree_mod.pack({k: v for k, v in doc.items() if k != MANIFEST_CHECKSUM}))


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
        self.write_raw(pack_manifest(doc))

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


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
