"""The TE ``_extra_state`` decoder under hostile payloads (issue 14).

Every payload here is built by hand (``pickle.dumps`` of objects whose ``__reduce__`` names
exactly the callables and arguments wanted, or raw opcodes) and must be refused with
:class:`UnsafeExtraStateError` -- a :class:`te_serial.CheckpointError` -- quickly and without
large allocations: zero-stride / overlapping / overflowing views (class 3), CPU bombs (class 2),
storages multiplied by references (class 1, decoder side), dunder recipe fields, zip payloads
that :mod:`zipfile` would answer with ``NotImplementedError``, meta tensors (class 4). The
allocation bombs also run in a child process limited to 3.5 GiB of address space. A bounded
hypothesis fuzz, seeded with real TE payloads, checks that nothing but te-serial's error ever
leaves the decoder (``TE_SERIAL_FUZZ_LONG=1`` runs it longer).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_serial
import te_shim
from te_serial.errors import CheckpointError, UnsupportedValueError
from te_serial.te.extra_state import (MAX_PAYLOAD_WORK, MAX_ZIP_ENTRIES, RECIPE_MODULE, ExtraStateBudget,
                                      TEUnavailableError, UnsafeExtraStateError, check_extra_state,
                                      decode_te_extra_state, encode_te_extra_state)

TE = te_shim.install()
needs_te = pytest.mark.skipif(TE is None, reason="transformer-engine wheel not installed")

REPO = Path(te_serial.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parents[1]
AS_LIMIT = int(3.5 * 2**30)
KEY = "layer._extra_state"
FAST_S = 2.0                # CPU seconds: a hostile payload is refused this fast
PEAK = 32 << 20             # ... allocating at most this much (tracemalloc)
FUZZ_LONG = os.environ.get("TE_SERIAL_FUZZ_LONG") == "1"


# --------------------------------------------------------------------------- payload builders


class _R:
    """Pickles as ``REDUCE(fn, args)``: how the hostile payloads below name their callables."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _typed(t: torch.Tensor):
    """The TypedStorage a tensor pickles (``torch.storage._load_from_bytes`` of a legacy save)."""
    return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)


def _view(storage, offset, size, stride):
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""
    return _R(torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, OrderedDict()))


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def payload(**entries) -> torch.Tensor:
    return as_tensor(pickle.dumps({"extra_fp8_variables": {}, **entries}))


def recipe_pickle(fields_pickle: bytes, cls: str = "DelayedScaling", after_build: bytes = b"") -> bytes:
    """``{"recipe": NEWOBJ(recipe.<cls>, ()) BUILD(<fields>)}`` in raw protocol-2 opcodes."""
    name = b"recipe"
    return (b"\x80\x02}" + b"X" + struct.pack("<I", len(name)) + name
            + b"c" + RECIPE_MODULE.encode() + b"\n" + cls.encode() + b"\n"
            + b")\x81" + fields_pickle + b"b" + after_build + b"s.")


def fields_pickle(fields: dict) -> bytes:
    return pickle.dumps(fields, protocol=2)[2:-1]  # without PROTO and STOP; memoizes the dict as 0


def refuse(value, *needles, budget=None, seconds: float = FAST_S, peak: int = PEAK) -> str:
    """``decode_te_extra_state(value)`` raises UnsafeExtraStateError naming KEY and every needle,
    fast (timed on its own) and small (a second run under tracemalloc)."""
    if isinstance(value, io.BytesIO):
        value = io.BytesIO(value.getvalue())
    t0 = time.process_time()
    with pytest.raises(CheckpointError) as info:
        decode_te_extra_state(value, where=KEY, budget=budget)
    elapsed = time.process_time() - t0
    err = info.value
    assert type(err) is UnsafeExtraStateError, f"{type(err).__name__}: {err}"
    msg = str(err)
    assert KEY in msg, msg
    for n in needles:
        assert n in msg, msg
    assert elapsed < seconds, f"took {elapsed:.2f} s: {msg}"
    if budget is None:
        tracemalloc.start()
        try:
            with pytest.raises(UnsafeExtraStateError):
                decode_te_extra_state(value, where=KEY)
            top = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert top < peak, f"allocated {top / 2**20:.1f} MiB at peak: {msg}"
    return msg


