"""convert's three-stage pipeline, its ``stats`` modes and its ``device`` choice."""

from __future__ import annotations

import dataclasses
import importlib
import math
import threading

import pytest
import torch
from safetensors.torch import save_file

import te_serial as ts
from te_serial import errors as tse
from te_serial.conversion.pipeline import run_pipeline
from te_serial.formats import QuantizedTensorStorage
from te_serial.conversion.transforms import SAMPLE_SHARE, SAMPLE_WINDOWS, sample_rows

from _convert_data import randn

tc = importlib.import_module("te_serial.conversion")
core = importlib.import_module("te_serial.conversion.core")


# --- the pipeline ----------------------------------------------------------------------------------

def test_pipeline_keeps_order_and_runs_stages_on_their_threads():
    seen: list[tuple[str, int, str]] = []
    main = threading.current_thread().name

    def read(i):
        seen.append(("read", i, threading.current_thread().name))
        return i * 10

    def compute(i, data):
        seen.append(("compute", i, threading.current_thread().name))
        return data + 1

    written = []

    def write(i, r):
        seen.append(("write", i, threading.current_thread().name))
        written.append((i, r))

    run_pipeline(list(range(6)), read, compute, write)
    assert written == [(i, i * 10 + 1) for i in range(6)]
    assert {t for s, _, t in seen if s == "compute"} == {main}
    assert all(t.startswith("te-serial-read") for s, _, t in seen if s == "read")
    assert all(t.startswith("te-serial-write") for s, _, t in seen if s == "write")
    # bounded: a read is never more than one item ahead of the compute
    order = [(s, i) for s, i, _ in seen]
    for i in range(2, 6):
        assert order.index(("read", i)) > order.index(("compute", i - 2))


def test_pipeline_computes_on_while_writes_within_the_budget_wait():
    """A slow write of a large item does not stall the compute of the small ones after it, as
    long as the results waiting for the writer stay within the byte budget; beyond it, compute waits."""
    release = threading.Event()
    computed, written = [], []
    sizes = {0: 100, 1: 10, 2: 10, 3: 10, 4: 100}

    def compute(i, d):
        computed.append(i)
        if i == 3:
            release.set()  # items 1-3 were computed while item 0's write waited
        return d

    def write(i, r):
        if i == 0:
            assert release.wait(10), "compute stalled behind the first write"
        written.append(i)

    run_pipeline(list(range(5)), lambda i: i, compute, write, size=sizes.__getitem__, write_budget=200)
    assert written == list(range(5)) and computed == list(range(5))

    # without room in the budget, compute waits for the write in flight: never two results pending
    pending = []

    def compute2(i, d):
        pending.append(i)
        assert len(pending) - len(written2) <= 2  # the write in flight and this result
        return d

    written2 = []
    run_pipeline(list(range(6)), lambda i: i, compute2, lambda i, r: written2.append(i),
                 size=lambda i: 100, write_budget=100)
    assert written2 == list(range(6))


@pytest.mark.parametrize("budget", [0, 10**9])
@pytest.mark.parametrize("stage", ["read", "compute", "write"])
def test_pipeline_raises_the_first_error_after_both_threads_stop(stage, budget):
    written = []

    def fail_at(s, i):
        if s == stage and i == 3:
            raise ValueError(f"{s} {i}")

    def read(i):
        fail_at("read", i)
        return i

    def compute(i, d):
        fail_at("compute", i)
        return d

    def write(i, r):
        fail_at("write", i)
        written.append(i)

    with pytest.raises(ValueError, match=f"{stage} 3"):
        run_pipeline(list(range(8)), read, compute, write, size=lambda i: 1, write_budget=budget)
    assert [t.name for t in threading.enumerate() if t.name.startswith("te-serial-")] == []
    assert written == [0, 1, 2]       # nothing after the failure is written


def test_a_failed_write_names_the_tensor_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    src.mkdir()
    save_file({f"l{i}.weight": randn((64, 64), i) for i in range(5)}, str(src / "model.safetensors"))
    dst = tmp_path / "out"
    tc.convert(src, dst, recipe="fp8_current")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    real = core._Output.write

    def broken(self, plan, out):
        if plan.name == "l3.weight":
            raise OSError(28, "No space left on device")
        return real(self, plan, out)

    monkeypatch.setattr(core._Output, "write", broken)
    with pytest.raises(tse.ConversionError) as e:
        tc.convert(src, dst, recipe="mxfp8", overwrite=True)
    assert e.value.tensor == "l3.weight" and "No space left" in str(e.value)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


