"""Real serving-layout exports of a tiny Llama, made by the real producers, on CPU, data-free.

    python tests/producers/make_real_exports.py OUT_DIR [--kinds KIND ...] [--tied] [--prune]
    python tests/producers/make_real_exports.py --fixtures tests/producers/fixtures

writes OUT_DIR/<kind>/ (and OUT_DIR/<kind>_tied/ for the tied variants) for every kind in KINDS,
and prints how long each took. Each export directory is what the producer itself wrote: config.json
(with quantization_config), model.safetensors, hf_quant_config.json (ModelOpt) and tokenizer files.
``--prune`` keeps only what te-serial reads (KEEP_FILES: *.safetensors, model.safetensors.index.json,
config.json, hf_quant_config.json) and drops the rest (tokenizer files, generation_config.json,
llm-compressor's recipe.yaml); ``--fixtures DIR`` is ``DIR --prune`` for every kind, each directory
replaced whole: the committed fixtures of tests/producers/test_real_exports.py (see
tests/producers/fixtures/README.md).

Producers (neither is a dependency of te-serial; install them in a separate virtualenv):

    python -m venv --system-site-packages /tmp/venv-prod
    /tmp/venv-prod/bin/pip install -c constraints.txt nvidia-modelopt==0.47.0
    /tmp/venv-prod/bin/pip install -c constraints.txt --no-deps llmcompressor==0.14.0.1
    /tmp/venv-prod/bin/pip install -c constraints.txt datasets   # llmcompressor imports it

llmcompressor 0.14.0.1 pins compressed-tensors==0.19.0 and transformers<=5.17.0,>=5.15.0 (and wants
auto-round, pillow, nvidia-ml-py, none of which these kinds import); installed with --no-deps it runs
with compressed-tensors 0.20.1 and transformers 5.25 for every kind here, and writes bit-identical
tensors (config.json differs: compressed-tensors 0.20 drops null fields). To
get exactly what llmcompressor's own pins produce, use a second venv with its full dependencies
(`pip install -c constraints.txt llmcompressor==0.14.0.1`) and point TE_SERIAL_LLMC_PYTHON at its
python: kinds whose producer the running interpreter cannot import are then made by a subprocess of
TE_SERIAL_LLMC_PYTHON / TE_SERIAL_MODELOPT_PYTHON (else they are skipped with a message).

The model: transformers LlamaForCausalLM from a config (vocab 128, hidden 128, intermediate 256, 1
layer, 4 heads, 2 kv heads, head_dim 64 so that q_proj is 256x128 and k_proj/v_proj 128x128: every
linear's dims are multiples of 128, whole 128x128 FP8 blocks; the default head_dim 32 would give
64x128 k/v weights, one partial block), random bf16 weights from torch.manual_seed(0), untied
lm_head (or tied with tied=True), saved with a tiny word-level tokenizer and reloaded with from_pretrained, as a real
checkpoint would be (llm-compressor's oneshot reads the on-disk config at model.config.name_or_path).
Calibration data: seeded random token ids (ModelOpt: 4 batches of 2x16; llm-compressor: 8 rows of 16).
Runs are byte-for-byte reproducible (same producer versions).

CPU: every kind runs on CPU as is except modelopt_nvfp4_4over6, whose static NVFP4 weight quantizer
(MSE calibration picks M=4 or M=6 per block) fake-quantizes only through a Triton CUDA kernel in 0.47;
without it _modelopt_cpu_fallbacks() swaps in a pure-torch port of that kernel (same math).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SEQ = 128, 128, 256, 1, 4, 2, 64, 16

#: what --prune keeps (what te-serial reads of an export); everything else is deleted
KEEP_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "hf_quant_config.json")

# kind -> (producer, ModelOpt config name or compressed-tensors preset scheme)
KINDS: dict[str, tuple[str, str]] = {
    "modelopt_nvfp4": ("modelopt", "NVFP4_DEFAULT_CFG"),
    "modelopt_nvfp4_fp8kv": ("modelopt", "NVFP4_DEFAULT_CFG+FP8_KV_CFG"),
    "modelopt_nvfp4_wo": ("modelopt", "W4A16_NVFP4_CFG"),
    "modelopt_nvfp4_4over6": ("modelopt", "NVFP4_FOUR_OVER_SIX_CFG"),
    "modelopt_fp8": ("modelopt", "FP8_DEFAULT_CFG"),
    "modelopt_fp8_pb_wo": ("modelopt", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"),
    "modelopt_mxfp8": ("modelopt", "MXFP8_DEFAULT_CFG"),
    "llmc_fp8_block": ("llmc", "FP8_BLOCK"),
    "llmc_nvfp4": ("llmc", "NVFP4"),
    "llmc_nvfp4a16": ("llmc", "NVFP4A16"),
    "llmc_mxfp8": ("llmc", "MXFP8"),
    "llmc_mxfp8a16": ("llmc", "MXFP8A16"),
    "llmc_fp8_dynamic": ("llmc", "FP8_DYNAMIC"),
    "llmc_fp8_static": ("llmc", "FP8"),
}
# the tied-embedding variants that main() makes besides the untied ones
TIED_KINDS = ("modelopt_nvfp4", "llmc_nvfp4", "llmc_fp8_dynamic")

_MODULE = {"modelopt": "modelopt.torch.quantization", "llmc": "llmcompressor"}
_PYTHON_ENV = {"modelopt": "TE_SERIAL_MODELOPT_PYTHON", "llmc": "TE_SERIAL_LLMC_PYTHON"}


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_base(base_dir: Path, tied: bool = False) -> Path:
    """The bf16 checkpoint every export starts from (deterministic: seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base_dir = Path(base_dir)
    if (base_dir / "model.safetensors").exists():
        return base_dir
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64,
        tie_word_embeddings=tied, dtype="bfloat16", bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    # ModelOpt's export reads config.architectures (is_multimodal_model iterates it)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(base_dir)
    _tiny_tokenizer().save_pretrained(base_dir)
    return base_dir


def _load(base_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).eval()


def _modelopt_cfg(name: str) -> dict:
    import modelopt.torch.quantization as mtq

    parts = name.split("+")
    cfg = copy.deepcopy(getattr(mtq, parts[0]))
    for extra in parts[1:]:  # e.g. a KV-cache config, appended as hf_ptq.py does
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(getattr(mtq, extra)["quant_cfg"])
    return cfg


def _torch_static_blockwise_fp4_fake_quant(
    x, amax, global_amax=None, quantize_block_scales=True, fp8_max_for_normalization=448.0,
    out_dtype=None, pass_through_bwd=False,
):
    """Pure-torch port of ModelOpt 0.47's Triton-only static NVFP4 fake quant (CPU fallback).

    Same math as modelopt/torch/kernels/quantization/gemm/fp4_kernel.py: compute_fp4_scales()
    (scale = amax / 6, FP8-quantized against global_amax * (448 / fp8_max_for_normalization) / 6)
    then static_blockwise_fp4_fake_quant_kernel -> nvfp4_scalar_quant() (E2M1 decision boundaries
    of common/nvfp4_quant.py:fp4_round_magnitude; a zero scale gives an all-zero block).
    """
    import torch
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl
    from modelopt.torch.quantization.utils import reduce_amax

    n_blocks = amax.numel()
    if x.numel() % n_blocks:
        raise ValueError(f"x.numel() ({x.numel()}) is not divisible by amax.numel() ({n_blocks})")
    scale = amax.float() / 6.0
    if quantize_block_scales:
        if global_amax is None:
            global_amax = reduce_amax(amax, axis=None, keepdims=False, squeeze_scalar=True)
        scale_fp8_quant_amax = global_amax.float() * (448.0 / fp8_max_for_normalization) / 6.0
        scale = scaled_e4m3_impl(scale, scale_fp8_quant_amax)
    xb = x.detach().float().reshape(n_blocks, -1)
    s = scale.reshape(n_blocks, 1).float()
    zero = s == 0.0
    s_safe = torch.where(zero | torch.isnan(s) | torch.isinf(s), torch.ones_like(s), s)
    a = xb.abs() / s_safe
    q = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    r = q * s_safe
    r = torch.where(xb >= 0, r, -r)
    r = torch.where(zero, torch.zeros_like(r), r)
    return r.reshape(x.shape).to(out_dtype or x.dtype)


def _modelopt_cpu_fallbacks() -> list[str]:
    """Patch what ModelOpt 0.47 runs only through Triton on CUDA; return what was patched."""
    import modelopt.torch.kernels.quantization.gemm as triton_kernel
    import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq

    if triton_kernel.IS_AVAILABLE:
        return []
    # StaticBlockScaleQuantizer._fake_quantize (NVFP4 static weights: 4over6, MSE/GPTQ calibration)
    tq.static_blockwise_fp4_fake_quant = _torch_static_blockwise_fp4_fake_quant
    return ["tensor_quantizer.static_blockwise_fp4_fake_quant -> pure torch"]


def _make_modelopt(cfg_name: str, base_dir: Path, out_dir: Path) -> None:
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    _modelopt_cpu_fallbacks()
    model = _load(base_dir)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(4)]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    torch.manual_seed(0)
    mtq.quantize(model, _modelopt_cfg(cfg_name), forward_loop)
    export_hf_checkpoint(model, export_dir=str(out_dir))