def run_limited(body: str, timeout: float = 120.0) -> dict:
    """Run ``body`` in a fresh interpreter whose address space is limited to 3.5 GiB.

    ``body`` calls ``report(fn)``; the child prints what ``fn()`` did: its exception class, whether
    that is a CheckpointError, the seconds it took and how much its peak RSS grew.
    """
    prelude = textwrap.dedent(f"""
        import json, resource, sys, time, traceback
        sys.path[:0] = [{str(TESTS)!r}, {str(REPO)!r}]
        import torch, te_serial

        def report(fn):
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            t0 = time.process_time()
            out = {{"status": "ok"}}
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the point is to see which class leaks
                out = {{"status": "raised", "exc": type(e).__module__ + "." + type(e).__qualname__,
                        "checkpoint_error": isinstance(e, te_serial.CheckpointError),
                        "message": str(e)[:1500], "traceback": traceback.format_exc()[-3000:]}}
            out["seconds"] = time.process_time() - t0
            out["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            print("RESULT " + json.dumps(out), flush=True)
    """)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], preexec_fn=limit,
                          capture_output=True, text=True, timeout=timeout, cwd=str(TESTS))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child exited {proc.returncode} without a result:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_refused_in_child(result: dict, *needles, rss: int = 300 << 20, seconds: float = 5.0) -> None:
    assert result["status"] == "raised", result
    assert result["checkpoint_error"], f"leaked {result['exc']}: {result['message']}\n{result['traceback']}"
    for n in needles:
        assert n in result["message"], result["message"]
    assert result["rss_growth"] < rss, f"peak RSS grew by {result['rss_growth'] / 2**20:.0f} MiB"
    assert result["seconds"] < seconds, result


# --------------------------------------------------------------------------- class 3: views


@pytest.mark.parametrize("storage_n, offset, size, stride, needle", [
    (1, 0, (1 << 28,), (0,), "reaching past its storage"),              # the ~400-byte 2**28 bomb
    (4, 0, (1 << 14, 1 << 14), (0, 0), "reaching past its storage"),
    (16, 0, (4, 4), (0, 1), "overlap"),                                  # zero stride, fits the storage
    (16, 0, (4, 4), (1, 1), "overlap"),                                  # overlapping rows
    (16, 0, (2, 2, 4), (8, 4, 0), "overlap"),
    (4, 0, (1 << 61, 1 << 61), (1, 1), "reaching past its storage"),     # element count overflows int64
    (4, 0, (2,), ((1 << 62) - 1,), "reaching past its storage"),        # byte span overflows
    (4, (1 << 62) - 1, (1,), (1,), "reaching past its storage"),
    (4, 0, (0, 1 << 61, 1 << 61), (1, 1, 1), "overflow"),               # empty, but strides overflow
    (4, 0, (1 << 62,), (1,), "tensor size"),
    (4, 0, (2,), (-1,), "tensor stride"),
    (4, -1, (2,), (1,), "storage offset"),
])
def test_bad_views_are_refused_before_any_allocation(storage_n, offset, size, stride, needle):
    value = payload(scale_fwd=_view(_typed(torch.ones(storage_n)), offset, size, stride))
    assert value.numel() < 1000
    refuse(value, needle)


@pytest.mark.parametrize("size, stride, want", [
    ((2, 2), (1, 2), lambda b: b.view(2, 2).t()),
    ((1, 4), (0, 1), lambda b: b.view(1, 4)),          # zero stride on a size-1 dimension is fine
    ((2,), (3,), lambda b: b[::3][:2]),
    ((0, 5), (0, 0), lambda b: b[:0].view(0, 1).expand(0, 5)),
    ((), (), lambda b: b[0]),
])
def test_legitimate_views_still_decode(size, stride, want):
    base = torch.arange(4, dtype=torch.float32)
    state = decode_te_extra_state(payload(scale_fwd=_view(_typed(base.clone()), 0, size, stride)))
    got = state["scale_fwd"]
    assert got.shape == want(base).shape and torch.equal(got, want(base).contiguous())
    if got.numel():
        assert got.untyped_storage().nbytes() == got.numel() * 4  # owns exactly its elements


