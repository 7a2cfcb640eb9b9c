"""The compiled (fused) quantize / dequantize path: bytes equal the eager path and the oracle.

Every compiled graph costs seconds of inductor + C++ compile on 2 cores, so the CI set is a few
configurations chosen to cover every format family, both FP8 dtypes, the three input dtypes and
each usage set once, on two shapes of its case (one shape class: one graph each for quantize and
dequantize, dynamic shapes) and every adversarial input. ``TE_SERIAL_FUSED_FULL=1`` runs every format × usage ×
FP8 dtype × input dtype of ``test_formats_exact``'s table (slow: hundreds of graphs).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings

import pytest
import torch

import te_serial as ts
from te_serial.formats import fused
from te_serial.recipes import RECIPES, recipe_quantizer
from reference import te_reference as ref
from helpers import INPUT_KINDS, assert_same_buffers, make_input, needs_cuda, same_values
from test_formats_exact import CASES, USAGES

FULL = os.environ.get("TE_SERIAL_FUSED_FULL", "") not in ("", "0")
IN_DTYPES = (torch.bfloat16, torch.float32, torch.float16)

#: (case name in test_formats_exact.CASES, usage, input dtype): each family, both FP8 dtypes, each
#: usage set and each input dtype at least once
CI_SET = [
    ("fp8cs-torch.float8_e4m3fn-pow2=False", "both", torch.bfloat16),
    ("fp8delayed-torch.float8_e5m2", "col", torch.float32),
    ("mxfp8-torch.float8_e4m3fn-2d=False", "both", torch.bfloat16),
    ("block1d-torch.float8_e4m3fn-pow2=True", "both", torch.bfloat16),
    ("block2d-torch.float8_e5m2-pow2=False", "col", torch.float32),
    ("nvfp4-2d=False", "both", torch.bfloat16),
    ("nvfp4-2d=True", "row", torch.float16),
    # 2-D tiles, both usages: the columnwise codes are the rowwise ones (copied or repacked), cast once
    ("mxfp8-torch.float8_e4m3fn-2d=True", "both", torch.bfloat16),
    ("nvfp4-2d=True", "both", torch.bfloat16),
    # E5M2 from 16-bit inputs: the graphs' cast is the native C loop (te_serial.native.scale_cast_fp8)
    ("mxfp8-torch.float8_e5m2-2d=False", "both", torch.float16),
    ("block1d-torch.float8_e5m2-pow2=False", "both", torch.bfloat16),
]


def _shapes(shapes):
    """In the CI run, the case's first two shapes (a 2-D and a 3-D one, mostly one shape class) whose
    2-D view has no dim of 1 (a graph of its own); all of them with TE_SERIAL_FUSED_FULL."""
    return shapes if FULL else [s for s in shapes if min(math.prod(s[:-1]), s[-1]) > 1][:2]
_BY_NAME = {c[0]: c for c in CASES}


def _params():
    if FULL:
        return [pytest.param(name, usage, dt, marks=pytest.mark.slow, id=f"{name}-{usage}-{str(dt)[6:]}")
                for name in _BY_NAME for usage in USAGES for dt in IN_DTYPES]
    return [pytest.param(name, usage, dt, id=f"{name}-{usage}-{str(dt)[6:]}") for name, usage, dt in CI_SET]


@contextlib.contextmanager
def compiled_only():
    """Force the fused path and fail on any fallback to eager (a compile failure warns)."""
    with fused.policy("fused"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="te_serial: compiled", category=RuntimeWarning)
        yield
    assert not fused.failures(), fused.failures()


@pytest.mark.parametrize("name,usage,in_dtype", _params())
def test_fused_bytes_equal_eager_and_oracle(name, usage, in_dtype):
    _, fmt, make_q, make_ref, shapes = _BY_NAME[name]
    r, c = USAGES[usage]
    q = make_q(r, c)
    assert q.fusable()
    for shape in _shapes(shapes):
        for kind in INPUT_KINDS:
            x = make_input(kind, shape, in_dtype, seed=sum(shape) + len(name))  # stable across runs
            where = f"{name} {shape} {usage} {in_dtype} {kind}"
            eager = q.quantize(x, eager=True)
            with compiled_only():
                got = q.quantize(x)
                dq = got.dequantize(torch.float32)
                dq_nominal = got.dequantize() if FULL or in_dtype == torch.float32 else None  # a graph per dtype
            assert_same_buffers(got.buffers(), eager.buffers(), where + " fused vs eager")
            assert_same_buffers(got.buffers(), make_ref(x, r, c), where + " fused vs oracle")
            fields = {f: getattr(q, f) for f in ("fp8_dtype", "block_scaling_dim") if hasattr(q, f)}
            want_dq = ref.ref_dequantize(fmt, eager.buffers(), tuple(shape), **fields).float()
            assert same_values(dq, eager.dequantize(torch.float32, eager=True)), where + " dequantize"
            assert same_values(dq, want_dq), where + " dequantize vs oracle"
            if dq_nominal is not None:
                assert same_values(dq_nominal, eager.dequantize(eager=True)), where + " dequantize to nominal dtype"


def test_fp4_decode_compiled_bits_equal_the_table():
    """Compiled, E2M1 codes decode by building fp32 bits (vectorizable); eager, by the table. Every
    code, with the high nibble's garbage that an unpacked byte may carry masked off, gives the
    table's bits, -0.0 for code 8 included."""
    from te_serial import numerics as nx
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8) & 0x0F
    table = torch.tensor(nx.FP4_E2M1_VALUES, dtype=torch.float32)
    want = torch.cat([table, -table])[codes.long()]
    compiled = torch.compile(nx.fp4_codes_to_float, backend="inductor", fullgraph=True)
    for got in (nx.fp4_codes_to_float(codes), compiled(codes)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp4_cast_is_nearest_even_compiled_and_eager():
    """E2M1 codes, eager and compiled, are the nearest FP4 value by brute force (ties to the even
    index, saturating at 6, NaN → +6 eagerly), on random fp32 bit patterns, every midpoint and its
    neighbours, ±0 and ±inf."""
    from te_serial import numerics as nx
    g = torch.Generator().manual_seed(3)
    mids = torch.tensor([t for t, _ in nx.E2M1_STEPS])
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0))])
    x = torch.cat([torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
                   .view(torch.float32), near, -near, torch.linspace(-7, 7, 9999),
                   torch.tensor([0.0, -0.0, 6.0, -6.0, float("inf"), -float("inf")])])
    x = x[~torch.isnan(x)]
    table = torch.tensor(nx.FP4_E2M1_VALUES)
    d = (x.abs().clamp(max=6.0)[:, None] - table).abs()
    tied = d == d.min(dim=1, keepdim=True).values
    even = torch.where(tied & (torch.arange(8) % 2 == 0), torch.arange(8), -1).max(dim=1).values
    index = torch.where(tied.sum(dim=1) > 1, even, tied.int().argmax(dim=1))
    want = index.to(torch.uint8) | ((x.view(torch.int32) < 0).to(torch.uint8) << 3)
    compiled = torch.compile(nx.cast_to_fp4_codes, backend="inductor", fullgraph=True)
    assert torch.equal(nx.cast_to_fp4_codes(x), want)
    assert torch.equal(compiled(x), want)
    assert nx.cast_to_fp4_codes(torch.tensor([float("nan"), -float("nan")])).tolist() == [7, 7]


