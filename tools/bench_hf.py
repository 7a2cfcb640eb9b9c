"""``tools/bench.py hf``: transformers' ``from_pretrained`` of a te-serial checkpoint.

A Llama-shaped model (``--hidden`` × ``--layers``, BF16 about ``--gib`` GiB) is saved three ways:
a plain BF16 Hugging Face directory (``save_pretrained``), and a te-serial checkpoint of the same
model quantized with ``--recipe`` (``quantize_model`` + ``save_quantized``). Each load runs in a
child process of its own (wall time from the start of the load to a model whose every byte is
resident, and the child's peak RSS):

* ``from_pretrained(te_serial_dir)`` (``te_serial.hf``);
* ``te_serial.load_into`` of the same checkpoint into a meta model (the issue's ≤ 1.1× baseline);
* transformers' own ``from_pretrained`` of the BF16 directory (≤ 1.0×: it reads 2-4× the bytes);
* ``from_pretrained`` of the BF16 directory with ``TeSerialConfig(recipe=...)``: quantize on load,
  beside ``quantize_model`` + ``load_into`` of the same directory (te-serial's own way).

The model's module is imported before the clock starts (a cost both ways share, larger than the
load itself at this size); the first two also time a second load in the same process ("warm"):
transformers' first ``from_pretrained`` in a process builds its conversion mappings (about a
thousand regexes), which later ones reuse.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, transformers
import te_serial as ts
import te_serial.hf  # registers the te_serial method
mode, path, cfg_json, base_dir = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
cfg = transformers.LlamaConfig(**json.loads(cfg_json))
transformers.LlamaForCausalLM  # the model's module imported (by every mode alike) before the clock starts
transformers.logging.disable_progress_bar()

def status(field):
    return int([l for l in open("/proc/self/status") if l.startswith(field + ":")][0].split()[1]) * 1024

def load(mode, path):
    if mode == "load_into":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        ts.load_into(model, path)
    elif mode.startswith("load_into:"):  # quantize on the way in, te-serial's own way
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        ts.quantize_model(model, mode[10:], columnwise=False)
        ts.load_into(model, path)
    elif mode.startswith("on_load:"):  # quantize on load from the BF16 directory
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=te_serial.hf.TeSerialConfig(recipe=mode[8:], usages=["rowwise"]))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for p in model.parameters():  # every byte resident
        for b in (p.buffers().values() if hasattr(p, "quantizer") else [p]):
            b.reshape(-1).view(torch.uint8).max()
    return model

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak RSS from here
before = status("VmRSS")
t0 = time.perf_counter()
model = load(mode, path)
seconds = time.perf_counter() - t0
out = {"seconds": seconds, "rss": status("VmHWM"), "added": status("VmHWM") - before}
if mode in ("from_pretrained", "load_into") and base_dir:  # a second load in the same process: warm
    del model
    load(mode, path)
    t0 = time.perf_counter()
    load(mode, path)
    out["warm"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def add_parser(sub) -> None:
    p = sub.add_parser("hf", help="transformers' from_pretrained of a te-serial checkpoint vs load_into and BF16")
    p.add_argument("--gib", type=float, default=1.0, help="BF16 size of the model")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--repeat", type=int, default=3, help="runs of each load (median)")
    p.add_argument("--dir", default=None)


def _config(hidden: int, gib: float) -> dict:
    inter = hidden * 3
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2
    vocab = 8192  # small beside the layers: the linear weights are what the recipes quantize
    layers = max(1, int(gib * (1 << 30) - 2 * vocab * hidden * 2) // per_layer)
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, tie_word_embeddings=False)


def run(args) -> None:
    import statistics
    import torch
    import transformers
    import te_serial as ts
    work = Path(tempfile.mkdtemp(prefix="te-serial-hf-", dir=args.dir))
    try:
        cfg = _config(args.hidden, args.gib)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.bfloat16)
        model.save_pretrained(work / "bf16")
        ts.quantize_model(model, args.recipe, columnwise=False)
        ts.save_quantized(model, work / "te")
        qbytes = ts.plan(model).total_bytes
        del model
        runs = {"from_pretrained(te-serial)": ("from_pretrained", work / "te"),
                "load_into(te-serial)": ("load_into", work / "te"),
                "from_pretrained(bf16)": ("from_pretrained", work / "bf16"),
                "quantize on load (bf16 dir)": (f"on_load:{args.recipe}", work / "bf16"),
                "load_into quantizing (bf16 dir)": (f"load_into:{args.recipe}", work / "bf16")}
        results: dict[str, list[dict]] = {}
        for _ in range(args.repeat):
            for label, (mode, path) in runs.items():
                warm = "" if "bf16 dir" in label else "1"
                out = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), mode, str(path), json.dumps(cfg), warm],
                                     capture_output=True, text=True, check=True)
                results.setdefault(label, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in results.items()}
        peak = {k: max(r["rss"] for r in v) for k, v in results.items()}
        print(f"hf: Llama {cfg['num_hidden_layers']} layers x hidden {cfg['hidden_size']}, {args.recipe} "
              f"(rowwise), quantized bytes {qbytes / 2**30:.2f} GiB; median of {args.repeat}, one child process each "
              "(the model's module imported before the clock; every byte made resident)")
        for label in runs:
            warm = f"   warm (2nd load in process) {med[label]['warm'] * 1e3:6.1f} ms" if "warm" in med[label] else ""
            print(f"  {label:<32} {med[label]['seconds']:6.2f} s   peak RSS {peak[label] / 2**30:5.2f} GiB "
                  f"(+{med[label]['added'] / 2**30:.2f} by the load){warm}")
        ours, base = med["from_pretrained(te-serial)"], med["load_into(te-serial)"]
        print(f"  from_pretrained / load_into:        {ours['seconds'] / base['seconds']:.2f}x first load, "
              f"{ours['warm'] / base['warm']:.2f}x warm (target <= 1.1)")
        bf16 = med["from_pretrained(bf16)"]
        print(f"  from_pretrained / transformers BF16: {ours['seconds'] / bf16['seconds']:.2f}x first load, "
              f"{ours['warm'] / bf16['warm']:.2f}x warm (target <= 1.0)")
        budget = qbytes * 1.1 + 300e6
        print(f"  peak RSS / (quantized x 1.1 + 300 MB): {peak['from_pretrained(te-serial)'] / budget:.2f} "
              "(target <= 1.0; the child's interpreter, torch and transformers included); RSS added by the load / "
              f"quantized bytes: {ours['added'] / qbytes:.2f}")
        q, qi = med["quantize on load (bf16 dir)"], med["load_into quantizing (bf16 dir)"]
        print(f"  quantize on load vs load_into quantizing: time {q['seconds'] / qi['seconds']:.2f}x, RSS added "
              f"{q['added'] / 2**30:.2f} vs {qi['added'] / 2**30:.2f} GiB ({q['added'] / qbytes:.2f} vs "
              f"{qi['added'] / qbytes:.2f} of the quantized bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
