"""The native kernels (te_serial/native) and their custom ops (te_serial/kernel_ops): the byte
transpose gives torch's transpose on every shape class, alignment and 1-byte dtype, compiled or not,
with its fallbacks; the block maxima give torch's amax; the FP8 cast gives torch's conversion (the
eager path's) on every input bit pattern class, every FP8 rounding tie and every scale layout the
formats use."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

from te_serial import kernel_ops, native
from te_serial import numerics as nx  # the eager rule the C cast must equal
from te_serial.formats import fused
from helpers import same_values

# rows and cols around the kernel's 64-row stripes and 16 x 16 tiles, and destination rows that are
# not 16-byte aligned (streamed vs plain stores)
SHAPES = [(0, 5), (5, 0), (1, 1), (1, 300), (300, 1), (15, 17), (16, 16), (63, 64), (64, 63), (64, 64),
          (65, 129), (128, 4096), (200, 72), (1000, 333), (1024, 1040), (2050, 520)]


def _random_bytes(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


@pytest.fixture(autouse=True, scope="module")
def _built():
    """The kernels built once for this module, as the first compiled call (or ``te-serial
    build-kernels``) builds them: the eager paths below only load a library already built."""
    if shutil.which("cc") is not None:
        native.available()


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """te_serial.native with no library loaded yet and its cache in ``tmp_path``."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    yield native


def test_the_kernel_builds_where_there_is_a_compiler():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")  # the fallback tests below still run
    assert native.available()


@pytest.mark.parametrize("shape", SHAPES)
def test_transpose_is_torchs_transpose(shape):
    x = _random_bytes(shape)
    got = kernel_ops.transpose_bytes(x)
    assert got.shape == (shape[1], shape[0]) and got.is_contiguous()
    assert torch.equal(got, x.t())


def test_row_strided_inputs_and_every_byte_dtype():
    wide = _random_bytes((1030, 700), seed=1)
    view = wide[3:1027, 5:600]  # rows further apart than they are long
    assert torch.equal(kernel_ops.transpose_bytes(view), view.t())
    cols = wide.t()[:512]  # column-major: made row-major first
    assert torch.equal(kernel_ops.transpose_bytes(cols), cols.t())
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        got = kernel_ops.transpose_bytes(wide.view(dtype))
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), wide.t())