def test_compiles_once_per_shape_class_not_per_tensor():
    """30 tensors of 6 shapes (one square, M and K swapped, one 3-D) through one fresh configuration:
    one quantize graph and one dequantize graph."""
    q = ts.MXFP8Quantizer(torch.float8_e5m2, rowwise=False, columnwise=True)  # used by no other test
    shapes = [(256, 512), (512, 256), (384, 384), (1024, 128), (128, 1024), (2, 256, 384)]
    before = fused.compile_count()
    with compiled_only():
        for i in range(30):
            shape = shapes[i % len(shapes)]
            x = make_input("random", shape, torch.bfloat16, seed=i)
            t = q.quantize(x)
            assert same_values(t.dequantize(torch.float32), q.quantize(x, eager=True).dequantize(
                torch.float32, eager=True))
    compiles = fused.compile_count() - before
    assert compiles == 2, f"{compiles} compiles for 30 tensors of 6 shapes (want: one quantize, one dequantize)"


def test_nan_inputs_run_eager_and_infinities_compile():
    """A compiled graph never sees a NaN (it has no NaN masks): a NaN anywhere, even the last
    element, runs the eager code under policy "fused" and compiles nothing; ±inf alone compiles."""
    q = ts.Float8CurrentScalingQuantizer(torch.float8_e5m2, amax_epsilon=1e-6)  # used by no other test
    x = make_input("random", (256, 384), torch.bfloat16, seed=11)
    for i in (0, x.numel() // 2, x.numel() - 1):
        for nan in (float("nan"), -float("nan")):
            y = x.clone()
            y.view(-1)[i] = nan
            assert fused.nan_free_amaxes(y) is None and fused.nan_free_amaxes(y.float()) is None
            assert fused.nan_free_amaxes(y, 16) is None
            before = fused.compile_count()
            with compiled_only():
                got = q.quantize(y)
            assert fused.compile_count() == before, "a NaN input reached a compiled graph"
            assert_same_buffers(got.buffers(), q.quantize(y, eager=True).buffers(), f"NaN at {i}")
    inf = make_input("infinities", (256, 384), torch.bfloat16, seed=11)
    assert fused.nan_free_amaxes(inf)[fused.TENSOR_AMAX].item() == float("inf")
    assert fused.nan_free_amaxes(inf, 16)[fused.TENSOR_AMAX].item() == float("inf")
    assert fused.nan_free_amaxes(torch.empty(0, 16)) is None
    before = fused.compile_count()
    with compiled_only():
        got = q.quantize(inf)
    assert fused.compile_count() > before
    assert_same_buffers(got.buffers(), q.quantize(inf, eager=True).buffers(), "±inf compiled")


def test_threads_quantize_at_once():
    """Quantizing from 4 worker threads (a user's pool), with the graphs first compiled there while
    the other threads run: every result has the eager bytes, and the one shape class compiles once
    (tools/repro_worker_threads.py runs the longer version of this)."""
    import concurrent.futures
    q = ts.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, amax_epsilon=1e-7)  # no other test
    xs = [make_input(kind, (256 + 128 * (i % 3), 512), torch.bfloat16, seed=40 + i)
          for i, kind in enumerate(["random", "specials", "outliers", "random"] * 2)]
    want = [q.quantize(x, eager=True) for x in xs]

    def work(x):
        with compiled_only():
            return q.quantize(x)
    before = fused.compile_count()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(work, xs))
    assert fused.compile_count() == before + 1
    for i, (t, w) in enumerate(zip(got, want)):
        assert_same_buffers(t.buffers(), w.buffers(), f"tensor {i}, worker thread")


