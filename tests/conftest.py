"""Shared test helpers: adversarial inputs and exact buffer comparison."""

from __future__ import annotations

import pytest
import torch

INPUT_KINDS = ("random", "zeros", "tiny", "outliers", "specials")


def make_input(kind: str, shape, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Adversarial inputs: random, all-zero, tiny magnitudes, heavy outliers, inf/NaN."""
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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
