"""``tools/bench.py moe``: mixtures of experts beside dense models of the same bytes.

* **Share quantized, at real scale** (on ``meta``, no bytes): Qwen3-30B-A3B, Mixtral-8x7B,
  DeepSeek-V3 and gpt-oss-20b built from their published shapes; the share of all parameters
  ``quantize_model`` quantizes, beside the share of 2-D and 3-D weights outside embeddings, output
  heads, norms and routers (classified here by name, independently of te-serial's rule).
* **Paths** (``--gib`` of BF16, a Qwen3-MoE model and a dense Qwen3 of the same bytes; one child
  process per run, median of ``--repeat``): quantize on load (``quantize_model`` on ``meta`` +
  ``load_into`` of the ``save_pretrained`` directory), ``save_quantized`` of the quantized model,
  ``load_into`` of that checkpoint, and its export to the recipe's ModelOpt serving layout
  (``convert``: the MoE's experts written per expert, under the names engines read); wall time,
  and peak RSS added over the bytes the model keeps. Each MoE figure is given as a ratio of the
  dense one (target ≥ 0.9: the issue's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: published shapes (config.json of each model), the fields that set parameter counts
REAL = {
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, num_experts=128,
                                             num_experts_per_tok=8)),
    "Mixtral-8x7B": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2)),
    "DeepSeek-V3": ("DeepseekV3Config", dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                             moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                             num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                                             num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
                                             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                             v_head_dim=128, n_group=8, topk_group=4)),
    "gpt-oss-20b": ("GptOssConfig", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                         num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                         head_dim=64, num_local_experts=32, num_experts_per_tok=4)),
}
_OUTSIDE = re.compile(r"embed|lm_head|norm|router|(^|\.)gate\.weight$|shared_expert_gate")


def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="MoE vs dense of the same bytes: quantize on load, save, load; share quantized")
    p.add_argument("--gib", type=float, default=1.0, help="BF16 size of each model")
    p.add_argument("--recipe", default="mxfp8", choices=("mxfp8", "nvfp4"))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--skip-paths", action="store_true", help="only the share table")


def share_table(recipe: str) -> None:
    import warnings
    import torch
    import transformers
    import te_serial as ts
    from te_serial.formats import QuantizedTensor
    print(f"share of parameters quantized by quantize_model({recipe!r}), on meta at real scale")
    print(f"  {'model':<16}{'params':>10}{'quantized':>11}{'target':>9}  left high precision (target less quantized)")
    for name, (cls, kw) in REAL.items():
        cfg = getattr(transformers, cls)(**kw)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        total = sum(p.numel() for p in params.values())
        target = sum(p.numel() for n, p in params.items() if p.dim() in (2, 3) and not _OUTSIDE.search(n))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts.quantize_model(model, recipe, columnwise=False)
        quantized = sum(p.numel() for p in model.parameters() if isinstance(p, QuantizedTensor))
        why = sorted({re.sub(r"layers\.\d+\.", "layers.*.", str(w.message).split(" left unquantized")[0]
                              .removeprefix("te-serial: ")) for w in caught})
        print(f"  {name:<16}{total / 1e9:>9.2f}B{quantized / total:>10.1%}{target / total:>9.1%}  {', '.join(why[:3])}")


_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, transformers
import te_serial as ts
mode, arch, cfg_json, src, dst, recipe = sys.argv[2:8]
cfg = getattr(transformers, arch)(**json.loads(cfg_json))

def rss(field):
    return int([l for l in open("/proc/self/status") if l.startswith(field + ":")][0].split()[1]) * 1024

def meta_model():
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return ts.quantize_model(m, recipe, columnwise=False)

with torch.device("meta"):  # the model's module imported, and its classes built once, before the clock
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
base = rss("VmRSS")
t0 = time.perf_counter()
if mode == "quantize_on_load":
    model = ts.load_into(meta_model(), src)
elif mode == "load":
    model = ts.load_into(meta_model(), dst)
elif mode == "save":
    model = ts.load_into(meta_model(), dst)
    base = rss("VmRSS")
    t0 = time.perf_counter()
    ts.save_quantized(model, dst + ".again")
elif mode == "export":
    ts.convert(dst, dst + ".export", recipe="modelopt_" + recipe)
secs = time.perf_counter() - t0
if mode == "export":
    model = meta_model()   # for the bytes kept, off the clock: the export builds no model
kept = sum(p.quantized_nbytes() if hasattr(p, "quantized_nbytes") else p.numel() * p.element_size()
           for p in model.parameters())
print(json.dumps({"s": secs, "added": rss("VmHWM") - base, "kept": kept}))
"""