@pytest.mark.sandbox
def test_zero_stride_bomb_under_address_space_limit():
    """The 2**28-element view over one element, decoded and saved, in a 3.5 GiB child."""
    result = run_limited("""
        import pickle, torch
        from collections import OrderedDict
        class R:
            def __init__(self, fn, args): self.fn, self.args = fn, args
            def __reduce__(self): return (self.fn, self.args)
        st = torch.storage.TypedStorage(wrap_storage=torch.ones(1).untyped_storage(), dtype=torch.float32,
                                        _internal=True)
        sizes = [((1 << 28,), (0,)), ((1 << 40,), (0,)), ((1 << 61, 4), (0, 0))]
        payloads = [torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": R(torch._utils._rebuild_tensor_v2,
                    (st, 0, s, d, False, OrderedDict()))})), dtype=torch.uint8) for s, d in sizes]
        from te_serial.te.extra_state import decode_te_extra_state
        def decode_all():
            errors = []
            for p in payloads:
                try:
                    decode_te_extra_state(p, where="m._extra_state")
                except te_serial.CheckpointError as e:
                    errors.append(e)
            assert len(errors) == len(payloads), errors
            raise errors[0]
        report(decode_all)
        import tempfile
        d = tempfile.mkdtemp()
        report(lambda: te_serial.save_quantized({"m._extra_state": payloads[0], "w": torch.ones(2)}, d + "/ck"))
    """)
    assert_refused_in_child(result, "m._extra_state", "reaching past its storage", rss=64 << 20)


def test_save_quantized_refuses_a_hostile_view_and_writes_nothing(tmp_path):
    bad = payload(scale_fwd=_view(_typed(torch.ones(1)), 0, (1 << 28,), (0,)))
    with pytest.raises(UnsafeExtraStateError, match="fc._extra_state"):
        te_serial.save_quantized({"fc._extra_state": bad, "fc.weight": torch.ones(2)}, tmp_path / "ck")
    assert not (tmp_path / "ck" / "te_serial.msgpack").exists()


# --------------------------------------------------------------------------- class 2: CPU bombs


def _noop_pickle(unit: bytes, n: int) -> bytes:
    return b"\x80\x04" + unit * n + pickle.dumps({}, protocol=4)[2:]


@pytest.mark.parametrize("make, needle", [
    (lambda: pickle.dumps({"extra_fp8_variables": {"x": [0] * 4_000_000}}), "budget"),
    (lambda: pickle.dumps({"extra_fp8_variables": {"x": [[0]] * 1_000_000}}), "budget"),
    (lambda: _noop_pickle(b"(1", 2_000_000), "budget"),                 # MARK, POP_MARK
    (lambda: _noop_pickle(b"\x80\x04", 2_000_000), "budget"),           # PROTO
    (lambda: _noop_pickle(b"N0", 2_000_000), "budget"),                 # NONE, POP
    (lambda: _noop_pickle(b"N\x94h\x000", 1_000_000), "budget"),        # memo churn
    (lambda: _noop_pickle(b"\x95" + struct.pack("<Q", 0), 500_000), "budget"),  # empty FRAMEs
])
def test_cpu_bombs_are_refused_fast(make, needle):
    data = make()
    assert len(data) <= 9 << 20
    refuse(as_tensor(data), needle, seconds=FAST_S, peak=64 << 20)


def test_a_payload_gets_at_most_its_share_of_a_shared_budget():
    """One decode spends at most MAX_PAYLOAD_WORK, however large the checkpoint's budget."""
    budget = ExtraStateBudget(1 << 40)
    data = pickle.dumps({"extra_fp8_variables": {"x": [0] * (MAX_PAYLOAD_WORK + 10)}})
    refuse(as_tensor(data), "budget", budget=budget)
    assert budget.work <= MAX_PAYLOAD_WORK + 1 and budget.max_work > MAX_PAYLOAD_WORK


def test_budget_is_for_the_whole_checkpoint_not_per_entry():
    """Entries that each fit alone exhaust one checkpoint's budget together."""
    one = as_tensor(pickle.dumps({"extra_fp8_variables": {"x": [0] * 10_000}}))
    budget = ExtraStateBudget(4096)  # a tiny checkpoint: 65,536 + 1,024 steps in all
    decoded = 0
    with pytest.raises(UnsafeExtraStateError, match="budget"):
        for _ in range(100):
            decode_te_extra_state(one, where=KEY, budget=budget)
            decoded += 1
    assert 2 <= decoded <= 7, decoded


def test_check_extra_state_charges_every_value():
    budget = ExtraStateBudget(0)
    state = {"recipe": None, "extra_fp8_variables": {"x": [[1, 2]] * 40_000}}
    t0 = time.process_time()
    with pytest.raises(UnsafeExtraStateError, match="budget"):
        check_extra_state(state, where=KEY, budget=budget)
    assert time.process_time() - t0 < FAST_S


