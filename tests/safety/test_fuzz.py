"""Coverage-guided fuzzing of the readers (``fuzz_driver.py``), bounded for CI.

Seeds: a valid checkpoint of every format in ``helpers.FORMAT_CASES`` (a tensor with both
usages, one rowwise- or columnwise-only, a tied alias, a plain tensor, tree values), the safety
corpus's golden checkpoint and one holding real TE extra state (DelayedScaling, where the TE wheel
is installed), each in both layouts. Targets: whole single-file checkpoints, raw manifests, shard
headers. Engine: atheris where it is installed (the ``test`` extra installs it on Linux x86-64),
hypothesis otherwise. The targets run side by side, each in its own process under a 3.5 GiB
address-space limit and a per-input time limit; any exception class other than te-serial's, any
crash and any time-out fails the test, naming the saved input.

CI runs each target for ``TE_SERIAL_FUZZ_SECONDS`` (default 10 s); ``TE_SERIAL_FUZZ_LONG=1``
runs each for 10 minutes (or ``TE_SERIAL_FUZZ_SECONDS`` when set). ``TE_SERIAL_FUZZ_ENGINE``
(``atheris`` / ``hypothesis``) forces an engine.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import te_serial
from te_serial.checkpoint.manifest import MANIFEST_NAME
from te_serial.checkpoint.tree import unpack

from helpers import FORMAT_CASES, USAGES, make_input

from .safety_helpers import REPO, read_st

pytestmark = pytest.mark.fuzz

DRIVER = Path(__file__).with_name("fuzz_driver.py")
LONG = os.environ.get("TE_SERIAL_FUZZ_LONG", "") not in ("", "0")
SECONDS = float(os.environ.get("TE_SERIAL_FUZZ_SECONDS") or (600 if LONG else 10))
PER_INPUT_S = 10


def _format_state(i: int) -> dict:
    make, shape = FORMAT_CASES[i]
    x = make_input("random", shape, seed=i)
    r, c = USAGES[i % 2]  # rowwise-only or columnwise-only, beside a tensor with both
    w = make(True, True)(x)
    return {"w": w, "w_one": make(r, c)(x * 0.5), "tied": w, "bias": torch.randn(shape[-1]),
            "step": i, "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": f"fmt{i}", "raw": b"\x00"}}


def _te_extra_state() -> dict | None:
    """A state dict with a TE module's pickled ``_extra_state`` (DelayedScaling), as TE saves it."""
    import te_shim
    if te_shim.install() is None:
        return None
    import transformer_engine.common.recipe as recipe
    extra = {"recipe": recipe.DelayedScaling(amax_history_len=4),
             "scale_fwd": torch.tensor([1.0, 2.0, 0.5]), "amax_history_fwd": torch.rand(4, 3),
             "scale_bwd": torch.tensor([4.0, 8.0]), "amax_history_bwd": torch.rand(4, 2),
             "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "name": "fc1"}}
    return {"fc1.weight": te_serial.Float8Quantizer(2.0, 3.0)(torch.randn(16, 32)),
            "fc1._extra_state": torch.frombuffer(bytearray(pickle.dumps(extra)), dtype=torch.uint8),
            "fc2._extra_state": torch.empty(0, dtype=torch.uint8)}


@pytest.fixture(scope="session")
def fuzz_seeds(tmp_path_factory, golden) -> Path:
    """``root/dirs/<name>/`` and ``root/files/<name>.safetensors``: one checkpoint per format and
    the corpus's golden one, each saved in both layouts."""
    root = tmp_path_factory.mktemp("fuzz-seeds")
    (root / "dirs").mkdir()
    (root / "files").mkdir()
    for i in range(len(FORMAT_CASES)):
        state = _format_state(i)
        te_serial.save_quantized(state, root / "dirs" / f"fmt{i}", max_shard_size="16KB")
        te_serial.save_quantized(state, root / "files" / f"fmt{i}.safetensors")
    te = _te_extra_state()
    if te is not None:
        te_serial.save_quantized(te, root / "dirs" / "te_extra", max_shard_size="16KB")
        te_serial.save_quantized(te, root / "files" / "te_extra.safetensors")
    shutil.copytree(golden / "ckpt", root / "dirs" / "golden")
    shutil.copy(golden / "one.safetensors", root / "files" / "golden.safetensors")
    for p in [*(root / "dirs").iterdir(), *(root / "files").iterdir()]:
        te_serial.load_quantized(p, verify=True)
    return root


def _config(target: str, seeds_root: Path, work: Path) -> dict:
    dirs = sorted((seeds_root / "dirs").iterdir())
    cfg = {"target": target, "work": str(work), "seconds": SECONDS, "per_input_s": PER_INPUT_S,
           "engine": os.environ.get("TE_SERIAL_FUZZ_ENGINE", "auto"), "seed": 1}
    seeds = work / "seeds"
    seeds.mkdir(parents=True)
    if target == "file":
        cfg["seeds"] = [str(p) for p in sorted((seeds_root / "files").iterdir())]
    elif target == "manifest":  # one directory holding every checkpoint's shards (names are unique)
        mdir = work / "ckpt"
        mdir.mkdir()
        cfg["seeds"] = []
        for d in dirs:
            for f in d.iterdir():
                if f.name != MANIFEST_NAME:
                    assert not (mdir / f.name).exists(), f.name
                    shutil.copy(f, mdir / f.name)
            cfg["seeds"].append(str(shutil.copy(d / MANIFEST_NAME, seeds / f"{d.name}.msgpack")))
        shutil.copy(dirs[0] / MANIFEST_NAME, mdir / MANIFEST_NAME)
        cfg["manifest_dir"] = str(mdir)
    elif target == "header":  # seeds: selector byte + the shard's JSON header
        cfg["shards"], cfg["seeds"] = [], []
        for d in dirs:
            copy = Path(shutil.copytree(d, work / "ckpts" / d.name))
            for name in [f["name"] for f in unpack((copy / MANIFEST_NAME).read_bytes())["files"]]:
                raw = (copy / name).read_bytes()
                n = int.from_bytes(raw[:8], "little")
                k = len(cfg["shards"])
                cfg["shards"].append([str(copy), name])
                seed = seeds / f"{k}.bin"
                seed.write_bytes(bytes([k]) + raw[8:8 + n])
                cfg["seeds"].append(str(seed))
        assert len(cfg["shards"]) < 256
        read_st(copy / name)  # the seeds are well-formed safetensors headers
    return cfg


def _report(work: Path, rc: int | None, log: str) -> list[str]:
    out = []
    f = work / "findings.jsonl"
    if f.exists():
        for line in f.read_text().splitlines():
            d = json.loads(line)
            out.append(f"[{d['kind']}] {d['exc']} at {d['where']}: {d['message'][:300]}\n"
                       f"  input: {d['input']} ({d['size']} bytes)\n{d['traceback'][-1500:]}")
    for a in sorted(work.glob("*-*")):
        if a.is_file() and a.name.split("-")[0] in ("crash", "timeout", "oom", "leak", "slow"):
            out.append(f"[{a.name.split('-')[0]}] libFuzzer artifact {a}")
    if (work / "current.bin").exists():
        out.append(f"[crash or time-out] the driver died on {work / 'current.bin'}")
    if rc is None:
        out.append(f"[time-out] the fuzzing process did not finish\n{log[-3000:]}")
    elif rc != 0 and not out:
        out.append(f"[crash] fuzzing process exited with {rc}\n{log[-3000:]}")
    return out


TARGETS = ["file", "manifest", "header"]


@pytest.fixture(scope="module")
def fuzz_runs(request, fuzz_seeds, tmp_path_factory) -> dict:
    """Runs the selected targets side by side (one process each), returns target → (work dir,
    exit status or None on a time-out, log)."""
    wanted = [t for t in TARGETS if any(getattr(i, "callspec", None) and i.callspec.params.get("target") == t
                                        and i.originalname == "test_fuzz_target" for i in request.session.items)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    procs = {}
    for target in wanted or TARGETS:
        work = tmp_path_factory.mktemp(f"fuzz-{target}")
        cfg = _config(target, fuzz_seeds, work)
        (work / "config.json").write_text(json.dumps(cfg))
        log = open(work / "driver.log", "w")
        procs[target] = (work, log, subprocess.Popen([sys.executable, str(DRIVER), str(work / "config.json")],
                                                     env=env, cwd=str(work), stdout=log, stderr=subprocess.STDOUT))
    out = {}
    for target, (work, log, proc) in procs.items():
        try:
            rc = proc.wait(timeout=SECONDS + 3 * PER_INPUT_S + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        log.close()
        out[target] = (work, rc, (work / "driver.log").read_text(errors="replace"))
    return _Runs(out)


class _Runs(dict):
    def __repr__(self) -> str:  # keeps the logs out of pytest's failure report
        return f"<fuzz runs: {', '.join(self)}>"


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target(target, fuzz_runs):
    work, rc, text = fuzz_runs[target]
    stats = json.loads((work / "stats.json").read_text()) if (work / "stats.json").exists() else {}
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", text)
    execs = int(m.group(1)) if m else stats.get("execs", 0)
    print(f"fuzz {target}: engine {stats.get('engine')}, {execs} inputs in {SECONDS:.0f} s")
    problems = _report(work, rc, text)
    assert not problems, f"fuzzing {target} ({stats.get('engine')}, {execs} inputs) found:\n" + "\n".join(problems)
    assert execs > 0, f"the fuzzer ran no input:\n{text[-3000:]}"
