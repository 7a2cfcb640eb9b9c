"""``tools/bench.py hf``: transformers' ``from_pretrained`` of a te-serial checkpoint.

A Llama-shaped model (``--hidden`` × ``--layers``, BF16 about ``--gib`` GiB) is saved three ways:
a plain BF16 Hugging Face directory (``save_pretrained``), and a te-serial checkpoint of the same
model quantized with ``--recipe`` (``quantize_model`` + ``save_quantized``). Each load runs in a
child process of its own (wall time from the start of the load to a model whose every byte is
resident, and the child's peak RSS):

* ``from_pretrained(te_serial_dir)`` (``te_serial.hf``);
* ``te_serial.load_into`` of the same checkpoint into a meta model (the issue's ≤ 1.1× baseline);
* transformers' own ``from_pretrained`` of the BF16 directory (≤ 1.0×: it reads 2-4× the bytes);
* ``from_pretrained`` of the BF16 directory with ``TeSerialConfig(recipe=...)``: quantize on load.
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
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
sys.path.insert(0, sys.argv[1])
import torch, transformers
import te_serial as ts
import te_serial.hf  # registers the te_serial method
mode, path, cfg_json = sys.argv[2], sys.argv[3], sys.argv[4]
cfg = transformers.LlamaConfig(**json.loads(cfg_json))
t0 = time.perf_counter()
if mode == "load_into":
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ts.load_into(model, path)
elif mode.startswith("on_load:"):  # quantize on load from the BF16 directory
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=te_serial.hf.TeSerialConfig(recipe=mode[8:], usages=["rowwise"]))
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
for p in model.parameters():  # every byte resident
    for b in (p.buffers().values() if hasattr(p, "quantizer") else [p]):
        b.reshape(-1).view(torch.uint8).max()
seconds = time.perf_counter() - t0
hwm = int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) * 1024
print(json.dumps({"seconds": seconds, "rss": hwm}))
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
        times: dict[str, list[float]] = {}
        rss: dict[str, int] = {}
        runs = {"from_pretrained(te-serial)": ("from_pretrained", work / "te"),
                "load_into(te-serial)": ("load_into", work / "te"),
                "from_pretrained(bf16)": ("from_pretrained", work / "bf16"),
                "quantize on load (bf16 dir)": (f"on_load:{args.recipe}", work / "bf16")}
        for _ in range(args.repeat):
            for label, (mode, path) in runs.items():
                out = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), mode, str(path), json.dumps(cfg)],
                                     capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                times.setdefault(label, []).append(r["seconds"])
                rss[label] = max(rss.get(label, 0), r["rss"])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"hf: Llama {cfg['num_hidden_layers']} layers x hidden {cfg['hidden_size']}, {args.recipe} "
              f"(rowwise), quantized bytes {qbytes / 2**30:.2f} GiB; median of {args.repeat}, one child process each")
        for label in runs:
            print(f"  {label:<30} {med[label]:6.2f} s   peak RSS {rss[label] / 2**30:5.2f} GiB")
        ours = med["from_pretrained(te-serial)"]
        print(f"  from_pretrained / load_into:        {ours / med['load_into(te-serial)']:.2f}x (target <= 1.1)")
        print(f"  from_pretrained / transformers BF16: {ours / med['from_pretrained(bf16)']:.2f}x (target <= 1.0)")
        budget = qbytes * 1.1 + 300e6
        print(f"  peak RSS / (quantized x 1.1 + 300 MB): {rss['from_pretrained(te-serial)'] / budget:.2f} "
              "(target <= 1.0; the child's interpreter, torch and transformers included); quantize on load: "
              f"{rss['quantize on load (bf16 dir)'] / budget:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