# --- stats modes -----------------------------------------------------------------------------------

def test_sample_rows_are_aligned_spread_and_about_a_sixteenth():
    q = ts.MXFP8Quantizer(torch.float8_e4m3fn)
    t = q(torch.randn(4096, 64))
    rows = sample_rows((4096, 64), t)
    align = q.slice_alignment()[0]
    assert len(rows) == SAMPLE_WINDOWS
    assert all(a % align == 0 and b % align == 0 and 0 <= a < b <= 4096 for a, b in rows)
    assert rows[0][0] == 0 and rows[-1][1] == 4096                      # both ends are looked at
    covered = sum(b - a for a, b in rows)
    assert SAMPLE_SHARE * 4096 <= covered <= 2 * SAMPLE_SHARE * 4096
    assert sample_rows((64, 64), t) is None                             # too small: all rows
    assert sample_rows((4096,), torch.randn(4096)) is None              # 1-D: all of it


@pytest.fixture(scope="module")
def mixed_source(tmp_path_factory):
    """A te-serial checkpoint: one MXFP8 weight (exact path to mxfp8 rowwise) and one BF16 weight
    (quantized: lossy), both tall enough to be sampled."""
    root = tmp_path_factory.mktemp("stats")
    w = randn((2048, 256), 1, scale=1.0)
    sd = {"a.weight": ts.MXFP8Quantizer(torch.float8_e4m3fn)(randn((2048, 256), 2, scale=1.0)), "b.weight": w}
    ts.save_quantized(sd, root / "src")
    return root / "src"


@pytest.mark.parametrize("mode", ["full", "sample", "none"])
def test_stats_modes(mixed_source, tmp_path, mode):
    rules = {"*": "mxfp8"}
    rep = tc.convert(mixed_source, tmp_path / mode, rules=rules, usages="rowwise", stats=mode)
    full = tc.convert(mixed_source, tmp_path / "ref", rules=rules, usages="rowwise", overwrite=True)
    a, b = rep["a.weight"], rep["b.weight"]
    assert a.label == "lossless" and a.stats == "full"                 # exact paths: checked in full
    assert b.label == "lossy" and b.stats == mode and rep.stats == mode
    fb = full["b.weight"]
    if mode == "none":
        assert math.isnan(b.max_abs_err) and math.isnan(b.snr_db)
        assert "not measured" in rep.table() and "not measured" in rep.summary()
    else:
        assert 0 < b.max_abs_err <= fb.max_abs_err                     # a sample never finds more
        assert b.rel_rmse == pytest.approx(fb.rel_rmse, rel=0.2)
    if mode == "sample":
        assert "(sampled)" in rep.table()
    back = tc.ConversionReport.from_dict(rep.to_dict())                 # JSON keeps the mode
    assert back.stats == mode and back["b.weight"].stats == mode
    assert ts.load_quantized(tmp_path / mode)["b.weight"].buffers().keys() == \
        ts.load_quantized(tmp_path / "ref")["b.weight"].buffers().keys()


@pytest.mark.parametrize("mode", ["full", "sample", "none"])
def test_lossless_paths_are_verified_in_full_in_every_mode(mixed_source, tmp_path, monkeypatch, mode):
    """A wrong byte in a row no sample looks at still turns an exact path's label to lossy."""
    real = core.execute
    rows = sample_rows((2048, 256), ts.load_quantized(mixed_source)["a.weight"])
    looked = {r for a, b in rows for r in range(a, b)}
    row = next(r for r in range(100, 2048) if r not in looked)

    def corrupt(step, src, x_fn):
        out, step = real(step, src, x_fn)
        if isinstance(out, QuantizedTensorStorage) and step.exact:
            data = out.buffers()["_rowwise_data"].clone()  # (a copy: the output may share the source's bytes)
            data.view(torch.uint8)[row, 7] ^= 0x01
            out = out._rebuild({**out.buffers(), "_rowwise_data": data})
        return out, step

    monkeypatch.setattr(core, "execute", corrupt)
    rep = tc.convert(mixed_source, tmp_path / "o", rules={"*": "mxfp8"}, usages="rowwise", stats=mode)
    a = rep["a.weight"]
    assert a.label == "lossy" and a.stats == "full" and "expected an exact path" in a.note


