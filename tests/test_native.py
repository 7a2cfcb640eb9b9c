"""The native byte transpose (te_serial/native): the same bytes as torch's transpose on every shape
class, alignment and 1-byte dtype, compiled or not, with its fallbacks."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from te_serial import native

# rows and cols around the kernel's 64-row stripes and 16 x 16 tiles, and destination rows that are
# not 16-byte aligned (streamed vs plain stores)
SHAPES = [(0, 5), (5, 0), (1, 1), (1, 300), (300, 1), (15, 17), (16, 16), (63, 64), (64, 63), (64, 64),
          (65, 129), (128, 4096), (200, 72), (1000, 333), (1024, 1040), (2050, 520)]


def _random_bytes(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


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
    got = native.transpose_bytes(x)
    assert got.shape == (shape[1], shape[0]) and got.is_contiguous()
    assert torch.equal(got, x.t())


def test_row_strided_inputs_and_every_byte_dtype():
    wide = _random_bytes((1030, 700), seed=1)
    view = wide[3:1027, 5:600]  # rows further apart than they are long
    assert torch.equal(native.transpose_bytes(view), view.t())
    cols = wide.t()[:512]  # column-major: made row-major first
    assert torch.equal(native.transpose_bytes(cols), cols.t())
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        got = native.transpose_bytes(wide.view(dtype))
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), wide.t())


def test_large_inputs_split_between_threads_give_the_same_bytes(monkeypatch):
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)  # every shape below splits
    for shape in [(4096, 96), (777, 1001), (130, 4096)]:
        x = _random_bytes(shape, seed=2)
        assert torch.equal(native.transpose_bytes(x), x.t())


def test_inside_a_compiled_graph():
    f = torch.compile(lambda a: native.transpose_bytes(a.view(torch.float8_e4m3fn)).view(torch.uint8) + 1,
                      fullgraph=True, dynamic=True, backend="eager")
    for shape in [(64, 48), (100, 30)]:
        x = _random_bytes(shape, seed=3)
        assert torch.equal(f(x), x.t() + 1)


def test_switched_off_or_unbuildable_falls_back_to_torch(fresh_native, monkeypatch):
    x = _random_bytes((200, 72), seed=4)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not fresh_native.available()
    assert torch.equal(fresh_native.transpose_bytes(x), x.t())

    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.warns(RuntimeWarning, match="native byte kernels unavailable"):
        assert not fresh_native.available()
    assert torch.equal(fresh_native.transpose_bytes(x), x.t())
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
        native.transpose_bytes(torch.zeros(4, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D"):
        native.transpose_bytes(torch.zeros(4, 4, 4, dtype=torch.uint8))



def test_a_pool_made_by_another_process_is_not_used(monkeypatch):
    """Worker threads do not survive a fork: a pool recorded under another pid (the parent's) is
    replaced by one of this process's own, which does the work."""
    monkeypatch.setattr(native, "_SPLIT_BYTES", 1 << 12)
    x = _random_bytes((512, 256), seed=5)
    assert torch.equal(native.transpose_bytes(x), x.t())
    parents = native._state["pool"]
    monkeypatch.setitem(native._state, "pool_pid", -1)
    assert torch.equal(native.transpose_bytes(x), x.t())
    assert native._state["pool"] is not parents and native._state["pool_pid"] == os.getpid()


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


def test_block_amax_declines_what_it_does_not_take():
    x = torch.ones(64, 64, dtype=torch.bfloat16)
    assert native.block_amax(x.float(), 32) is None          # 32-bit floats: torch reduces them
    assert native.block_amax(x[:48], 32) is None             # rows not a multiple of b
    assert native.block_amax(x[:, :48], 32) is None          # nor columns
    assert native.block_amax(x.t(), 32) is None              # column-major
    assert native.block_amax(torch.ones(0, 64, dtype=torch.bfloat16), 32) is None
