"""te_serial.slice_quantized: block-aligned row / column ranges of every format and usage.

Each slice's buffers equal the same range quantized on its own, byte for byte (scale padding
included), except where the scale depends on the whole tensor: per-tensor FP8 is compared with
the range quantized with the parent's scale, NVFP4 with the parent's bytes and dequantized values
(it keeps the parent's tensor amax). Unaligned ranges raise ShapeError.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from helpers import E4M3, E5M2, INPUT_KINDS, USAGES, assert_same_buffers, make_input, same_bits, same_values


def _blockwise_align(q) -> tuple[int, int]:
    if q.block_scaling_dim == 2:
        return 128, 128
    # 1×128: rowwise blocks run along K, the columnwise copy's along M
    return (128 if q.columnwise else 1), (128 if q.rowwise else 1)


#: kind → the (rows, cols) alignment a slice needs (the rule README and formats/slicing.py state)
SLICE_RULES = {
    "fp8_delayed_scaling": lambda q: (1, 1),
    "fp8_current_scaling": lambda q: (1, 1),
    "mxfp8": lambda q: (32, 32),
    "fp8_blockwise": _blockwise_align,
    "nvfp4": lambda q: (16, 16),
    "mxfp4": lambda q: (32, 32),
}

#: (quantizer factory (rowwise, columnwise), input dtype, 2-D shape, 3-D shape)
CASES = [
    (lambda r, c: ts.Float8Quantizer(2.0, 5.0, E4M3, rowwise=r, columnwise=c), torch.bfloat16, (37, 53), (3, 5, 70)),
    (lambda r, c: ts.Float8CurrentScalingQuantizer(E5M2, rowwise=r, columnwise=c, force_pow_2_scales=True),
     torch.float32, (37, 53), (3, 5, 70)),
    (lambda r, c: ts.MXFP8Quantizer(E4M3, rowwise=r, columnwise=c), torch.bfloat16, (96, 128), (2, 48, 64)),
    (lambda r, c: ts.MXFP8Quantizer(E5M2, rowwise=r, columnwise=c, with_2d_quantization=True),
     torch.bfloat16, (96, 128), (2, 48, 64)),
    (lambda r, c: ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=1),
     torch.bfloat16, (300, 260), (2, 130, 300)),
    (lambda r, c: ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=2),
     torch.float32, (300, 260), (2, 130, 300)),
    (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c), torch.bfloat16, (64, 48), (2, 24, 64)),
    (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_2d_quantization=True),
     torch.bfloat16, (64, 48), (2, 24, 64)),
    (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_rht=True, with_post_rht_amax=True),
     torch.bfloat16, (64, 48), (2, 24, 64)),
    (lambda r, c: ts.MXFP4Quantizer(rowwise=r, columnwise=c), torch.bfloat16, (96, 128), (2, 48, 64)),
]

PARAMS = [pytest.param(i, usage, dim, kind, id=f"{make(*usage).layout_name()}-{usage}-{dim}d-{kind}")
          for i, (make, _, _, _) in enumerate(CASES) for usage in USAGES for dim in (2, 3)
          for kind in INPUT_KINDS if kind != "specials" or make(*usage).kind != "mxfp4"]  # MXFP4 refuses NaN


def _ranges(rng: random.Random, n: int, align: int):
    """Random block-aligned (start, stop) pairs within n: whole, to the end, inside, one block."""
    blocks = math.ceil(n / align)
    out = [None, (0, n)]
    for _ in range(3):
        b0 = rng.randrange(blocks)
        b1 = rng.randrange(b0 + 1, blocks + 1)
        out.append((b0 * align, min(b1 * align, n)))
    return out


def _expected(q, x2: torch.Tensor, x: torch.Tensor, rows, cols):
    """The range quantized on its own (per-tensor FP8: with the parent's scale)."""
    m, k = x2.shape
    c0, c1 = cols or (0, k)
    part = x[..., c0:c1] if rows is None else x2[rows[0]:rows[1], c0:c1]
    part = part.contiguous()
    if isinstance(q, (ts.Float8Quantizer, ts.Float8CurrentScalingQuantizer)):
        scale = float(q._scale(x2))
        return ts.Float8Quantizer(scale, 0.0, q.fp8_dtype, rowwise=q.rowwise, columnwise=q.columnwise)(part)
    return q(part)


def _nvfp4_expected(q, parent, new_shape, rows, cols) -> dict[str, torch.Tensor]:
    """NVFP4 keeps the parent's amax: the parent's bytes of the range, scales re-padded with zeros."""
    m, k = math.prod(parent.shape[:-1]), parent.shape[-1]
    r0, r1 = rows or (0, m)
    c0, c1 = cols or (0, k)
    nr, nc = r1 - r0, c1 - c0
    specs = q.describe_buffers(new_shape)
    b = parent.buffers()
    out = {}
    if q.rowwise:
        out["_rowwise_data"] = b["_rowwise_data"].reshape(m, k // 2)[r0:r1, c0 // 2:c1 // 2].reshape(
            specs["_rowwise_data"].shape)
        s = torch.zeros(specs["_rowwise_scale_inv"].shape, dtype=torch.uint8)
        s[:nr, :nc // 16] = b["_rowwise_scale_inv"][r0:r1, c0 // 16:c1 // 16]
        out["_rowwise_scale_inv"] = s
        out["_amax_rowwise"] = b["_amax_rowwise"]
    if q.columnwise:
        out["_columnwise_data"] = b["_columnwise_data"].reshape(k, m // 2)[c0:c1, r0 // 2:r1 // 2].reshape(
            specs["_columnwise_data"].shape)
        s = torch.zeros(specs["_columnwise_scale_inv"].shape, dtype=torch.uint8)
        s[:nc, :nr // 16] = b["_columnwise_scale_inv"][c0:c1, r0 // 16:r1 // 16]
        out["_columnwise_scale_inv"] = s
        out["_amax_columnwise"] = b["_amax_columnwise"]
    return out


@pytest.mark.parametrize("case,usage,dim,kind", PARAMS)
def test_aligned_slices_equal_the_range_quantized_on_its_own(case, usage, dim, kind):
    make, dtype, shape2, shape3 = CASES[case]
    q = make(*usage)
    shape = shape2 if dim == 2 else shape3
    x = make_input(kind, shape, dtype, seed=case * 7 + dim)
    t = q(x)
    m, k = math.prod(shape[:-1]), shape[-1]
    x2 = x.reshape(m, k)
    ra, ca = q.slice_alignment()
    assert (ra, ca) == SLICE_RULES[q.kind](q)
    rng = random.Random(f"{case}-{usage}-{dim}-{kind}")
    pairs = [(r, c) for r in _ranges(rng, m, ra) for c in _ranges(rng, k, ca)]
    for rows, cols in rng.sample(pairs, 8) + [(None, None)]:
        s = ts.slice_quantized(t, rows=rows, cols=cols)
        c0, c1 = cols or (0, k)
        new_shape = (*shape[:-1], c1 - c0) if rows is None else (rows[1] - rows[0], c1 - c0)
        where = f"rows={rows} cols={cols}"
        assert type(s) is type(t) and s.quantizer == q and tuple(s.shape) == new_shape, where
        assert s.dtype == t.dtype
        q.check_buffers(new_shape, s.buffers(), where=where)
        if isinstance(q, ts.NVFP4Quantizer):
            assert_same_buffers(s.buffers(), _nvfp4_expected(q, t, new_shape, rows, cols), where)
        else:
            assert_same_buffers(s.buffers(), _expected(q, x2, x, rows, cols).buffers(), where)
        whole = t.dequantize(torch.float32).reshape(m, k)
        r0, r1 = rows or (0, m)
        want = whole[r0:r1, c0:c1].reshape(new_shape)
        assert same_values(s.dequantize(torch.float32), want), where


@pytest.mark.parametrize("case", range(len(CASES)))
def test_unaligned_and_bad_ranges_are_refused(case):
    make, dtype, shape, _ = CASES[case]
    for usage in USAGES:
        q = make(*usage)
        t = q(make_input("random", shape, dtype))
        m, k = shape
        ra, ca = q.slice_alignment()
        if ra > 1:
            with pytest.raises(tse.ShapeError, match=f"blocks of {ra}"):
                ts.slice_quantized(t, rows=(ra // 2, m))
            with pytest.raises(tse.ShapeError, match=f"blocks of {ra}"):
                ts.slice_quantized(t, rows=(0, ra + 1))
        if ca > 1:
            with pytest.raises(tse.ShapeError, match=f"blocks of {ca}"):
                ts.slice_quantized(t, cols=slice(ca - 1, None))
        for bad in [(0, 0), (0, m + 1), (5, 2)]:
            with pytest.raises(tse.ShapeError):
                ts.slice_quantized(t, rows=bad)
        with pytest.raises(tse.ShapeError, match="step 1"):
            ts.slice_quantized(t, cols=slice(0, k, 2))


def test_a_range_may_end_in_a_partial_block_at_the_tensor_end():
    x = make_input("outliers", (300, 260), torch.bfloat16, 1)
    q = ts.Float8BlockQuantizer(block_scaling_dim=2)
    t = q(x)
    s = ts.slice_quantized(t, rows=slice(128, None), cols=(256, 260))
    assert tuple(s.shape) == (172, 4)
    assert_same_buffers(s.buffers(), q(x[128:, 256:].contiguous()).buffers())


def test_python_slices_and_negative_bounds():
    x = make_input("random", (2, 48, 64), torch.bfloat16, 2)
    t = ts.MXFP8Quantizer()(x)
    a = ts.slice_quantized(t, rows=slice(32, None), cols=slice(-32, None))
    b = ts.slice_quantized(t, rows=(32, 96), cols=(32, 64))
    assert tuple(a.shape) == (64, 32)
    for n, buf in a.buffers().items():
        assert same_bits(buf, getattr(b, n)), n
    assert tuple(ts.slice_quantized(t, cols=(0, 32)).shape) == (2, 48, 32)  # leading dims kept


def test_slice_needs_a_quantized_tensor():
    with pytest.raises(tse.FormatError):
        ts.slice_quantized(torch.zeros(4, 4), rows=(0, 2))
