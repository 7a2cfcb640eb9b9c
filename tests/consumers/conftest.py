"""Shared by the consumer tests (serving engines' own loading code on CPU).

Sets ``VLLM_TARGET_DEVICE=cpu`` (unless set) before any test module here imports vLLM, directly or
through another engine (SGLang imports vLLM when it is installed): vLLM resolves its platform once
per process, on first use, and the CUDA wheel on a CPU-only torch otherwise resolves to
``UnspecifiedPlatform``.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