def test_other_threads_run_eager_code_while_one_compiles():
    """torch.compiler.is_compiling() is process-wide: it is True in every thread while one compiles.
    The eager numerics must not take their compiled branches then (the cause of the wrong bytes once
    seen from worker threads): te_serial.tracing.tracing() is per thread, and a quantize in another
    thread meanwhile gives the eager bytes, NaN handling included."""
    from te_serial.tracing import tracing
    qs = [ts.MXFP8Quantizer(torch.float8_e4m3fn), ts.NVFP4Quantizer(),
          ts.Float8CurrentScalingQuantizer(torch.float8_e5m2), ts.Float8BlockQuantizer(torch.float8_e4m3fn)]
    x = make_input("specials", (256, 512), torch.bfloat16, seed=3)
    want = [q.quantize(x, eager=True).buffers() for q in qs]
    compiling, checked, seen = threading.Event(), threading.Event(), {}

    def backend(gm, example_inputs):  # runs inside the compile session, in the compiling thread
        seen["in the compiling thread"] = tracing()
        compiling.set()
        checked.wait(120)
        return gm.forward

    def other():
        compiling.wait(120)
        try:
            seen["torch's flag"], seen["tracing"] = torch.compiler.is_compiling(), tracing()
            seen["buffers"] = [q.quantize(x, eager=True).buffers() for q in qs]
        finally:
            checked.set()
    thread = threading.Thread(target=other)
    thread.start()
    torch.compile(lambda a: a * 2, backend=backend, fullgraph=True)(torch.ones(3))
    thread.join()
    assert seen["in the compiling thread"] is True
    assert seen["torch's flag"] is True, "torch's flag is no longer process-wide: the case is gone"
    assert seen["tracing"] is False
    for q, got, w in zip(qs, seen["buffers"], want):
        assert_same_buffers(got, w, f"{q.kind} in another thread during a compile")


