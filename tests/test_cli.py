"""The ``te-serial`` command line through a subprocess (``python -m te_serial.cli``): inspect,
convert, verify, diff, --help, and the error exits (one line on stderr naming file and tensor).

Inputs are made in-process; the commands (each a fresh interpreter importing torch) run two at a
time in one batch, so the whole file costs a few interpreter start-ups."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import te_serial as ts
from te_serial import formats as tsf

from _convert_data import deepseek_checkpoint, plain_state_dict, randn

tc = importlib.import_module("te_serial.conversion")

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "te_serial.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    sd = plain_state_dict()
    (d / "hf").mkdir()
    save_file(sd, str(d / "hf" / "model.safetensors"), metadata={"format": "pt"})
    te = {"w.weight": ts.recipes.recipe_quantizer("mxfp8")(randn((128, 256), 1)), "b": randn((256,), 2)}
    ts.save_quantized(te, d / "te")
    ts.save_quantized(te, d / "te_copy")
    ts.save_quantized(te, d / "te_bad")
    shard = next((d / "te_bad").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0xFF
    shard.write_bytes(bytes(data))
    tc.convert(d / "hf", d / "hf_mxfp8", recipe="mxfp8")
    deepseek_checkpoint(d / "ds")
    (d / "gptq").mkdir()
    save_file({"l.qweight": torch.zeros(4, 4, dtype=torch.int32), "l.scales": torch.ones(1, 4)},
              str(d / "gptq" / "model.safetensors"))
    (d / "rules.txt").write_text("*.q_proj.weight nvfp4_2d\n*.up_proj.weight mxfp8\n")
    (d / "busy").mkdir()
    (d / "busy" / "x").write_text("x")
    cmds = {
        "help": ["--help"],
        "convert_help": ["convert", "--help"],
        "inspect": ["inspect", d / "te"],
        "inspect_as": ["inspect", d / "hf", "--as", "mxfp8", "--json"],
        "inspect_ds": ["inspect", d / "ds"],
        "convert": ["convert", d / "hf", d / "out", "--recipe", "mxfp8", "--report", d / "r.json", "--progress",
                    "--max-shard-size", "100KB"],
        "convert_rules": ["convert", d / "hf", d / "out_rules", "--rules", d / "rules.txt", "--quiet"],
        "convert_ds": ["convert", d / "ds", d / "out_ds", "--recipe", "fp8_block", "--json"],
        "convert_serving": ["convert", d / "te", d / "out_mo", "--recipe", "modelopt_mxfp8", "--activations",
                            "dynamic"],
        "serving_no_amax": ["convert", d / "te", d / "out_mo8", "--recipe", "modelopt_fp8"],
        "verify": ["verify", d / "te"],
        "verify_bad": ["verify", d / "te_bad"],
        "diff_same": ["diff", d / "te", d / "te_copy"],
        "diff": ["diff", d / "hf", d / "hf_mxfp8"],
        "unknown_layout": ["convert", d / "gptq", d / "out_gptq", "--recipe", "mxfp8"],
        "bad_recipe": ["convert", d / "hf", d / "out_bad", "--recipe", "mxfp9"],
        "busy": ["convert", d / "hf", d / "busy", "--recipe", "mxfp8"],
        "missing": ["inspect", d / "nothere"],
        "diff_error": ["diff", d / "hf", d / "nothere"],
        "usage": ["convert", d / "hf"],
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cmds, pool.map(_run, cmds.values())))
    return d, results


def _one_line_error(r, rc=1, *needles):
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("te-serial: error:"), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_help_has_examples(cli):
    _, r = cli
    assert r["help"].returncode == 0
    out = r["help"].stdout
    for word in ("examples:", "inspect", "convert", "verify", "diff", "demo", "exit status"):
        assert word in out
    assert r["convert_help"].returncode == 0 and "--recipe" in r["convert_help"].stdout
    assert "example" in r["convert_help"].stdout
    for name in ("modelopt_nvfp4", "modelopt_mxfp8", "modelopt_fp8_pb_wo", "compressed_tensors_nvfp4",
                 "compressed_tensors_mxfp8", "--activations", "--activation-amax", "exact codes"):
        assert name in r["convert_help"].stdout, name


def test_convert_to_a_serving_layout(cli):
    d, r = cli
    assert r["convert_serving"].returncode == 0, r["convert_serving"].stderr
    assert "activations: MXFP8" in r["convert_serving"].stdout and "lossless" in r["convert_serving"].stdout
    assert json.loads((d / "out_mo" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "MXFP8"
    _one_line_error(r["serving_no_amax"], 1, "static activation scales", "--activation-amax")


def test_inspect(cli):
    d, r = cli
    assert r["inspect"].returncode == 0, r["inspect"].stderr
    out = r["inspect"].stdout
    assert "te-serial checkpoint, 2 tensors" in out and "w.weight" in out and "mxfp8" in out and "row+col" in out
    assert "total: 2 tensors" in out
    doc = json.loads(r["inspect_as"].stdout)
    assert doc["layout"] == "safetensors" and doc["count"] == len(plain_state_dict())
    est = tc.estimate_bytes(d / "hf", "mxfp8")
    assert doc["as"]["total_bytes"] == sum(est.values())
    assert {t["name"]: t["as_bytes"] for t in doc["tensors"]} == est
    assert "deepseek_fp8" in r["inspect_ds"].stdout


def test_convert_with_progress_and_report(cli):
    d, r = cli
    c = r["convert"]
    assert c.returncode == 0, c.stderr
    bar = c.stderr.strip().splitlines()[-1]       # tqdm's last line: 100 %, done/total with units, rate
    assert bar.startswith("converting: 100%") and "B/s" in bar and "0.00/0.00" not in bar, bar
    assert "lossy" in c.stdout and "model.layers.0.mlp.up_proj.weight" in c.stdout and "SNR dB" in c.stdout
    rep = tc.ConversionReport.load(d / "r.json")
    assert rep.target_layout == "te-serial" and len(rep.lossy) == 2
    assert len(list((d / "out").glob("model-*.safetensors"))) > 1
    loaded = ts.load_quantized(d / "out")
    assert isinstance(loaded["model.layers.0.mlp.up_proj.weight"], tsf.MXFP8Tensor)
    q = r["convert_rules"]
    assert q.returncode == 0 and len(q.stdout.strip().splitlines()) == 1 and "lossy" in q.stdout
    out = ts.load_quantized(d / "out_rules")
    assert out["model.layers.0.self_attn.q_proj.weight"].quantizer.kind == "nvfp4"
    ds = json.loads(r["convert_ds"].stdout)
    assert r["convert_ds"].returncode == 0 and ds["lossless"] and ds["source_layout"] == "deepseek_fp8"


def test_verify(cli):
    _, r = cli
    assert r["verify"].returncode == 0 and r["verify"].stdout.startswith("ok:")
    _one_line_error(r["verify_bad"], 1, "ChecksumError", "file=", "tensor=")


def test_diff(cli):
    _, r = cli
    assert r["diff_same"].returncode == 0 and "2 identical, 0 different" in r["diff_same"].stdout
    assert r["diff"].returncode == 1
    assert "differs" in r["diff"].stdout and "model.layers.0.mlp.up_proj.weight" in r["diff"].stdout
    _one_line_error(r["diff_error"], 2, "file=")


def test_error_exits(cli):
    _, r = cli
    _one_line_error(r["unknown_layout"], 1, "UnknownLayoutError", "GPTQ", "file=", "tensor=")
    _one_line_error(r["bad_recipe"], 1, "unknown target", "mxfp9")
    _one_line_error(r["busy"], 1, "not empty", "file=")
    _one_line_error(r["missing"], 1, "no such file", "file=")
    assert r["usage"].returncode == 2 and "usage:" in r["usage"].stderr


@pytest.mark.parametrize("total", [1234, 3_200_000_000_000])
def test_progress_bar_scales_small_and_large_jobs(total):
    import io
    from te_serial.cli import _ProgressBar
    out = io.StringIO()
    bar = _ProgressBar(out, "converting")
    for done, name in ((0, ""), (total // 3, "a.weight"), (total, "")):
        bar(done, total, name)
    bar.close()
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    size = "1.23k" if total < 1e6 else "3.20T"
    assert last.startswith("converting: 100%") and f"{size}/{size}" in last and "B/s" in last, last