def test_bad_stats_and_device_values_are_clear_errors(mixed_source, tmp_path):
    with pytest.raises(tse.ConversionError, match="stats must be one of"):
        tc.convert(mixed_source, tmp_path / "o", recipe="mxfp8", stats="most")
    with pytest.raises(tse.ConversionError, match="not a device"):
        tc.convert(mixed_source, tmp_path / "o", recipe="mxfp8", device="gpu9")
    if not torch.cuda.is_available():
        with pytest.raises(tse.ConversionError, match="CUDA is not available"):
            tc.convert(mixed_source, tmp_path / "o", recipe="mxfp8", device="cuda")
    assert not (tmp_path / "o").exists()


def test_default_device_is_recorded(mixed_source, tmp_path):
    rep = tc.convert(mixed_source, tmp_path / "o", recipe="mxfp8")
    assert rep.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert tc.ConversionReport.from_dict(rep.to_dict()).device == rep.device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "fp8_block", "nvfp4"])
def test_cuda_convert_writes_the_cpu_bytes(mixed_source, tmp_path, recipe):
    cpu = tc.convert(mixed_source, tmp_path / "cpu", recipe=recipe, device="cpu")
    gpu = tc.convert(mixed_source, tmp_path / "gpu", recipe=recipe, device="cuda")
    assert gpu.device.startswith("cuda") and [t.label for t in gpu.tensors] == [t.label for t in cpu.tensors]
    a, b = ts.load_quantized(tmp_path / "cpu"), ts.load_quantized(tmp_path / "gpu")
    for name, t in a.items():
        for k, buf in t.buffers().items():
            assert torch.equal(buf.view(torch.uint8), b[name].buffers()[k].view(torch.uint8)), (name, k)


def test_full_stats_by_row_windows_equal_the_whole_tensor_comparison(monkeypatch):
    """"full" statistics dequantize a window of rows at a time (bounded memory) and give the figures
    one comparison of the whole tensors gives."""
    from te_serial.conversion import transforms as tr
    x = randn((1024, 256), 5, scale=1.0).float()
    x[7, 3] = float("inf")
    t = ts.MXFP8Quantizer(torch.float8_e4m3fn)(x)
    monkeypatch.setattr(tr, "FULL_WINDOW_BYTES", 64 * 256 * 4)
    rows = tr.all_rows(tuple(x.shape), t)
    assert len(rows) == 16 and rows[0] == (0, 64) and rows[-1] == (960, 1024)
    for u in ("rowwise", "columnwise"):
        whole = tr.compare(x, tr.values(t, u))
        [windows] = tr.compare_rows(lambda r: tr.rows_of(x, r), [lambda r: tr.values(t, u, rows=r)], rows)
        assert windows.exact == whole.exact and windows.max_abs_err == whole.max_abs_err
        # the sums are fp32 dot products per chunk: other chunk bounds, other last bits
        assert windows.rel_rmse == pytest.approx(whole.rel_rmse, rel=1e-5)
        assert windows.snr_db == pytest.approx(whole.snr_db, rel=1e-5)


def test_outputs_compared_in_one_pass_get_the_figures_of_one_pass_each():
    """compare_rows widens the reference and sums its squares once for several outputs: each
    output's figures are bit for bit those of its own comparison, whatever the others hold (a
    non-finite value masks the reference for that output only; an fp32 overflow goes to fp64)."""
    from te_serial.conversion import transforms as tr
    x = randn((512, 256), 7, scale=1.0)                       # BF16: widened once per chunk
    near = x.float() + randn((512, 256), 8, scale=0.01).float()
    holes = near.clone()
    holes[3, 4], holes[300, 7] = float("inf"), float("nan")   # masked: its own Σx²
    same = x.float()                                          # exact
    huge = x.float() * 3e19                                   # Σd² overflows fp32
    outs = [near, holes, same, huge]
    rows = [(0, 128), (128, 512)]
    together = tr.compare_rows(lambda r: tr.rows_of(x, r), [lambda r, o=o: tr.rows_of(o, r) for o in outs], rows)
    for o, got in zip(outs, together):
        [alone] = tr.compare_rows(lambda r: tr.rows_of(x, r), [lambda r: tr.rows_of(o, r)], rows)
        assert dataclasses.asdict(got) == dataclasses.asdict(alone)
    assert together[2].exact and not together[0].exact and together[1].max_abs_err == math.inf
    assert math.isfinite(together[3].rel_rmse) and together[3].rel_rmse > 1e18


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_compare_exactness_is_on_the_bits(chunk):
    """compare settles exactness on the bits: a finite difference anywhere is lossy at once;
    where every difference is 0 or non-finite, -0.0 against 0.0 is not exact, NaN against NaN at the
    same places is, and a NaN or infinity against a number makes the max error infinite."""
    from te_serial.conversion import transforms as tr
    x = torch.tensor([1.0, -2.0, 0.0, float("inf"), float("nan"), 3.5, -0.0, 7.0])
    assert tr.compare(x, x.clone(), chunk).exact
    for i, v in [(2, -0.0), (6, 0.0)]:  # d == 0 everywhere, the bits differ
        y = x.clone()
        y[i] = v
        got = tr.compare(x, y, chunk)
        assert not got.exact and got.max_abs_err == 0.0
    y = x.clone()
    y[7] = 7.000001
    got = tr.compare(x, y, chunk)
    assert not got.exact and got.max_abs_err == pytest.approx(1e-6, rel=0.1)
    for i, v in [(4, 1.0), (0, float("nan")), (3, float("-inf")), (5, float("inf"))]:
        y = x.clone()
        y[i] = v
        got = tr.compare(x, y, chunk)
        assert not got.exact and got.max_abs_err == math.inf, (i, v)