def test_large_inputs_split_between_threads_give_the_same_bytes(monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # every shape below splits
    for shape in [(4096, 96), (777, 1001), (130, 4096)]:
        x = _random_bytes(shape, seed=2)
        assert torch.equal(kernel_ops.transpose_bytes(x), x.t())


def test_inside_a_compiled_graph():
    f = torch.compile(lambda a: kernel_ops.transpose_bytes(a.view(torch.float8_e4m3fn)).view(torch.uint8) + 1,
                      fullgraph=True, dynamic=True, backend="eager")
    for shape in [(64, 48), (100, 30)]:
        x = _random_bytes(shape, seed=3)
        assert torch.equal(f(x), x.t() + 1)


def test_switched_off_or_unbuildable_falls_back_to_torch(fresh_native, monkeypatch):
    x = _random_bytes((200, 72), seed=4)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not fresh_native.available()
    assert fresh_native.transpose_bytes(x) is None  # the kernel declines, the op runs torch's
    assert torch.equal(kernel_ops.transpose_bytes(x), x.t())

    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.warns(RuntimeWarning, match="native byte kernels unavailable"):
        assert not fresh_native.available()
    assert torch.equal(kernel_ops.transpose_bytes(x), x.t())
    assert not list(fresh_native.cache_dir().glob("*.so")), "a failed build left a library behind"


def test_a_build_is_cached_by_source(fresh_native):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    assert fresh_native.available()
    built = list(fresh_native.cache_dir().glob("te_serial_native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    fresh_native._state.clear()
    assert fresh_native.available()  # loaded from the cache, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp


def test_refuses_what_is_not_a_2d_byte_array():
    with pytest.raises(ValueError, match="1-byte"):
        kernel_ops.transpose_bytes(torch.zeros(4, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D"):
        kernel_ops.transpose_bytes(torch.zeros(4, 4, 4, dtype=torch.uint8))



def test_a_forked_child_runs_the_kernels_in_its_own_thread(monkeypatch):
    """OpenMP's threads do not survive a fork (a parallel region in the child would wait on them
    forever): in a child the kernels run in the calling thread, and give the same bytes."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x = _random_bytes((512, 256), seed=5)
    want = x.t().contiguous().numpy().tobytes()
    assert kernel_ops.transpose_bytes(x).numpy().tobytes() == want  # the parent's threads exist now
    assert native._threads(512, x.numel(), 64) == min(torch.get_num_threads(), 8)
    pid = os.fork()
    if pid == 0:  # the child: no torch op that could enter a parallel region, no pytest
        try:
            ok = native._threads(512, x.numel(), 64) == 1 and kernel_ops.transpose_bytes(x).numpy().tobytes() == want
            os._exit(0 if ok else 1)
        except BaseException:  # noqa: BLE001 - the child must never return into pytest
            os._exit(2)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the native kernel")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,b", [((32, 32), 32), ((64, 96), 32), ((256, 4096), 32), ((48, 160), 16),
                                     ((128, 384), 128), ((1024, 2048), 32)])
def test_block_amax_is_torchs_amax_over_the_blocks(dtype, shape, b, monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # the larger shapes split between threads
    g = torch.Generator().manual_seed(sum(shape) + b)
    info = torch.finfo(dtype)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 16, shape, generator=g).float())).to(dtype)
    flat = x.view(-1)  # adversarial values where they land in both kinds of blocks
    specials = [float("inf"), -float("inf"), -0.0, info.tiny / 4, -info.tiny, info.max, -info.max]
    for i, v in enumerate(specials):
        flat[(i * 7919) % flat.numel()] = v
    rows, cols, nan = native.block_amax(x, b)
    a = x.abs()
    m, k = shape
    assert not nan and rows.dtype == cols.dtype == dtype
    assert torch.equal(rows, a.reshape(m, k // b, b).amax(dim=2))
    assert torch.equal(cols, a.reshape(m // b, b, k).amax(dim=1))
    for nan_value in (float("nan"), -float("nan")):
        y = x.clone()
        y.view(-1)[-1] = nan_value
        assert native.block_amax(y, b)[2], "a NaN went unseen"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (256, 4096), (1024, 2048)])
def test_amax_is_torchs_and_spots_nan(dtype, shape, monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # the larger shapes split between threads
    g = torch.Generator().manual_seed(sum(shape))
    info = torch.finfo(dtype)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 16, shape, generator=g).float())).to(dtype)
    for v in [-0.0, info.tiny / 4, -info.max, info.max, float("inf"), -float("inf")]:
        y = x.clone()
        y.view(-1)[(int(abs(v) * 7) % y.numel()) if abs(v) < 1e30 else -1] = v
        amax, nan = native.amax(y)
        assert not nan and amax.dtype == dtype and amax.shape == ()
        assert torch.equal(amax, y.abs().amax()), v
    for nan_value in (float("nan"), -float("nan")):
        y = x.clone()
        y.view(-1)[y.numel() // 2] = nan_value
        assert native.amax(y)[1], "a NaN went unseen"
    view = torch.zeros(64, 64, dtype=dtype)[:, :48]  # a row stride other than the row's length
    view[5, 40] = -3.0
    assert native.amax(view)[0].item() == 3.0
    assert native.amax(x.float()) is None and native.amax(x.t() if shape[0] > 1 else x.view(-1)) is None


def test_block_amax_declines_what_it_does_not_take():
    x = torch.ones(64, 64, dtype=torch.bfloat16)
    assert native.block_amax(x.float(), 32) is None          # 32-bit floats: torch reduces them
    assert native.block_amax(x[:48], 32) is None             # rows not a multiple of b
    assert native.block_amax(x[:, :48], 32) is None          # nor columns
    assert native.block_amax(x.t(), 32) is None              # column-major
    assert native.block_amax(torch.ones(0, 64, dtype=torch.bfloat16), 32) is None


# --- the FP8 cast ----------------------------------------------------------------------------------

FP8_TYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _eager_codes(x, scale, fp8_dtype):
    """The eager path's codes: torch's fp32 product, clamp and conversion, NaN canonicalized."""
    return nx.scale_and_cast_to_fp8(x, scale, fp8_dtype)


def _native_codes(x, scale, fp8_dtype):
    return kernel_ops.scale_cast_fp8(x, scale, fp8_dtype).view(torch.uint8)


def _ties(fp8_dtype):
    """fp32 values on and around every rounding boundary of ``fp8_dtype``: each code's value, the
    midpoints between neighbours (ties, even and odd), their fp32 neighbours, both signs."""
    codes = torch.arange(0, 0x80, dtype=torch.uint8).view(fp8_dtype).float()
    vals = codes[torch.isfinite(codes)].unique()
    mids = (vals[:-1] + vals[1:]) / 2                      # exact in fp32
    pts = torch.cat([vals, mids, vals * 1.0000001, mids.nextafter(torch.tensor(0.0)),
                     mids.nextafter(torch.tensor(float("inf"))), vals[-1:] * 1.01, vals[-1:] * 2])
    return torch.cat([pts, -pts])


def _every_16_bit_pattern(largest: float):
    """(input dtype, every BF16 / FP16 bit pattern as [256, 256], scale): scales that put them
    around the target's largest value, in its normal and subnormal ranges, past fp32's range, and
    none."""
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
        for scale in [1.0, 0.37, 2.0 ** -20, 3.0e5, largest / 3.1, 2.0 ** 70, 1e-38, 5e-45, None]:
            yield dtype, x, None if scale is None else torch.tensor(scale, dtype=torch.float32)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
@pytest.mark.parametrize("fp8_dtype", FP8_TYPES)
def test_cast_every_bf16_and_fp16_pattern_at_many_scales(fp8_dtype, monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # split between threads too
    for dtype, x, s in _every_16_bit_pattern(nx.FP8_MAX[fp8_dtype]):
        assert torch.equal(_native_codes(x, s, fp8_dtype), _eager_codes(x, s, fp8_dtype)), (dtype, s)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
@pytest.mark.parametrize("fp8_dtype", FP8_TYPES)
def test_cast_fp32_ties_specials_and_random_bits(fp8_dtype):
    g = torch.Generator().manual_seed(11)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            1e-45, -1e-45, 1.17549435e-38, 3.4028235e38])
    for x in (_ties(fp8_dtype), rand.view(torch.float32), special):
        for scale in [None, torch.tensor(1.0), torch.tensor(0.75), torch.tensor(2.0 ** -9)]:
            assert torch.equal(_native_codes(x, scale, fp8_dtype), _eager_codes(x, scale, fp8_dtype))
    # independent of torch's conversion: each code decodes to the finite FP8 value nearest its
    # (clamped) input, the one with an even code on a tie, with the input's sign
    x = _ties(fp8_dtype)
    got = kernel_ops.scale_cast_fp8(x, None, fp8_dtype)
    codes = torch.arange(0, 0x80, dtype=torch.uint8)
    vals = codes.view(fp8_dtype).float()
    codes, vals = codes[torch.isfinite(vals)], vals[torch.isfinite(vals)]
    m = nx.FP8_MAX[fp8_dtype]
    d = (vals[None, :].double() - x.abs().clamp(max=m)[:, None].double()).abs()
    cand = d == d.min(1, keepdim=True).values
    pick = cand & (((codes & 1) == 0)[None, :] | (cand.sum(1, keepdim=True) == 1))
    want = vals[pick.int().argmax(1)]
    assert torch.equal(got.float().abs(), want)
    assert torch.equal(got.view(torch.uint8) >= 0x80, torch.signbit(x))


def _layout_input(in_dtype, seed, magnitude, specials=(float("inf"), -float("inf"))):
    """A [256, 384] input (normal values times ``magnitude``, ±0, tiny values and ``specials`` at the
    start of row 0) and a maker of random positive scales of a shape, both from one seed."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 384, generator=g) * magnitude).to(in_dtype)
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-7, -3e-5, *specials], dtype=in_dtype)
    return x, lambda *shape: torch.rand(*shape, generator=g) * 3 + 2.0 ** -12


@pytest.mark.parametrize("fp8_dtype", FP8_TYPES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["tensor", "row32", "col32", "tile128", "row_each", "odd", "row24"])
def test_cast_takes_every_scale_layout_the_formats_use(fp8_dtype, in_dtype, layout, monkeypatch):
    """Per-tensor, 1×32 rows, 32×1 columns (a scale per element of the row), 128×128 tiles,
    one scale per row, an odd block length and one of 16 + 8 (the C loop's 16 lanes and a tail),
    each against the eager codes."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, rand = _layout_input(in_dtype, seed=7, magnitude=300)
    xs, s = {
        "tensor": (x, rand(())),
        "row32": (x.view(256, 12, 32), rand(256, 12, 1)),
        "col32": (x.view(8, 32, 384), rand(8, 1, 384)),
        "tile128": (x.view(2, 128, 3, 128), rand(2, 1, 3, 1)),
        "row_each": (x, rand(256)[:, None]),
        "odd": (x.view(256, 128, 3), rand(256, 128, 1)),
        "row24": (x.view(256, 16, 24), rand(256, 16, 1)),
    }[layout]
    assert torch.equal(_native_codes(xs, s, fp8_dtype), _eager_codes(xs, s, fp8_dtype))
    # a non-contiguous input and a strided scale give the same codes
    xt = xs.transpose(0, -1).contiguous().transpose(0, -1)
    assert torch.equal(_native_codes(xt, s, fp8_dtype), _eager_codes(xs, s, fp8_dtype))


def test_cast_declines_to_torch_where_the_c_loop_does_not_apply():
    """Five dims that merge into fewer run in C; more than four left after merging, a scale varying
    along the last dim with a stride, an empty tensor: the eager rule runs. The same codes each way."""
    x = torch.randn(2, 2, 2, 2, 8) * 100
    s = torch.rand(2, 1, 1, 1, 8) + 0.5
    assert native._cast_layout(tuple(x.shape), tuple(s.expand(x.shape).stride())) == ((1, 2, 8, 8), (0, 8, 0, 1))
    assert torch.equal(_native_codes(x, s, torch.float8_e4m3fn), _eager_codes(x, s, torch.float8_e4m3fn))
    x6 = torch.randn(2, 3, 2, 3, 2, 8) * 100
    s6 = torch.rand(2, 1, 2, 1, 2, 8) + 0.5
    assert native._cast_layout(tuple(x6.shape), tuple(s6.expand(x6.shape).stride())) is None
    assert torch.equal(_native_codes(x6, s6, torch.float8_e5m2), _eager_codes(x6, s6, torch.float8_e5m2))
    y = torch.randn(16, 8) * 100
    s2 = (torch.rand(8, 16) + 0.5).t()          # strides (1, 16): the last dim's stride is 16
    assert torch.equal(_native_codes(y, s2, torch.float8_e5m2), _eager_codes(y, s2, torch.float8_e5m2))
    assert kernel_ops.scale_cast_fp8(torch.empty(0, 4), torch.tensor(1.0), torch.float8_e4m3fn).shape == (0, 4)


def test_cast_switched_off_gives_the_same_codes(fresh_native, monkeypatch):
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 500
    s = torch.rand(64, 3, 1) + 0.5
    want = _native_codes(x.view(64, 3, 32), s, torch.float8_e4m3fn)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not fresh_native.available()
    assert torch.equal(_native_codes(x.view(64, 3, 32), s, torch.float8_e4m3fn), want)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1] for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


#: x86-64 micro-architecture levels: the flags a host needs to run each (psABI), and the generic build
_TIERS = {"generic": ((), set()),
          "x86-64-v2": (("-march=x86-64-v2",), {"sse4_2", "ssse3", "popcnt"}),
          "x86-64-v3": (("-march=x86-64-v3",), {"avx2", "fma", "bmi1", "bmi2", "movbe", "f16c"}),
          "x86-64-v4": (("-march=x86-64-v4",), {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})}


def test_the_eager_path_never_starts_a_compiler(tmp_path):
    """An eager quantize of every format with no kernels built: no compiler is run (a CC that
    records being called), no warning is printed, and the bytes are torch's own ops'."""
    import subprocess
    import sys
    marker = tmp_path / "cc-ran"
    cc = tmp_path / "cc.sh"
    cc.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    cc.chmod(0o755)
    code = ("import torch, warnings, te_serial as ts\n"
            "warnings.simplefilter('error')\n"
            "x = torch.randn(256, 512, dtype=torch.bfloat16)\n"
            "for q in (ts.Float8CurrentScalingQuantizer(torch.float8_e4m3fn), ts.Float8Quantizer(1.0, 0.0, "
            "torch.float8_e4m3fn), ts.NVFP4Quantizer(), ts.NVFP4Quantizer(with_2d_quantization=True), "
            "ts.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1), ts.MXFP8Quantizer()):\n"
            "    q.quantize(x, eager=True).dequantize()\n"
            "print('done')\n")
    env = {**os.environ, "CC": str(cc), native.CACHE_ENV: str(tmp_path / "cache")}
    env.pop(native.NATIVE_ENV, None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "done", res.stderr[-2000:]
    assert "warn" not in res.stderr.lower(), res.stderr[-2000:]
    assert not marker.exists(), "an eager quantize ran the compiler"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
@pytest.mark.parametrize("tier", list(_TIERS))
def test_each_simd_tier_gives_the_same_codes(tier, fresh_native, monkeypatch):
    """Built for each x86-64 level the host can run (and the generic target, one thread, as a
    compiler that refuses the flags leaves it), with -Wall -Werror: every loop gives the eager codes."""
    flags, needs = _TIERS[tier]
    if tier != "generic":
        import platform
        if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
            pytest.skip(f"this host cannot run {tier} code (needs {sorted(needs - _cpu_flags())})")
    monkeypatch.setattr(fresh_native, "_OPTIONAL_FLAGS", (flags,))
    assert fresh_native.available() and fresh_native.build() is not None
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for fp8_dtype in FP8_TYPES:
        for xs, s in [(x.reshape(256, 256), torch.tensor(0.37)), (x.reshape(2048, 32), torch.rand(2048, 1) + 0.5),
                      (x.reshape(64, 1024), torch.rand(1024) * 3), (x.reshape(65536, 1), torch.tensor(2.0 ** 70)),
                      (x.float().reshape(4096, 16)[:, :13], torch.tensor(1.5))]:
            assert torch.equal(_native_codes(xs, s, fp8_dtype), _eager_codes(xs, s, fp8_dtype)), (fp8_dtype, xs.shape)
    for dim in (-1, -2):
        xs, s = x.reshape(128, 16, 32), torch.rand(128, 16, 1) * 4
        assert torch.equal(kernel_ops.scale_cast_fp4(xs, s, dim), nx.scale_and_cast_to_fp4(xs, s, dim)), dim
    # the other loops' generic forms: both usages in one read, the dequantize, 4over6 (table lookups,
    # row sums without AVX2's transposes)
    xs, rs, cs = x.reshape(256, 256), torch.rand(256, 8) + 0.5, torch.rand(8, 256) + 0.5
    got, want = kernel_ops.scale_cast_fp8_pair(xs, rs, cs, torch.float8_e4m3fn, 32), \
        nx.scale_and_cast_to_fp8_pair(xs, rs, cs, torch.float8_e4m3fn, 32)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    codes = torch.arange(256, dtype=torch.uint8).repeat(64, 1)
    for fp8_dtype in FP8_TYPES:
        assert same_values(kernel_ops.dequantize_fp8(codes, rs[:64, :1], fp8_dtype),
                           codes.view(fp8_dtype).float() * rs[:64, :1])
    for along, tile in [(1, True), (1, False), (0, True), (0, False)]:
        xq, enc4, sf4, enc6, sf6, amax = _4over6_case(torch.bfloat16, along, tile, 40.0)
        args = (xq, enc4, sf4, enc6, sf6, amax, torch.tensor(6.0 * 256), False, along, tile)
        got, want = kernel_ops.scale_cast_fp4_4over6(*args), nx.scale_and_cast_to_fp4_4over6(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (along, tile)
    # both usages of the tiles from one pass
    xq, enc4, sf4, enc6, sf6, amax = _4over6_case(torch.bfloat16, 1, True, 40.0)
    args = (xq, enc4, sf4, enc6, sf6, amax, torch.tensor(6.0 * 256), False)
    got, want = kernel_ops.scale_cast_fp4_4over6_pair(*args), nx.scale_and_cast_to_fp4_4over6_pair(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
def test_a_compiler_without_openmp_still_builds_for_this_cpu(fresh_native, monkeypatch, tmp_path):
    """A compiler that refuses -fopenmp (Apple's clang) gets the next set of flags, this CPU's
    instruction set without OpenMP, and the kernels give the same bytes on one thread."""
    seen = tmp_path / "flags.txt"
    cc = tmp_path / "cc_without_openmp"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {seen}\ncase " $* " in *" -fopenmp "*) exit 1;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert fresh_native.available()
    tried = seen.read_text().splitlines()
    assert "-fopenmp" in tried[0] and "-march=native" in tried[1] and "-fopenmp" not in tried[1]
    assert len(tried) == 2, "the second set of flags built the library"
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    s = torch.tensor(0.37)
    assert torch.equal(_native_codes(x, s, torch.float8_e4m3fn), _eager_codes(x, s, torch.float8_e4m3fn))


def test_compiled_graphs_cast_through_the_c_loop(monkeypatch):
    """Where the library is built, a compiled quantize's FP8 cast is the C loop's, for both FP8 types
    (the fused table then holds it to the eager bytes)."""
    if not native.available():
        pytest.skip("no native library: the graphs keep inductor's cast")
    calls = []
    for name in ("scale_cast_fp8", "scale_cast_fp8_transposed"):  # the cast, and with its transpose (both usages)
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real: calls.append(a[2]) or real(*a))
    from te_serial import Float8CurrentScalingQuantizer
    q = Float8CurrentScalingQuantizer(torch.float8_e5m2)
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    with fused.policy("fused"):
        got = q.quantize(x)
    with fused.policy("eager"):
        want = q.quantize(x)
    assert calls == [torch.float8_e5m2]
    with fused.policy("fused"):
        Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(x)
    assert calls == [torch.float8_e5m2, torch.float8_e4m3fn]
    for k, b in want.buffers().items():
        assert torch.equal(got.buffers()[k].view(torch.uint8), b.view(torch.uint8)), k


# --- the FP4 (E2M1) cast ---------------------------------------------------------------------------

def _fp4_eager(x, scale, dim):
    """The eager rule: torch's fp32 product, cast_to_fp4_codes, pack_fp4."""
    return nx.scale_and_cast_to_fp4(x, scale, dim)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
@pytest.mark.parametrize("dim", [-1, -2])
def test_fp4_cast_every_bf16_and_fp16_pattern_at_many_scales(dim, monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # split between threads too
    for dtype, x, s in _every_16_bit_pattern(nx.FP4_MAX):
        got = kernel_ops.scale_cast_fp4(x, s, dim)
        assert got.shape == ((256, 128) if dim == -1 else (128, 256))
        assert torch.equal(got, _fp4_eager(x, s, dim)), (dtype, s)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fallback is torch itself")
def test_fp4_cast_fp32_ties_specials_and_random_bits():
    """Random fp32 bit patterns (NaN of both signs among them: +6, code 7), every E2M1 midpoint and its
    fp32 neighbours, ±0, ±6, ±inf, against the eager codes; cast_to_fp4_codes is itself held to a
    brute-force nearest-even table in test_fused."""
    g = torch.Generator().manual_seed(12)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    mids = torch.tensor([t for t, _ in nx.E2M1_STEPS])
    near = torch.cat([mids, mids.nextafter(torch.zeros(7)), mids.nextafter(torch.full((7,), 9.0)),
                      torch.tensor([0.0, 6.0, 7.0, float("inf"), float("nan"), 1e-45])])
    near = torch.cat([near, -near, near * 0.5])
    near = torch.cat([near, torch.zeros(-len(near) % 32)])  # whole rows of 16, an even number of them
    for x in (rand.view(torch.float32).reshape(-1, 64), near.reshape(-1, 16)):
        for scale in [None, torch.tensor(1.0), torch.tensor(0.75), torch.tensor(2.0 ** -9)]:
            for dim in (-1, -2):
                assert torch.equal(kernel_ops.scale_cast_fp4(x, scale, dim), _fp4_eager(x, scale, dim))
    assert kernel_ops.scale_cast_fp4(torch.full((1, 16), float("nan")), None).tolist() == [[0x77] * 8]


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["rows16", "cols16", "tensor", "row_each", "tile16"])
def test_fp4_cast_takes_the_layouts_nvfp4_uses(in_dtype, layout, monkeypatch):
    """NVFP4's 1×16 blocks packed along the row, 16×1 blocks (a scale per element of the row) packed
    down the columns, one scale, one per row, 16×16 tiles: each against the eager codes, also from a
    non-contiguous input."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, rand = _layout_input(in_dtype, seed=8, magnitude=3)
    xs, s, dim = {
        "rows16": (x.view(256, 24, 16), rand(256, 24, 1), -1),
        "cols16": (x.view(16, 16, 384), rand(16, 1, 384), -2),
        "tensor": (x, rand(()), -1),
        "row_each": (x, rand(256)[:, None], -2),
        "tile16": (x.view(16, 16, 384), rand(16, 1, 24).repeat_interleave(16, dim=2), -2),
    }[layout]
    want = _fp4_eager(xs, s, dim)
    assert torch.equal(kernel_ops.scale_cast_fp4(xs, s, dim), want)
    xt = xs.transpose(0, -1).contiguous().transpose(0, -1)
    assert torch.equal(kernel_ops.scale_cast_fp4(xt, s, dim), want)


def test_fp4_cast_declines_to_torch_where_the_c_loop_does_not_apply():
    """Rows not a whole number of 16-lane groups, no C loop for the operands: torch's rule runs, with
    the same bytes; a dim other than -1 or -2, or of odd size, is an error."""
    g = torch.Generator().manual_seed(9)
    for x, dim in [(torch.randn(8, 24, generator=g) * 4, -1), (torch.randn(8, 24, generator=g) * 4, -2),
                   (torch.randn(4, 32, generator=g).double() * 4, -1)]:
        assert native.scale_cast_fp4(x, None, dim) is None
        assert torch.equal(kernel_ops.scale_cast_fp4(x, torch.tensor(1.5), dim), _fp4_eager(x, torch.tensor(1.5), dim))
    for x, dim in [(torch.zeros(4, 16), 0), (torch.zeros(7, 16), -2), (torch.zeros(4, 15), -1), (torch.zeros(16), -2)]:
        with pytest.raises(ValueError, match="dim -1 or -2 of even size"):
            kernel_ops.scale_cast_fp4(x, None, dim)


def test_compiled_nvfp4_casts_through_the_c_loop(monkeypatch):
    """Where the library is built, a compiled NVFP4 quantize packs its data through the C loop, both
    usages, and the bytes are the eager ones."""
    if not native.available():
        pytest.skip("no native library: the graphs keep torch's cast")
    calls = []
    real = native.scale_cast_fp4
    monkeypatch.setattr(native, "scale_cast_fp4", lambda *a: calls.append(a[2]) or real(*a))
    from te_serial import NVFP4Quantizer
    q = NVFP4Quantizer(rowwise=True, columnwise=True)
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    with fused.policy("fused"):
        got = q.quantize(x)
    with fused.policy("eager"):
        want = q.quantize(x)
    assert sorted(calls) == [-2, -1]
    for k, b in want.buffers().items():
        assert torch.equal(got.buffers()[k].view(torch.uint8), b.view(torch.uint8)), k


# --- the FP4 cast with block errors (NVFP4 4over6's candidates) ------------------------------------

def _4over6_case(in_dtype, along, tile, special):
    """(x [R, C], the candidates' encoding and decoding grids, amax) as NVFP4 4over6 makes them:
    the decoding scales e4m3(b · 1.5) and e4m3(b) with b from each block's (or tile's: grids per
    tile) maximum, so that near ties pick either candidate. 1-D rows take 200 rows (a last stripe of 8)."""
    x, _ = _layout_input(in_dtype, seed=16, magnitude=3, specials=(special, -1e4))
    if along == 1 and not tile:
        x = x[:200].contiguous()
    r, c = x.shape
    xf = x.float().abs()
    if tile:  # grids per tile
        m = xf.reshape(r // 16, 16, c // 16, 16).amax((1, 3))
    else:
        m = xf.reshape(r, c // 16, 16).amax(2) if along == 1 else xf.reshape(r // 16, 16, c).amax(1)
    e4m3 = lambda t: t.clamp(max=448).to(torch.float8_e4m3fn).float()  # noqa: E731
    s_enc = torch.tensor(37.0)
    sf4, sf6 = e4m3(m / 6 * s_enc * 1.5), e4m3(m / 6 * s_enc)
    enc = lambda sf: torch.clamp(1 / (sf * (1 / s_enc)), max=nx.FP32_MAX)  # noqa: E731
    return x, enc(sf4), sf4, enc(sf6), sf6, xf.nan_to_num(0).amax().reshape(1, 1)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("along", [1, 0])
@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("special", [40.0, float("nan")])
def test_4over6_pass_is_the_eager_rule(in_dtype, along, tile, mse, special, monkeypatch):
    """The one-pass 4over6 loop (both candidates, their errors from decode tables, tiles' tree sums,
    the choice) gives the eager rule's packed codes and choices bit for bit, rows and columns, 2-D
    tiles and 1-D blocks, a NaN too; both candidates are chosen somewhere."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, enc4, sf4, enc6, sf6, amax = _4over6_case(in_dtype, along, tile, special)
    denom = torch.tensor(6.0 * 256)
    want = nx.scale_and_cast_to_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)
    assert native.fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, (along,), tile) is not None
    got = kernel_ops.scale_cast_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, tile)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < want[1].float().mean() < 1


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("special", [40.0, float("nan")])
def test_4over6_tiles_pair_is_each_usage(in_dtype, mse, special, monkeypatch):
    """Both usages of 16×16 tiles from one pass (each element cast once, its errors summed row by row
    and column by column) give each usage's own rule bit for bit, both candidates chosen in each."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, enc4, sf4, enc6, sf6, amax = _4over6_case(in_dtype, 1, True, special)
    denom = torch.tensor(6.0 * 256)
    want = nx.scale_and_cast_to_fp4_4over6_pair(x, enc4, sf4, enc6, sf6, amax, denom, mse)
    for along, (data, pick) in zip((1, 0), (want[:2], want[2:])):
        single = nx.scale_and_cast_to_fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, along, True)
        assert torch.equal(single[0], data) and torch.equal(single[1], pick), along
        assert 0 < pick.float().mean() < 1
    assert native.fp4_4over6(x, enc4, sf4, enc6, sf6, amax, denom, mse, (1, 0), True) is not None
    got = kernel_ops.scale_cast_fp4_4over6_pair(x, enc4, sf4, enc6, sf6, amax, denom, mse)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_4over6_pass_declines_and_refuses():
    """An amax per row, or columns not in whole lanes: the eager rule runs, the same results; a
    block or tile that does not divide its dim is an error."""
    x, enc4, sf4, enc6, sf6, amax = _4over6_case(torch.bfloat16, 1, False, 40.0)
    denom = torch.tensor(6.0 * 256)
    per_row = torch.rand(x.shape[0], 1) + 1
    assert native.fp4_4over6(x, enc4, sf4, enc6, sf6, per_row, denom, False, (1,), False) is None
    got = kernel_ops.scale_cast_fp4_4over6(x, enc4, sf4, enc6, sf6, per_row, denom, False, 1, False)
    want = nx.scale_and_cast_to_fp4_4over6(x, enc4, sf4, enc6, sf6, per_row, denom, False, 1, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cols = x[:32, :40].contiguous()  # blocks down 40 columns: not whole 16-lane groups
    g = torch.rand(2, 40) + 0.5
    assert native.fp4_4over6(cols, g, g, g, g, amax, denom, False, (0,), False) is None
    got = kernel_ops.scale_cast_fp4_4over6(cols, g, g * 2, g, g, amax, denom, False, 0, False)
    want = nx.scale_and_cast_to_fp4_4over6(cols, g, g * 2, g, g, amax, denom, False, 0, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="blocks of 16 along dim 1"):
        kernel_ops.scale_cast_fp4_4over6(x[:, :40], g, g, g, g, amax, denom, False, 1, False)
    with pytest.raises(ValueError, match="tiles: both"):
        kernel_ops.scale_cast_fp4_4over6(x[:200], enc4, sf4, enc6, sf6, amax, denom, False, 1, True)


# --- both usages of 1 x b / b x 1 blocks from one read -------------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_TYPES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b", [32, 128])
def test_paired_cast_is_two_casts(fp8_dtype, in_dtype, b, monkeypatch):
    """MXFP8's two usages (1×32 and 32×1 blocks), and blocks of 128: each output equals the eager
    cast with its own blocks' scales, on inputs with ±0, tiny values and infinities, split between
    threads too."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, rand = _layout_input(in_dtype, seed=22, magnitude=300)
    m, k = x.shape
    rs, cs = rand(m, k // b), rand(m // b, k)
    assert native.scale_cast_fp8_pair(x, rs, cs, fp8_dtype, b) is not None
    rows, cols = kernel_ops.scale_cast_fp8_pair(x, rs, cs, fp8_dtype, b)
    want_rows = _eager_codes(x.reshape(m, k // b, b), rs[..., None], fp8_dtype).reshape(m, k)
    want_cols = _eager_codes(x.reshape(m // b, b, k), cs[:, None, :], fp8_dtype).reshape(m, k)
    assert torch.equal(rows.view(torch.uint8), want_rows) and torch.equal(cols.view(torch.uint8), want_cols)


def test_paired_cast_declines_and_refuses():
    """Blocks that are not a power of two, scales of other shapes: the eager rule, the same codes;
    blocks that do not divide the shape are an error."""
    x, rand = _layout_input(torch.bfloat16, seed=23, magnitude=3)
    x48 = x[:240].contiguous()  # 5 x 48 rows, 8 x 48 columns
    rs, cs = rand(240, 8), rand(5, 384)
    assert native.scale_cast_fp8_pair(x48, rs, cs, torch.float8_e4m3fn, 48) is None
    got = kernel_ops.scale_cast_fp8_pair(x48, rs, cs, torch.float8_e4m3fn, 48)
    want = nx.scale_and_cast_to_fp8_pair(x48, rs, cs, torch.float8_e4m3fn, 48)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    one_per_row = rand(256, 1)  # not [M, K/b]
    assert native.scale_cast_fp8_pair(x, one_per_row, rand(8, 384), torch.float8_e4m3fn, 32) is None
    with pytest.raises(ValueError, match="blocks of 32 do not divide"):
        kernel_ops.scale_cast_fp8_pair(x[:, :100], rand(256, 3), rand(8, 100), torch.float8_e4m3fn, 32)


# --- FP8 dequantize ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_TYPES)
@pytest.mark.parametrize("layout", ["tensor", "row32", "col32", "tile128", "odd"])
def test_dequantize_is_torchs_conversion_times_the_scale(fp8_dtype, layout, monkeypatch):
    """Every code (NaN, infinities, subnormals, both zeros) in each scale layout the formats use,
    with scales that overflow, underflow, and a NaN: the bits of torch's conversion times the scale,
    NaN where it gives NaN; split between threads too."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    g = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 256, (256, 384), dtype=torch.uint8, generator=g)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)
    rand = lambda *shape: torch.rand(*shape, generator=g) * 3 + 2.0 ** -12  # noqa: E731
    q, s = {
        "tensor": (codes, torch.tensor([3.0e38])),
        "row32": (codes.view(256, 12, 32), rand(256, 12, 1)),
        "col32": (codes.view(8, 32, 384), rand(8, 1, 384)),
        "tile128": (codes[:, :256].contiguous().view(2, 128, 2, 128), rand(2, 1, 2, 1)),
        "odd": (codes[:, :200].contiguous(), rand(256, 1)),  # rows of 12 lanes and a tail of 8
    }[layout]
    if layout != "tensor":
        s.view(-1)[:3] = torch.tensor([float("nan"), 1e-39, 2.0 ** 100])
    want = q.view(fp8_dtype).float() * s
    got = kernel_ops.dequantize_fp8(q, s, fp8_dtype)
    assert native.dequantize_fp8(q, s, fp8_dtype) is not None
    assert same_values(got, want)
    assert torch.isnan(got).any() and (got == 0).any()


# --- the FP8 cast with its codes transposed --------------------------------------------------------

@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["tensor", "tile128", "col128", "odd_rows"])
@pytest.mark.parametrize("keep_rows", [True, False])
def test_cast_transposed_is_the_cast_then_the_transpose(in_dtype, layout, keep_rows, monkeypatch):
    """Per-tensor, 128×128 tiles, 128×1 blocks (a scale per element of the row) and a [100, 200]
    array (a last stripe of 36 rows, rows of 12 lanes and a tail): the codes and their transpose
    equal the eager cast and torch's transpose, split between threads too."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x, rand = _layout_input(in_dtype, seed=15, magnitude=300)
    xs, s, width = {
        "tensor": (x, rand(()), 384),
        "tile128": (x.view(2, 128, 3, 128), rand(2, 1, 3, 1), 384),
        "col128": (x.view(2, 128, 384), rand(2, 1, 384), 384),
        "odd_rows": (x[:100, :200].contiguous(), rand(100, 1), 200),
    }[layout]
    for fp8_dtype in FP8_TYPES:
        want = _eager_codes(xs, s, fp8_dtype).reshape(-1, width)
        rows, cols = kernel_ops.scale_cast_fp8_transposed(xs, s, fp8_dtype, (xs.numel() // width, width), keep_rows)
        assert torch.equal(cols.view(torch.uint8), want.t())
        assert rows is None if not keep_rows else torch.equal(rows.view(torch.uint8).reshape(-1, width), want)


def test_cast_transposed_declines_and_refuses():
    """Rows that are not whole blocks of the layout run torch's rule (the same bytes), as does an
    empty tensor; a 2-D shape that is not the tensor's is an error."""
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 100
    s = torch.rand(64, 1, 2, 1) + 0.5
    xs = x.view(64, 1, 2, 48)
    assert native.scale_cast_fp8_transposed(xs, s, torch.float8_e4m3fn, 96, 64, True) is None  # 64 % 48
    want = _eager_codes(xs, s, torch.float8_e4m3fn).reshape(-1, 64)
    rows, cols = kernel_ops.scale_cast_fp8_transposed(xs, s, torch.float8_e4m3fn, (96, 64))
    assert torch.equal(cols.view(torch.uint8), want.t()) and torch.equal(rows.view(torch.uint8).reshape(-1, 64), want)
    with pytest.raises(ValueError, match="is not shape"):
        kernel_ops.scale_cast_fp8_transposed(x, None, torch.float8_e4m3fn, (60, 100))
    empty, transposed = kernel_ops.scale_cast_fp8_transposed(torch.empty(5, 0), None, torch.float8_e5m2, (5, 0))
    assert empty.shape == (5, 0) and transposed.shape == (0, 5)


# --- outputs ---------------------------------------------------------------------------------------

def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping holding ``address`` (Linux /proc/self/smaps)."""
    flags, inside = set(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = set(line.split()[1:])
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                    reason="huge-page hints are Linux's madvise(MADV_HUGEPAGE)")
def test_large_outputs_ask_for_huge_pages():
    """An output a kernel writes in full asks for huge pages over its whole 2 MB pages (fresh memory
    then faults in per 2 MB); a small one is left as it is."""
    lib = native._library()
    big = native._output(lib, (16 << 20,), torch.uint8)
    inner = (big.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    assert "hg" in _vm_flags(inner)
    small = native._output(lib, (64 << 10,), torch.uint8)
    assert small.shape == (64 << 10,) and small.dtype == torch.uint8
    assert lib.te_serial_prefer_huge_pages(small.data_ptr(), 64 << 10) == 0  # no whole 2 MB page: nothing asked


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on PATH")
def test_a_library_of_another_interface_version_is_refused(fresh_native, monkeypatch):
    """The signature table describes one interface version; a library declaring another (a stale
    build, a hand-made one) is never called: torch's ops run, and one warning says why."""
    assert fresh_native.available()
    fresh_native._state.clear()
    monkeypatch.setattr(fresh_native, "_ABI_VERSION", fresh_native._ABI_VERSION + 1)
    with pytest.warns(RuntimeWarning, match="interface version"):
        assert not fresh_native.available()
    x = _random_bytes((64, 48), seed=9)
    assert torch.equal(kernel_ops.transpose_bytes(x), x.t())


@pytest.mark.parametrize("case", ["random", "one-value", "empty", "odd", "e4m3-scales", "all-values"])
def test_byte_histogram_is_bincount(case, monkeypatch):
    """The C byte histogram (block-scale presence for the serving layouts' checks) counts as torch's
    bincount does, on runs of one value, odd lengths and nothing; declined (not built), the fallback
    gives the same counts."""
    x = {"random": _random_bytes((1000, 333)).reshape(-1),
         "one-value": torch.full((4099,), 0x7E, dtype=torch.uint8),
         "empty": torch.empty(0, dtype=torch.uint8),
         "odd": _random_bytes((7,), 3),
         "e4m3-scales": _random_bytes((512, 64), 4).view(torch.float8_e4m3fn),
         "all-values": torch.arange(256, dtype=torch.uint8).repeat(3)}[case]
    want = torch.bincount(x.reshape(-1).view(torch.uint8).int(), minlength=256)
    assert torch.equal(kernel_ops.byte_histogram(x), want)
    if native.available():
        assert native.byte_histogram(x.reshape(-1).view(torch.uint8)) is not None  # the C kernel ran
    monkeypatch.setattr(native, "_library", lambda build=False: None)
    assert native.byte_histogram(x.reshape(-1).view(torch.uint8)) is None
    assert torch.equal(kernel_ops.byte_histogram(x), want)


@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (300, 1001), (4096, 96)])
def test_byte_pairs_map_each_byte_through_the_table(shape, monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)   # the larger shapes split between threads
    x, table = _random_bytes(shape, seed=5), _random_bytes((256, 2), seed=6)
    want = table[x.reshape(-1).long()].reshape(*shape[:-1], 2 * shape[-1])
    got = kernel_ops.map_byte_pairs(x, table)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    if native.available():   # the C pass ran (not torch's gather)
        assert native.map_bytes_u16(x.contiguous(), table.view(torch.int16).reshape(256)) is not None


def test_byte_pairs_switched_off_are_torchs_gather(fresh_native, monkeypatch):
    x, table = _random_bytes((33, 70), seed=7), _random_bytes((256, 2), seed=8)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert fresh_native.map_bytes_u16(x, table.view(torch.int16).reshape(256)) is None
    assert torch.equal(kernel_ops.map_byte_pairs(x, table), table[x.long()].reshape(33, 140))
    assert fresh_native.map_bytes_u16(x.float(), table.view(torch.int16).reshape(256)) is None  # not bytes: declined
