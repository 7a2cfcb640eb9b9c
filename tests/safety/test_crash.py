"""Saves are atomic: a save SIGKILLed at any moment, or failing with an exception part-way,
leaves the previous checkpoint loadable bit-exactly, and the next save cleans up after it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import te_serial
from te_serial.checkpoint import tree as tree_mod
from te_serial.checkpoint import writer as writer_mod
from te_serial.checkpoint.manifest import MANIFEST_NAME

from .safety_helpers import _env, assert_same_state, make_state


CHILD = textwrap.dedent("""
    import sys, torch, te_serial
    path, tag, mib = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    n = mib * (1 << 20) // 4 // 8
    sd = {f"big.{i}": torch.full((n,), tag + i) for i in range(8)}
    sd["w_mx"] = te_serial.MXFP8Quantizer()(torch.full((64, 64), tag, dtype=torch.bfloat16))
    print("ready", flush=True)
    te_serial.save_quantized(sd, path, max_shard_size="30MB")
    print("saved", flush=True)
""")
#: when to SIGKILL a child saving over an existing checkpoint: as soon as safetensors' own
#: temporary file (save_file writes ``.tmpXXXXXX`` and renames it) or te-serial's first temporary
#: file appears, or this many seconds after the child starts saving (~1 s for 200 MB here)
KILL_MOMENTS = ["safetensors-tmp", "te-serial-tmp", 0.1, 0.5]
SAFETENSORS_TMP = ".tmp"
BIG_MIB = 200


def _is_new(out, tag: float) -> bool:
    if set(out) != {f"big.{i}" for i in range(8)} | {"w_mx"}:
        return False
    n = BIG_MIB * (1 << 20) // 4 // 8
    for i in range(8):
        t = out[f"big.{i}"]
        assert t.shape == (n,) and bool((t == tag + i).all()), f"new checkpoint, but big.{i} is wrong"
    return True


@pytest.fixture(scope="module")
def killed_saves(golden, tmp_path_factory) -> dict:
    """Children saving 200 MB over existing checkpoints (both forms), SIGKILLed at KILL_MOMENTS.

    They run side by side to keep the file fast. Returns form → [(path, tag, moment, saw_tmp)],
    ``saw_tmp``: a temporary file of the killed save was on disk right after the kill.
    """
    root = tmp_path_factory.mktemp("killed")
    child = root / "child.py"
    child.write_text(CHILD)
    jobs = []
    for form in ("dir", "file"):
        for i, moment in enumerate(KILL_MOMENTS):
            tag = 10.0 * (len(jobs) + 1)
            if form == "dir":
                path = Path(shutil.copytree(golden / "ckpt", root / f"ckpt{i}"))
                watch = path
            else:
                (root / f"d{i}").mkdir()
                path = Path(shutil.copy(golden / "one.safetensors", root / f"d{i}" / "one.safetensors"))
                watch = path.parent
            proc = subprocess.Popen([sys.executable, str(child), str(path), str(tag), str(BIG_MIB)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
            jobs.append((form, path, watch, tag, moment, proc))
    errors: list[str] = []
    saw_tmp: dict[int, bool] = {}

    def has_tmp(watch: Path, prefixes=(writer_mod.TMP_PREFIX, SAFETENSORS_TMP)) -> bool:
        return any(n.startswith(prefixes) for n in os.listdir(watch))

    def kill(k, watch, moment, proc):
        try:
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                errors.append(f"child did not start: {line!r} {proc.stderr.read()[-2000:]!r}")
                return
            if isinstance(moment, str):
                prefix = SAFETENSORS_TMP if moment == "safetensors-tmp" else writer_mod.TMP_PREFIX
                deadline = time.monotonic() + 30
                while not has_tmp(watch, (prefix,)) and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.0002)
            else:
                time.sleep(moment)
        finally:
            proc.kill()  # SIGKILL, this child only
            proc.wait()
            saw_tmp[k] = has_tmp(watch)

    threads = [threading.Thread(target=kill, args=(k, w, m, p)) for k, (_, _, w, _, m, p) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for *_, proc in jobs:
        proc.stdout.close()
        proc.stderr.close()
    assert not errors, errors
    out: dict[str, list] = {"dir": [], "file": []}
    for k, (form, path, _, tag, moment, _) in enumerate(jobs):
        out[form].append((path, tag, moment, saw_tmp[k]))
    return out


@pytest.mark.slow
def test_killed_save_leaves_old_checkpoint(killed_saves, state, form):
    """SIGKILLed at any moment, a save over an existing checkpoint leaves the old checkpoint
    bit-exactly, or (killed after the commit point) the complete new one; never anything else."""
    survived = 0
    for path, tag, moment, _ in killed_saves[form]:
        out = te_serial.load_quantized(path, verify=True)
        if not _is_new(out, tag):  # else killed after the commit point: the new one is whole
            assert_same_state(out, state, f"<killed at {moment}>")
            survived += 1
        assert te_serial.verify(path) > 0
        if form == "dir":  # whatever the manifest names is there and whole
            names = {f["name"] for f in tree_mod.unpack((path / MANIFEST_NAME).read_bytes())["files"]}
            assert names <= set(os.listdir(path))
    assert survived >= 1, "every child finished before its kill: the test did not test anything"


@pytest.mark.slow
def test_next_save_cleans_up_after_killed_directory_save(killed_saves, state):
    assert any(saw for *_, saw in killed_saves["dir"]), "no kill left a temporary file behind"
    for path, *_ in killed_saves["dir"]:
        manifest = te_serial.save_quantized(state, path, max_shard_size="12KB")
        assert set(os.listdir(path)) == {MANIFEST_NAME, *manifest.files}
        assert_same_state(te_serial.load_quantized(path, verify=True), state)


@pytest.mark.slow
def test_next_save_cleans_up_after_killed_single_file_save(killed_saves, state):
    assert any(saw for *_, saw in killed_saves["file"]), "no kill left a temporary file behind"
    for path, *_ in killed_saves["file"]:
        te_serial.save_quantized(state, path)
        assert_same_state(te_serial.load_quantized(path, verify=True), state)
        assert os.listdir(path.parent) == [path.name]


def _failing_save_file(fail_on: int, exc: BaseException, partial: bool = False):
    real = writer_mod.save_file
    count = [0]

    def save_file(tensors, filename, metadata=None):
        count[0] += 1
        if count[0] == fail_on:
            if partial:  # a half-written file under the temporary name, then the error
                Path(filename).write_bytes(b"\x00" * 1000)
            raise exc
        return real(tensors, filename, metadata=metadata)
    return save_file


def inject_failure(monkeypatch, fail_on: int, exc: BaseException, partial: bool = False) -> None:
    """Makes the ``fail_on``-th shard file of the next save fail with ``exc``; with ``partial``,
    after clobbering what it had written. A writer that hands shards to safetensors' ``save_file``
    fails there; one that streams into its own files fails at the file's fsync (every shard
    is fsync'd before the manifest commits)."""
    if hasattr(writer_mod, "save_file"):
        monkeypatch.setattr(writer_mod, "save_file", _failing_save_file(fail_on, exc, partial))
        return
    real = os.fsync
    count = [0]

    def fsync(fd):
        count[0] += 1
        if count[0] == fail_on:
            if partial:  # a half-written file under the temporary name, then the error
                try:
                    os.pwrite(fd, b"\x00" * 1000, 0)
                except OSError:
                    pass
            raise exc
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