@pytest.mark.parametrize("case", ["lossy", "inf", "nan", "exact", "signed_zero", "huge"])
def test_compiled_comparison_gives_the_eager_figures(case, monkeypatch):
    """Large comparisons (≥ fused.MIN_NUMEL) settle a lossy result in one compiled pass; whatever
    it cannot settle (non-finite values, no difference, Σd² beyond fp32's range) goes to the
    chunked comparison, so every case gets the eager path's exactness and errors."""
    from te_serial.conversion import transforms as tr
    from te_serial.formats import fused
    n = fused.MIN_NUMEL + 12345
    x = randn((n,), 11, scale=1.0)                                   # BF16 reference
    y = x.float() + randn((n,), 12, scale=0.01).float()
    if case == "inf":
        y[n // 3] = float("inf")
    elif case == "nan":
        y[5] = float("nan")
    elif case == "exact":
        y = x.float()
    elif case == "signed_zero":
        y = x.float()
        x[17], y[17] = 0.0, -0.0
    elif case == "huge":
        y = x.float() * 3e19                                           # Σd² beyond fp32's range
    settled = []
    real = tr._Comparison._settle
    monkeypatch.setattr(tr._Comparison, "_settle", lambda self, a, b: settled.append(real(self, a, b)) or settled[-1])
    with fused.policy("fused"):
        got = tr.compare(x, y)
    assert settled == [case == "lossy"]  # one compiled pass; the rest go chunked
    with fused.policy("eager"):
        want = tr.compare(x, y)
    assert got.exact == want.exact and got.max_abs_err == want.max_abs_err
    assert got.rel_rmse == pytest.approx(want.rel_rmse, rel=1e-4)
    assert got.snr_db == pytest.approx(want.snr_db, rel=1e-4, abs=1e-6)
    assert not fused.failures()


def test_a_conversion_runs_with_the_process_objects_frozen_for_the_gc(tmp_path):
    """``convert`` runs with what the process held before frozen for the cyclic GC (a MoE's thousands of
    per-expert objects would otherwise set off full passes over a heap as large as transformers'), and
    unfreezes it after, also when it fails; a process that froze objects itself keeps its freeze."""
    import gc
    from te_serial.checkpoint.header import old_objects_frozen
    save_file({"w": randn(64, 64)}, tmp_path / "m.safetensors")
    held = []
    real = core.open_source
    core_open = lambda *a, **kw: held.append(gc.get_freeze_count()) or real(*a, **kw)   # noqa: E731
    try:
        core.open_source = core_open
        ts.convert(tmp_path / "m.safetensors", tmp_path / "out.safetensors", recipe="mxfp8")
        with pytest.raises(tse.TeSerialError):   # fails inside, once the source is open
            ts.convert(tmp_path / "m.safetensors", tmp_path / "bad.safetensors", recipe="no_such_recipe")
    finally:
        core.open_source = real
    assert len(held) == 2 and all(n > 0 for n in held) and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with old_objects_frozen():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("fails inside")
    assert gc.get_freeze_count() == 0
    calls = []
    gc.freeze()
    try:
        # the count itself can drop as frozen objects are freed by reference counting, so watch the calls
        real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
        gc.freeze, gc.unfreeze = (lambda: calls.append("freeze")), (lambda: calls.append("unfreeze"))
        try:
            with old_objects_frozen():
                pass
        finally:
            gc.freeze, gc.unfreeze = real_freeze, real_unfreeze
        assert calls == [] and gc.get_freeze_count() > 0   # the caller's own freeze, left as it was
    finally:
        gc.unfreeze()