# --------------------------------------------------------------------------- class 1 (decoder side): bytes


def test_one_storage_viewed_many_times_is_bounded():
    """Slices of one 1 MiB storage, each a copy: charged, refused past 2 x payload + 16 MiB."""
    st_ = _typed(torch.zeros(1 << 18))  # 1 MiB, pickled once (memoized), viewed 400 times
    views = [_view(st_, 1, ((1 << 18) - 1,), (1,)) for _ in range(400)]
    data = pickle.dumps({"extra_fp8_variables": {}, "v": views})
    assert len(data) < (1 << 20) + 50_000
    refuse(as_tensor(data), "bytes", peak=64 << 20, seconds=5.0)


def test_nested_storage_bytes_parsed_many_times_are_bounded():
    """The same nested torch.save blob REDUCE'd 400 times: each parse's copy is charged."""
    fn, (blob,) = _typed(torch.zeros(1 << 18)).__reduce__()  # what pickling a storage writes
    assert fn is torch.storage._load_from_bytes
    storages = [_R(torch.storage._load_from_bytes, (blob,)) for _ in range(400)]
    data = pickle.dumps({"extra_fp8_variables": {}, "v": [_view(s, 0, (16,), (1,)) for s in storages]})
    assert len(data) < (1 << 20) + 100_000
    refuse(as_tensor(data), "bytes", peak=64 << 20, seconds=5.0)


@pytest.mark.sandbox
def test_storage_multiplication_under_address_space_limit():
    result = run_limited("""
        import pickle, torch
        from collections import OrderedDict
        class R:
            def __init__(self, fn, args): self.fn, self.args = fn, args
            def __reduce__(self): return (self.fn, self.args)
        st = torch.storage.TypedStorage(wrap_storage=torch.zeros(1 << 20).untyped_storage(),
                                        dtype=torch.float32, _internal=True)  # 4 MiB
        views = [R(torch._utils._rebuild_tensor_v2, (st, 1, ((1 << 20) - 1,), (1,), False, OrderedDict()))
                 for _ in range(1000)]  # 4 GiB once materialized
        p = torch.frombuffer(bytearray(pickle.dumps({"v": views})), dtype=torch.uint8)
        from te_serial.te.extra_state import decode_te_extra_state
        report(lambda: decode_te_extra_state(p, where="m._extra_state"))
    """)
    assert_refused_in_child(result, "m._extra_state", "bytes", rss=200 << 20)


# --------------------------------------------------------------------------- class 4: leaked exception classes


@pytest.mark.parametrize("field", ["__class__", "__init__", "__reduce_ex__", "__reduce__", "__getstate__",
                                   "__dict__", "a b", ""])
def test_recipe_fields_named_like_dunders_are_refused(field):
    refuse(as_tensor(recipe_pickle(fields_pickle({"margin": 0, field: 1}))), "field name")


def test_dunder_field_added_to_the_instance_dict_after_build_is_refused():
    """BUILD checks the dict it gets; a later SETITEM on the same (memoized) dict is caught too."""
    key = b"__reduce_ex__"
    after = b"h\x00" + b"X" + struct.pack("<I", len(key)) + key + b"K\x01s0"  # BINGET 0; SETITEM; POP
    data = recipe_pickle(fields_pickle({"margin": 0}), after_build=after)
    refuse(as_tensor(data), "__reduce_ex__")


@pytest.mark.parametrize("bad", [{"__reduce_ex__": 1}, {"__class__": "x"}, {"not an identifier": 1}])
def test_encode_refuses_dunder_fields_with_te_serials_error(bad):
    state = {"recipe": {"__class__": "DelayedScaling", "fields": {"margin": 0, **bad}},
             "extra_fp8_variables": {}}
    with pytest.raises(UnsupportedValueError) as info:
        encode_te_extra_state(state, where=KEY)
    assert not isinstance(info.value, TEUnavailableError)
    with pytest.raises(UnsafeExtraStateError, match="field name"):
        check_extra_state(state, where=KEY)


def _zip_payload(**kw) -> bytes:
    buf = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(2), "extra_fp8_variables": {}}, buf, **kw)
    return buf.getvalue()


def _patch_zip(data: bytes, *, central: dict, local: dict | None = None) -> bytes:
    """Set little-endian u16 fields at offsets of every central (and local) header."""
    out = bytearray(data)
    for sig, fields in ((b"PK\x01\x02", central), (b"PK\x03\x04", local or {})):
        pos = out.find(sig)
        while pos >= 0:
            for off, value in fields.items():
                out[pos + off:pos + off + 2] = struct.pack("<H", value)
            pos = out.find(sig, pos + 4)
    return bytes(out)