def test_eager_switches_compile_nothing(monkeypatch):
    """TE_SERIAL_EAGER=1, quantize(eager=True), dequantize(eager=True) and policy("eager") each keep
    a fresh configuration from compiling; tensors under MIN_NUMEL stay eager in "auto"."""
    q = ts.Float8BlockQuantizer(torch.float8_e5m2, block_scaling_dim=1, rowwise=False)  # used by no other test
    big = make_input("random", (1024, 1024), torch.bfloat16, seed=5)
    small = make_input("random", (64, 64), torch.bfloat16, seed=5)
    assert small.numel() < fused.MIN_NUMEL <= big.numel()
    want = q.quantize(big, eager=True)
    before = fused.compile_count()
    monkeypatch.setenv(fused.EAGER_ENV, "1")
    assert fused.current_policy() == "eager"
    with fused.policy("fused"):
        assert_same_buffers(q.quantize(big).buffers(), want.buffers())
        want.dequantize()
    monkeypatch.delenv(fused.EAGER_ENV)
    assert fused.current_policy() == "auto"
    with fused.policy("eager"):
        assert fused.current_policy() == "eager" and fused.current_policy(eager=False) == "eager"
        q.quantize(big)
    q.quantize(big, eager=True).dequantize(eager=True)
    q.quantize(small).dequantize()
    assert fused.compile_count() == before
    with pytest.raises(ValueError, match="policy"):
        with fused.policy("fast"):
            pass


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    calls = []

    def broken(fn):
        def run(*args):
            calls.append(fn)
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(fused, "_compiled_fn", broken)
    q = ts.Float8CurrentScalingQuantizer(torch.float8_e5m2, force_pow_2_scales=True)
    x = make_input("outliers", (256, 384), torch.bfloat16, seed=1)
    want = q.quantize(x, eager=True)
    try:
        with fused.policy("fused"):
            with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler here") as rec:
                got = [q.quantize(x) for _ in range(3)]
                dq = [t.dequantize(torch.float32) for t in got]
        assert len([w for w in rec if "te_serial: compiled" in str(w.message)]) == 2  # quantize, dequantize
        assert len(calls) == 2  # each key tried once, then eager without trying again
        for t, d in zip(got, dq):
            assert_same_buffers(t.buffers(), want.buffers())
            assert same_values(d, want.dequantize(torch.float32, eager=True))
        assert set(k[0] for k in fused.failures()) == {"quantize", "dequantize"}
    finally:
        fused.forget_failures()


def test_numerics_pinned_for_inductor():
    """The settings that keep roundings exact are the ones handed to inductor."""
    assert fused.NUMERICS["cpp.enable_unsafe_math_opt_flag"] is False
    assert fused.NUMERICS["cpp.enable_floating_point_contract_flag"] == "off"
    assert fused.NUMERICS["eager_numerics.division_rounding"] is True
    assert fused.NUMERICS["emulate_precision_casts"] is True
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fused.NUMERICS):  # every key is a real inductor setting
        assert inductor_config.cpp.enable_floating_point_contract_flag == "off"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(RECIPES))
def test_cuda_fused_equals_cpu_eager_bytes(name):
    """Triton kernels (fused on CUDA) give the CPU eager bytes, every recipe and usage set."""
    for usage in USAGES.values():
        q = recipe_quantizer(name, rowwise=usage[0], columnwise=usage[1])
        for kind in INPUT_KINDS:
            x = make_input(kind, (256, 512), torch.bfloat16, seed=3)
            want = q.quantize(x, eager=True)
            with compiled_only():
                got = q.quantize(x.cuda())
                dq = got.dequantize(torch.float32)
            assert_same_buffers({n: b.cpu() for n, b in got.buffers().items()}, want.buffers(), f"{name} {kind}")
            assert same_values(dq.cpu(), want.dequantize(torch.float32, eager=True)), f"{name} {kind} dequantize"