FAILURES = {
    "oserror-2nd-shard": (2, OSError(28, "No space left on device (injected)"), False),
    "oserror-2nd-shard-partial": (2, OSError(28, "No space left on device (injected)"), True),
    "keyboardinterrupt-3rd-shard": (3, KeyboardInterrupt(), True),
    "oserror-1st-shard": (1, OSError(5, "I/O error (injected)"), True),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_save_leaves_old_checkpoint(ckpt_dir, state, monkeypatch, failure):
    fail_on, exc, partial = FAILURES[failure]
    before = sorted(os.listdir(ckpt_dir))
    inject_failure(monkeypatch, fail_on, exc, partial)
    with pytest.raises(type(exc)):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), state)
    assert te_serial.verify(ckpt_dir) > 0
    after = os.listdir(ckpt_dir)
    assert not [n for n in after if n.startswith(writer_mod.TMP_PREFIX)], after
    assert set(before) <= set(after)


def test_failed_manifest_commit_leaves_old_checkpoint(ckpt_dir, state, monkeypatch):
    real = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst).name == MANIFEST_NAME:
            raise OSError(5, "I/O error (injected)")
        return real(src, dst, *a, **k)
    monkeypatch.setattr(writer_mod.os, "replace", replace)
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), state)
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(writer_mod.TMP_PREFIX)]


def test_failed_save_leftovers_are_cleaned(ckpt_dir, state, monkeypatch):
    inject_failure(monkeypatch, 2, OSError(28, "injected"))
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_dir, max_shard_size="12KB")
    monkeypatch.undo()
    manifest = te_serial.save_quantized(state, ckpt_dir, max_shard_size="12KB")
    assert set(os.listdir(ckpt_dir)) == {MANIFEST_NAME, *manifest.files}


@pytest.mark.parametrize("partial", [False, True])
def test_failed_single_file_save_leaves_old_file(ckpt_file, state, monkeypatch, partial):
    inject_failure(monkeypatch, 1, OSError(28, "injected"), partial)
    with pytest.raises(OSError):
        te_serial.save_quantized(make_state(1), ckpt_file)
    monkeypatch.undo()
    assert_same_state(te_serial.load_quantized(ckpt_file, verify=True), state)
    assert os.listdir(ckpt_file.parent) == [ckpt_file.name]


def test_save_over_existing_checkpoint_replaces_it(ckpt_dir, ckpt_file):
    """The good path the failure tests compare with: a new save fully replaces the old one."""
    new = make_state(1)
    manifest = te_serial.save_quantized(new, ckpt_dir, max_shard_size="12KB")
    assert_same_state(te_serial.load_quantized(ckpt_dir, verify=True), new)
    assert set(os.listdir(ckpt_dir)) == {MANIFEST_NAME, *manifest.files}
    te_serial.save_quantized(new, ckpt_file)
    assert_same_state(te_serial.load_quantized(ckpt_file, verify=True), new)
    assert sorted(os.listdir(ckpt_file.parent)) == sorted([ckpt_file.name, ckpt_dir.name])