@pytest.mark.parametrize("patch, needle", [
    (dict(central={6: 99}, local={4: 99}), "unreadable zip"),              # "version needed" 9.9
    (dict(central={10: 99}, local={8: 99}), "compressed or encrypted"),    # unknown method
    (dict(central={10: 12}, local={8: 12}), "compressed or encrypted"),    # bzip2
    (dict(central={8: 1}, local={6: 1}), "compressed or encrypted"),       # encrypted
    (dict(central={8: 0x40}, local={6: 0x40}), "compressed or encrypted"), # strong encryption
])
def test_zip_payloads_zipfile_would_not_read_are_refused(patch, needle):
    good = _zip_payload()
    assert decode_te_extra_state(io.BytesIO(good))["scale_fwd"].tolist() == [1.0, 1.0]
    bad = _patch_zip(good, **patch)
    refuse(io.BytesIO(bad), needle)
    refuse(bad, needle)  # raw bytes of a zip are recognized too


def test_zip_with_too_many_entries_is_refused_before_zipfile_lists_them():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(MAX_ZIP_ENTRIES + 1):
            zf.writestr(f"archive/x{i}", b"")
        zf.writestr("archive/data.pkl", pickle.dumps({}))
    refuse(io.BytesIO(buf.getvalue()), "central directory entries")


def test_meta_extra_state_is_refused_cleanly():
    refuse(torch.empty(400, dtype=torch.uint8, device="meta"), "meta device")


@pytest.mark.parametrize("state, field", [
    ({"scale_fwd": torch.empty(3, device="meta")}, "scale_fwd"),
    ({"amax_history_fwd": torch.ones(4, 3), "extra_fp8_variables": {"h": [torch.empty(1 << 24, device="meta")]}},
     "extra_fp8_variables.h.0"),
])
def test_encode_refuses_a_meta_tensor_naming_the_tensor_and_the_field(state, field):
    """A meta tensor has no bytes for TE's extra state: the encoder refuses it (it used to write zeros
    of its shape, allocating memory for bytes that exist nowhere), naming the extra state and the
    value's path in it, before anything is allocated or pickled."""
    tracemalloc.start()
    try:
        with pytest.raises(UnsupportedValueError) as info:
            encode_te_extra_state(state, where=KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = info.value
    assert isinstance(err, CheckpointError) and err.tensor == KEY and err.field == field, err
    assert "meta device" in str(err)
    assert peak < PEAK  # the 64 MiB meta tensor above was neither stood in for nor pickled


@pytest.mark.parametrize("data, needle", [
    (pickle.dumps([1, 2]), "is a list"),
    (pickle.dumps("just a string"), "is a str"),
    (pickle.dumps({"recipe": [1]}), "not a recipe object"),
    (pickle.dumps({"extra_fp8_variables": {1.5: 0}}), "only str and int keys"),
    (pickle.dumps({"extra_fp8_variables": {(1, 2): 0}}), "only str and int keys"),
])
def test_malformed_extra_state_is_refused(data, needle):
    refuse(as_tensor(data), needle)


def test_unknown_recipe_class_is_refused():
    data = (b"\x80\x02}X\x06\x00\x00\x00recipec" + RECIPE_MODULE.encode() + b"\nPopen\n)\x81}bs.")
    refuse(as_tensor(data), RECIPE_MODULE + ".Popen")
    with pytest.raises(UnsafeExtraStateError, match="unknown recipe class"):
        check_extra_state({"recipe": {"__class__": "DelayedScaling", "fields": {
            "x": {"__class__": "Popen", "fields": {}}}}}, where=KEY)


def test_huge_values_in_messages_are_truncated():
    """A refusal quotes hostile values, never megabytes of them."""
    big = "x" * (8 << 20)
    msg = refuse(as_tensor(b"\x80\x04\x8d" + struct.pack("<Q", len(big)) + big.encode() + b"\x8c\x01y\x93."),
                 "GLOBAL", peak=80 << 20)
    assert len(msg) < 1000
    msg = refuse(as_tensor(pickle.dumps({"recipe": [b"y" * (1 << 20)] * 3})), "not a recipe object", peak=24 << 20)
    assert len(msg) < 1000


# --------------------------------------------------------------------------- class 6: fuzz


def _seeds() -> list:
    """Real payloads: TE 2.x pickles (with TE's own recipe classes), TE 1.x pickles and BytesIO
    (zip and legacy torch.save)."""
    gen = torch.Generator().manual_seed(0)
    te1x = {"scale_fwd": torch.rand(3, generator=gen), "scale_inv_fwd": torch.rand(3, generator=gen),
            "amax_history_fwd": torch.rand(4, 3, generator=gen), "scale_bwd": torch.rand(2, generator=gen),
            "scale_inv_bwd": torch.rand(2, generator=gen), "amax_history_bwd": torch.rand(4, 2, generator=gen),
            "extra_fp8_variables": {"num_gemms": 1, "name": "fc1", "shape": (8, 16), "stack": [7, 8]}}
    seeds = [("pickle", pickle.dumps(te1x))]
    for zip_format in (True, False):
        buf = io.BytesIO()
        torch.save(te1x, buf, _use_new_zipfile_serialization=zip_format)
        seeds.append(("bytesio", buf.getvalue()))
    if TE is not None:
        import transformer_engine.common.recipe as R
        te2 = {"recipe": R.DelayedScaling(margin=1, fp8_format=R.Format.E4M3, amax_history_len=4), **{
            k: v for k, v in te1x.items() if not k.startswith("scale_inv")}}
        seeds.append(("pickle", pickle.dumps(te2)))
        seeds.append(("pickle", pickle.dumps({**te2, "extra_fp8_variables": {
            **te2["extra_fp8_variables"], "local_recipes": [R.Float8CurrentScaling(), R.MXFP8BlockScaling()]}})))
    return seeds


SEEDS = _seeds()

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("copy"), st.integers(0, 1 << 20), st.integers(0, 1 << 20)),
    st.tuples(st.just("int"), st.integers(0, 1 << 20), st.sampled_from(
        [0, 1, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 28, 1 << 40, (1 << 62) - 1, (1 << 63) - 1])),
)


