"""Fixtures of the checkpoint-safety tests (helpers: ``safety_helpers.py``, cases: ``corpus.py``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import te_serial

from .safety_helpers import Ck, assert_same_state, make_state
from .sandbox import Sandbox


@pytest.fixture(scope="session")
def state() -> dict:
    return make_state(0)


@pytest.fixture(scope="session")
def golden(tmp_path_factory, state) -> Path:
    root = tmp_path_factory.mktemp("golden")
    te_serial.save_quantized(state, root / "ckpt", max_shard_size="12KB")
    te_serial.save_quantized(state, root / "one.safetensors")
    assert len([f for f in os.listdir(root / "ckpt") if f.endswith(".safetensors")]) >= 3
    for p in (root / "ckpt", root / "one.safetensors"):  # warm caches (schema compile, lazy imports)
        assert_same_state(te_serial.load_quantized(p, verify=True), state)
    return root


@pytest.fixture
def ckpt_dir(golden, tmp_path) -> Path:
    return Path(shutil.copytree(golden / "ckpt", tmp_path / "ckpt"))


@pytest.fixture
def ckpt_file(golden, tmp_path) -> Path:
    return Path(shutil.copy(golden / "one.safetensors", tmp_path / "one.safetensors"))


@pytest.fixture(params=["dir", "file"])
def form(request) -> str:
    return request.param


@pytest.fixture
def ck(form, request) -> Ck:
    return Ck(request.getfixturevalue("ckpt_dir" if form == "dir" else "ckpt_file"))


@pytest.fixture(scope="session")
def golden_nosums(tmp_path_factory, state) -> Path:
    """The golden checkpoint (both forms) saved with ``checksums=False``."""
    root = tmp_path_factory.mktemp("golden-nosums")
    te_serial.save_quantized(state, root / "ckpt", max_shard_size="12KB", checksums=False)
    te_serial.save_quantized(state, root / "one.safetensors", checksums=False)
    for p in (root / "ckpt", root / "one.safetensors"):
        assert_same_state(te_serial.load_quantized(p), state)
    return root


@pytest.fixture(scope="session")
def sandbox():
    """The worker that runs calls on hostile inputs in limited child processes (``sandbox.py``)."""
    box = Sandbox()
    box.start()
    yield box
    box.close()
