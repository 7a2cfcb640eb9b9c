"""Shared by the consumer tests (serving engines' own loading code on CPU).

Sets ``VLLM_TARGET_DEVICE=cpu`` (unless set) before any test module here imports vLLM, directly or
through another engine (SGLang imports vLLM when it is installed): vLLM resolves its platform once
per process, on first use, and the CUDA wheel on a CPU-only torch otherwise resolves to
``UnspecifiedPlatform``.

The vLLM test modules (``test_vllm_*.py``) are marked ``consumers`` here, and skipped where vLLM
is not installed, except in CI, which installs it (never skipped there).
"""

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                              reason="vLLM not installed: pip install --no-deps -c constraints.txt -r "
                                     "tests/consumers/requirements.txt")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith("test_vllm_"):
            item.add_marker(pytest.mark.consumers)
            item.add_marker(_NO_VLLM)
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))