def _mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for op, pos, arg in mutations:
        if not out:
            break
        pos %= len(out)
        if op == "flip":
            out[pos] ^= arg
        elif op == "set":
            out[pos] = arg
        elif op == "insert":
            out[pos:pos] = arg
        elif op == "delete":
            del out[pos:pos + arg]
        elif op == "truncate":
            del out[pos:]
        elif op == "copy":
            src = arg % len(out)
            out[pos:pos] = out[src:src + 32]
        elif op == "int":  # a size/length/stride field
            out[pos:pos + 8] = struct.pack("<Q", arg)
    return bytes(out)


def _trap(*a, **k):
    raise AssertionError("the decoder reached an unpickler")


@pytest.mark.fuzz
@settings(max_examples=3000 if FUZZ_LONG else 150, deadline=timedelta(seconds=3), derandomize=not FUZZ_LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.sampled_from(range(len(SEEDS))), mutations=st.lists(_mutation, min_size=1, max_size=6))
def test_fuzz_decoder_raises_only_te_serial_errors(seed, mutations):
    kind, data = SEEDS[seed]
    bad = _mutate(data, mutations)
    value = io.BytesIO(bad) if kind == "bytesio" else as_tensor(bad) if bad else torch.empty(0, dtype=torch.uint8)
    with mock.patch.object(pickle, "loads", _trap), mock.patch.object(pickle, "load", _trap), \
            mock.patch.object(pickle, "Unpickler", _trap), mock.patch.object(torch, "load", _trap):
        try:
            state = decode_te_extra_state(value, where=KEY)
        except UnsafeExtraStateError as e:
            assert KEY in str(e) and len(str(e)) < 4000
            return
    assert state is None or type(state) is dict
    if state is None:
        return
    check_extra_state(state, where=KEY)
    for t in state.values():
        if isinstance(t, torch.Tensor):
            assert t.untyped_storage().nbytes() <= max(t.numel() * t.element_size(), 0) or t.numel() == 0
    try:
        again = encode_te_extra_state(state, where=KEY)
    except UnsupportedValueError:  # TEUnavailableError, or a value pickle cannot carry back
        return
    decode_te_extra_state(again, where=KEY)


def test_fuzz_seeds_decode():
    for kind, data in SEEDS:
        value = io.BytesIO(data) if kind == "bytesio" else as_tensor(data)
        state = decode_te_extra_state(value, where=KEY)
        assert state["scale_fwd"].shape == (3,)