def _configs(gib: float) -> dict[str, tuple[str, dict]]:
    """A Qwen3-MoE model and its dense sibling, a Qwen3 of the same dims and bytes (the experts' 16 × 256
    intermediate = the dense MLP's 4096), about ``gib`` GiB of BF16 each (vocab small)."""
    h, inter, layers = 1024, 4096, None
    dense_layer = 2 * (4 * h * h + 3 * h * inter)
    layers = max(1, round(gib * 2**30 / dense_layer))
    experts, moe_inter = 16, 256   # 16 × 3 × h × 256 = the dense MLP's 3 × h × 4096
    common = dict(vocab_size=1024, hidden_size=h, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=128)
    return {"dense": ("Qwen3Config", dict(common, intermediate_size=inter)),
            "moe": ("Qwen3MoeConfig", dict(common, intermediate_size=inter, moe_intermediate_size=moe_inter,
                                           num_experts=experts, num_experts_per_tok=2))}


def paths(args) -> None:
    import torch
    import transformers
    import te_serial as ts
    work = Path(tempfile.mkdtemp(prefix="bench_moe_", dir=args.dir))
    try:
        results: dict[str, dict[str, list]] = {}
        for kind, (arch, kw) in _configs(args.gib).items():
            torch.manual_seed(0)
            cfg = getattr(transformers, arch)(**kw)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            model.save_pretrained(work / f"{kind}_bf16")
            ts.save_quantized(ts.quantize_model(model, args.recipe, columnwise=False), work / f"{kind}_te")
            del model
        for r in range(args.repeat):
            for mode in ("quantize_on_load", "save", "load", "export"):
                # alternated, and in turn first: on a VM whose balloon reports free pages, a child's speed
                # depends on the memory the one before it freed (see docs/checkpoints.md)
                for kind, (arch, kw) in sorted(_configs(args.gib).items(), reverse=bool(r % 2)):
                    for old in (".again", ".export"):
                        shutil.rmtree(work / f"{kind}_te{old}", ignore_errors=True)
                    os.sync()   # the last run's deletions and writeback land before this one, not in it
                    out = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), mode, arch, json.dumps(kw),
                                          str(work / f"{kind}_bf16"), str(work / f"{kind}_te"), args.recipe],
                                         capture_output=True, text=True, check=True)
                    results.setdefault(mode, {}).setdefault(kind, []).append(json.loads(out.stdout.splitlines()[-1]))
        print(f"\n{args.gib} GiB BF16 each, {args.recipe}; median of {args.repeat}; one process per run")
        print(f"  {'path':<18}{'dense s':>9}{'MoE s':>9}{'MoE speed / dense':>19}"
              f"{'RSS added/kept: dense':>23}{'MoE':>7}")
        for mode, kinds in results.items():
            d, m = (statistics.median(r["s"] for r in kinds[k]) for k in ("dense", "moe"))
            rd, rm = (statistics.median(r["added"] / r["kept"] for r in kinds[k]) for k in ("dense", "moe"))
            print(f"  {mode:<18}{d:>9.3f}{m:>9.3f}{d / m:>18.2f}x{rd:>23.2f}{rm:>7.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args) -> None:
    share_table(args.recipe)
    if not args.skip_paths:
        paths(args)