def _make_llmc(scheme: str, base_dir: Path, out_dir: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = _load(base_dir)
    kwargs = {}
    if scheme in ("FP8", "NVFP4", "INT8", "W4A8"):  # static input scales need calibration data
        from datasets import Dataset

        gen = torch.Generator().manual_seed(1)
        rows = [torch.randint(3, VOCAB, (SEQ,), generator=gen).tolist() for _ in range(8)]
        kwargs = dict(
            dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * SEQ] * 8}),
            num_calibration_samples=8, max_seq_length=SEQ,
        )
    torch.manual_seed(0)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(out_dir, save_compressed=True)
    _tiny_tokenizer().save_pretrained(out_dir)


def _importable(producer: str) -> bool:
    try:
        return importlib.util.find_spec(_MODULE[producer].split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def prune(out_dir: Path) -> list[str]:
    """Delete every file of out_dir that KEEP_FILES does not name; return the deleted names."""
    gone = []
    for f in sorted(Path(out_dir).iterdir()):
        if not any(fnmatch.fnmatchcase(f.name, pat) for pat in KEEP_FILES):
            shutil.rmtree(f) if f.is_dir() else f.unlink()
            gone.append(f.name)
        else:
            f.chmod(0o644)   # the producers write model.safetensors 0600
    return gone


def make(kind: str, out_dir: Path, tied: bool = False) -> Path:
    """Export the tiny Llama as `kind` (a key of KINDS) into out_dir; return out_dir."""
    producer, spec = KINDS[kind]
    out_dir = Path(out_dir)
    if not _importable(producer):
        python = os.environ.get(_PYTHON_ENV[producer])
        if not python:
            raise ModuleNotFoundError(
                f"{kind}: {_MODULE[producer]} is not importable here; install it or set "
                f"{_PYTHON_ENV[producer]} to a python that has it"
            )
        cmd = [python, __file__, str(out_dir.parent), "--kinds", kind, "--exact-dir", str(out_dir)]
        subprocess.run(cmd + (["--tied"] if tied else []), check=True)
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        base = make_base(Path(tmp) / ("base_tied" if tied else "base"), tied=tied)
        if producer == "modelopt":
            _make_modelopt(spec, base, out_dir)
        else:
            _make_llmc(spec, base, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir", type=Path, nargs="?")
    ap.add_argument("--kinds", nargs="*", default=None, help="default: all of " + ", ".join(KINDS))
    ap.add_argument("--tied", action="store_true", help="only the tied-embedding variant")
    ap.add_argument("--prune", action="store_true",
                    help="keep only what te-serial reads: " + ", ".join(KEEP_FILES))
    ap.add_argument("--fixtures", type=Path, default=None, metavar="DIR",
                    help="DIR --prune, each kind's directory replaced whole (the committed test fixtures)")
    ap.add_argument("--exact-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fixtures is not None:
        if args.out_dir is not None:
            ap.error("--fixtures DIR takes no OUT_DIR")
        args.out_dir, args.prune = args.fixtures, True
    if args.out_dir is None:
        ap.error("OUT_DIR (or --fixtures DIR) is required")

    if args.kinds is None:
        jobs = [(k, False) for k in KINDS] + [(k, True) for k in TIED_KINDS]
    else:
        jobs = [(k, args.tied) for k in args.kinds]
    if args.exact_dir and len(jobs) != 1:
        ap.error("--exact-dir takes exactly one kind")
    failed = []
    for kind, tied in jobs:
        name = kind + ("_tied" if tied else "")
        out = args.exact_dir or (args.out_dir / name)
        t0 = time.perf_counter()
        if args.fixtures is not None and out.exists():
            shutil.rmtree(out)   # a fixture directory holds exactly one run's files
        try:
            make(kind, out, tied=tied)
            if args.prune:
                prune(out)
        except ModuleNotFoundError as e:
            print(f"SKIP {name}: {e}", flush=True)
            continue
        except Exception as e:  # keep going: report every kind
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
            continue
        print(f"made {name:28s} {time.perf_counter() - t0:7.2f} s  -> {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
