"""Nothing in a checkpoint runs code: names in a manifest are never imported or called, pickle
bytes stay bytes, and no load touches pickle (audit hooks and booby-trapped entry points)."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import marshal
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import te_serial
from te_serial.errors import CheckpointError, CheckpointFileError, ChecksumError, ManifestError
from te_serial.checkpoint.manifest import MANIFEST_NAME
from te_serial.checkpoint.tree import TensorRef

from .corpus import PICKLE_PAYLOAD, pickle_as_buffer_data
from .safety_helpers import (DIR_PEAK, P, T, Ck, _pbuf, _proto, _quant, _ti, assert_same_state, bounded,
                             expect_error)


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


def test_pickle_bytes_in_a_checkpoint_stay_bytes(ck, state, no_code_execution):
    """Pickle bytes in the tree come back as bytes; as the manifest or a buffer they are refused."""
    ck.edit(lambda d: d["tree"].update(payload=PICKLE_PAYLOAD))
    out = ck.load(verify=True)
    assert out["payload"] == PICKLE_PAYLOAD
    ck.write_raw(PICKLE_PAYLOAD)
    expect_error(ck.load, ManifestError, ck.source, peak=ck.peak)


def test_pickle_bytes_as_buffer_data_stay_data(ckpt_dir, no_code_execution):
    ck = Ck(ckpt_dir)
    payload = pickle_as_buffer_data(ck)
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
