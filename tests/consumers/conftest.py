"""Shared by the consumer tests (serving engines' own loading code on CPU).

Registers the ``consumers`` marker for this directory until pyproject.toml lists it, and sets
``VLLM_TARGET_DEVICE=cpu`` (unless set) before any test module here imports vLLM, directly or
through another engine (SGLang imports vLLM when it is installed): vLLM resolves its platform once
per process, on first use, and the CUDA wheel on a CPU-only torch otherwise resolves to
``UnspecifiedPlatform``.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "consumers: loads te-serial exports with a serving engine's own code "
                                       "on CPU (vLLM: pip install --no-deps -c constraints.txt "
                                       "-r tests/consumers/requirements-vllm.txt)")
