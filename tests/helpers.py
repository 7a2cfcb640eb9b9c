"""Shared test helpers: adversarial inputs, exact buffer comparison, the per-format case table.

Imported by test modules as ``from helpers import ...`` (``tests/`` is on ``sys.path`` through
``pythonpath`` in pyproject.toml); ``conftest.py`` holds only pytest hooks and fixtures.
"""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import formats as tsf

INPUT_KINDS = ("random", "zeros", "tiny", "outliers", "infinities", "specials")


def make_input(kind: str, shape, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Adversarial inputs: random, all-zero, tiny magnitudes, heavy outliers, ±inf, inf/NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "tiny":
        x = x * 1e-38 if dtype == torch.float32 else x * 1e-36  # near / below normal range
    elif kind == "outliers":
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = torch.randn(idx.numel(), generator=g) * 3e4
        flat[0] = 6e4 if dtype != torch.float16 else 6e4
    elif kind == "infinities":  # no NaN: what the compiled path sees (NaN inputs run eager)
        flat = x.view(-1)
        n = flat.numel()
        flat[n // 2] = float("inf")
        flat[(2 * n) // 3] = float("-inf")
        flat[1] = -0.0
    elif kind == "specials":
        flat = x.view(-1)
        n = flat.numel()
        flat[n // 3] = float("nan")
        flat[n // 2] = float("inf")
        flat[(2 * n) // 3] = float("-inf")
        flat[-1] = float("nan")
        flat[1] = -0.0
    elif kind != "random":
        raise ValueError(kind)
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape and dtype, NaN at the same places, equal bits everywhere else (NaN payloads may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    zero = torch.zeros((), dtype=a.dtype)
    return same_bits(torch.where(nan_a, zero, a), torch.where(nan_b, zero, b))


def assert_same_buffers(got: dict, want: dict, where: str = "") -> None:
    assert list(got) == list(want) or set(got) == set(want), f"{where}: buffers {list(got)} != {list(want)}"
    for name in want:
        g, w = got[name], want[name]
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{where}: {name} is {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}"
        if not same_bits(g, w):
            diff = (g.contiguous().view(torch.uint8) != w.contiguous().view(torch.uint8)).nonzero()
            raise AssertionError(f"{where}: {name} differs at {diff[:5].tolist()} "
                                 f"({diff.shape[0]} bytes)")


def assert_same_tensor(got, want, name: str = "") -> None:
    """Same class, shape, nominal dtype and bytes; for quantized tensors also quantizer and buffers."""
    assert type(got) is type(want), name
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if isinstance(want, tsf.QuantizedTensorStorage):
        assert got.quantizer == want.quantizer, name
        assert list(got.buffers()) == list(want.buffers()), name
        for n, b in want.buffers().items():
            assert same_bits(getattr(got, n), b), f"{name}.{n}"
    else:
        assert same_bits(got, want), name


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
USAGES = [(True, False), (False, True), (True, True)]

#: (quantizer factory taking (rowwise, columnwise), input shape): every format and variant on
#: 2-D, 3-D and non-multiple-of-128 shapes, shared by the round-trip tests
FORMAT_CASES = [
    (lambda r, c: ts.Float8Quantizer(2.0, 5.0, E4M3, rowwise=r, columnwise=c), (3, 5, 70)),
    (lambda r, c: ts.Float8CurrentScalingQuantizer(E5M2, rowwise=r, columnwise=c, force_pow_2_scales=True), (37, 53)),
    (lambda r, c: ts.MXFP8Quantizer(E4M3, rowwise=r, columnwise=c), (2, 32, 64)),
    (lambda r, c: ts.MXFP8Quantizer(E5M2, rowwise=r, columnwise=c, with_2d_quantization=True), (64, 96)),
    (lambda r, c: ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=1), (200, 300)),
    (lambda r, c: ts.Float8BlockQuantizer(E4M3, rowwise=r, columnwise=c, block_scaling_dim=2), (2, 65, 130)),
    (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c), (2, 16, 32)),
    (lambda r, c: ts.NVFP4Quantizer(rowwise=r, columnwise=c, with_2d_quantization=True), (144, 160)),
    (lambda r, c: ts.MXFP4Quantizer(rowwise=r, columnwise=c), (2, 48, 64)),
]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def seeded_hf_model(cfg, seed: int = 0):
    """A transformers causal LM of ``cfg`` in BF16 with seeded random weights, its 1-D parameters
    (biases, norms) moved away from their init values, so that a tensor lost in a round trip shows."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model
