"""One short device check for a lent GPU: run `python tools/gpu_check.py` (finishes in minutes).

1. te-serial's quantizers on CUDA, compiled (Triton), give the CPU eager bytes for every recipe and
   usage, and so does dequantize; then quantize GB/s per recipe against a bare x.to(float8).
2. save_quantized → load_quantized(device="cuda") round trip (pinned, non-blocking staging).
3. torch.compile(fullgraph=True) of TensorProto.create_tensor + dequantize on CUDA (inductor).
4. convert(device="cuda") writes convert(device="cpu")'s bytes (BF16 → MXFP8 / NVFP4), with GB/s;
   transformers' from_pretrained(device_map="cuda") of a te-serial checkpoint equals load_into.
5. If Transformer Engine with its CUDA extension is importable: TE's own kernels quantize each
   recipe; te-serial saves TE's tensors, loads them back as TE tensors; bytes must match and
   TE's GEMM on the loaded weight must equal the GEMM on the original.
Prints one line per check and exits non-zero on any mismatch.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import te_serial as ts  # noqa: E402
from te_serial import formats as tsf  # noqa: E402
from te_serial.formats import fused  # noqa: E402
from te_serial.te.interop import is_te_tensor
from te_serial.recipes import RECIPES, recipe_quantizer  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits except that any NaN equals any NaN."""
    a, b = a.detach().cpu(), b.detach().cpu()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and same(torch.where(nan, 0, a), torch.where(nan, 0, b))


def quantize_speed(size: int = 8192, repeat: int = 10) -> None:
    """Fused (Triton) quantize GB/s per recipe, both usages, against a bare x.to(float8) on the device."""
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9

    def seconds(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeat

    cast = seconds(lambda: x.to(torch.float8_e4m3fn))
    print(f"quantize {size}x{size} bf16 on cuda, both usages: x.to(float8_e4m3fn) {gb / cast:.0f} GB/s")
    with fused.policy("fused"):
        for name in RECIPES:
            q = recipe_quantizer(name)
            t0 = time.perf_counter()
            q(x)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            sec = seconds(lambda: q(x))
            print(f"  {name:<18} {gb / sec:8.0f} GB/s  {cast / sec:6.3f}x the cast  (first call {first:.1f} s)")


def convert_section(tmp: Path) -> None:
    """convert(device="cuda") writes the bytes convert(device="cpu") writes, and how fast (BF16 → MXFP8)."""
    from safetensors.torch import save_file
    src = tmp / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
               for i in range(8)}, str(src / "model.safetensors"))
    reps = {}
    for dev in ("cpu", "cuda"):
        for recipe in ("mxfp8", "nvfp4"):
            t0 = time.time()
            reps[dev, recipe] = ts.convert(src, tmp / f"{dev}-{recipe}", recipe=recipe, device=dev, stats="full")
            reps[dev, recipe].seconds = time.time() - t0
    for recipe in ("mxfp8", "nvfp4"):
        a, b = ts.load_quantized(tmp / f"cpu-{recipe}"), ts.load_quantized(tmp / f"cuda-{recipe}")
        ok = all(same(v.buffers()[n], b[k].buffers()[n]) for k, v in a.items() for n in v.buffers())
        c, g_ = reps["cpu", recipe], reps["cuda", recipe]
        check(f"convert(device='cuda') bytes == cpu [{recipe}]", ok,
              f"cpu {c.src_bytes / c.seconds / 1e9:.2f} GB/s, cuda {g_.src_bytes / g_.seconds / 1e9:.2f} GB/s")


def hf_section(tmp: Path) -> None:
    """transformers' from_pretrained(device_map="cuda") of a te-serial checkpoint (te_serial.hf):
    every parameter on the GPU, quantized weights with load_into's bytes, logits equal."""
    try:
        import transformers
        import te_serial.hf  # noqa: F401  (registers the te_serial method)
    except ImportError as e:
        print(f"[skip] from_pretrained(device_map='cuda'): {e}")
        return
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ts.save_quantized(ts.quantize_model(model, "mxfp8", columnwise=False), tmp / "hf")
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", device_map="cuda")
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ts.load_into(ref, tmp / "hf", device="cuda")
    want = dict(ref.named_parameters())
    ok = all(p.device.type == "cuda" for p in got.parameters()) and all(
        same(b, want[n].buffers()[k]) for n, p in got.named_parameters() if isinstance(p, tsf.QuantizedTensor)
        for k, b in p.buffers().items())
    ids = torch.randint(0, 256, (1, 12), device="cuda")
    with torch.no_grad():
        ok = ok and torch.equal(got(ids).logits, ref(ids).logits)
    check("from_pretrained(device_map='cuda') == load_into", ok)


def te_section(tmp: Path) -> None:
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        print(f"[skip] Transformer Engine not importable here ({type(e).__name__}: {e})")
        return
    cap = torch.cuda.get_device_capability()
    quantizers = {"fp8_current": lambda: Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, torch.device("cuda"))}
    if cap[0] >= 10:
        quantizers["mxfp8"] = lambda: MXFP8Quantizer(tex.DType.kFloat8E4M3)
        quantizers["nvfp4_2d"] = lambda: NVFP4Quantizer(with_2d_quantization=True)
    if cap >= (9, 0):
        quantizers["fp8_block"] = lambda: Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                                               block_scaling_dim=2)
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    inp = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    for name, make in quantizers.items():
        tq = make()
        w = tq(x)
        ours = ts.from_te(w)
        mine = recipe_quantizer(name).quantize(x)
        exact = all(same(getattr(ours, n), b) for n, b in mine.buffers().items() if getattr(ours, n, None) is not None)
        check(f"TE kernel == te-serial numerics [{name}]", exact)
        path = tmp / f"te_{name}.safetensors"
        ts.save_quantized({"w": w}, path)
        back = ts.load_quantized(path, device="cuda", as_te=True)["w"]
        check(f"TE save/load bytes [{name}]", all(same(getattr(back, n), b) for n, b in ours.buffers().items()))
        try:
            y0 = torch.nn.functional.linear(inp, w)
            y1 = torch.nn.functional.linear(inp, back)
            check(f"TE GEMM on loaded weight [{name}]", torch.equal(y0, y1))
        except Exception as e:  # noqa: BLE001
            check(f"TE GEMM on loaded weight [{name}]", False, f"{type(e).__name__}: {e}")
    te_module_round_trip(tmp, cap)


def te_module_round_trip(tmp: Path, cap) -> None:
    """A Linear / LayerNormLinear stack made under quantized_model_init, saved with te-serial and
    loaded into a fresh TE model: every parameter's bytes (and the extra state) come back."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe
    recipes = {"delayed": te_recipe.DelayedScaling(), "current": te_recipe.Float8CurrentScaling()}
    if cap[0] >= 10:
        recipes["mxfp8"] = te_recipe.MXFP8BlockScaling()
    if cap >= (9, 0):
        recipes["block"] = te_recipe.Float8BlockScaling()

    def build(rec):
        with te.quantized_model_init(enabled=True, recipe=rec):
            return torch.nn.Sequential(te.LayerNormLinear(1024, 1024), te.Linear(1024, 1024)).cuda()

    x = torch.randn(32, 1024, device="cuda")
    for name, rec in recipes.items():
        try:
            src = build(rec)
            with te.autocast(enabled=True, recipe=rec):
                y0 = src(x)
            path = tmp / f"module_{name}"
            ts.save_quantized(src.state_dict(), path)
            dst = build(rec)
            dst.load_state_dict(ts.load_quantized(path, device="cuda", as_te=True))
            ok = True
            for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
                if is_te_tensor(a):
                    ok &= all(same(getattr(ts.from_te(b), n), t) for n, t in ts.from_te(a).buffers().items())
                elif isinstance(a, torch.Tensor) and not k.endswith("_extra_state"):
                    ok &= same(a, b)
            with te.autocast(enabled=True, recipe=rec):
                y1 = dst(x)
            check(f"TE module state dict round trip [{name}]", ok and torch.equal(y0, y1))
        except Exception as e:  # noqa: BLE001
            check(f"TE module state dict round trip [{name}]", False, f"{type(e).__name__}: {e}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "te-serial", ts.__version__)
    t0 = time.time()
    x = torch.randn(512, 1024, dtype=torch.bfloat16)
    state = {}
    for name in RECIPES:
        for usage in ((True, False), (False, True), (True, True)):
            q = recipe_quantizer(name, rowwise=usage[0], columnwise=usage[1])
            cpu = q.quantize(x, eager=True)
            with fused.policy("fused"):  # Triton kernels, against the CPU eager bytes
                gpu = q(x.cuda())
                dq = gpu.dequantize(torch.float32)
            check(f"cuda fused quantize == cpu eager [{name} {usage}]",
                  all(same(getattr(gpu, n), b) for n, b in cpu.buffers().items()))
            check(f"cuda fused dequantize == cpu eager [{name} {usage}]",
                  same_values(dq, cpu.dequantize(torch.float32, eager=True)))
            state[f"{name}.{int(usage[0])}{int(usage[1])}"] = gpu
    check("no fused kernel fell back to eager", not fused.failures(), str(fused.failures()))
    quantize_speed()
    state["bias"] = torch.randn(1024, device="cuda")
    state["big"] = torch.randn(48 << 20 >> 2, device="cuda")  # spans several staging chunks
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ts.save_quantized(state, tmp / "ck")
        t1 = time.time()
        back = ts.load_quantized(tmp / "ck", device="cuda", verify=True)
        torch.cuda.synchronize()
        check("load_quantized(device='cuda')", all(v.device.type == "cuda" for v in back.values()),
              f"{(time.time() - t1) * 1e3:.0f} ms")
        ok = all(same(getattr(back[k], n), b) for k, t in state.items() if isinstance(t, tsf.QuantizedTensor)
                 for n, b in t.buffers().items())
        check("cuda save/load bytes", ok and same(back["big"], state["big"]))
        proto = ts.to_tensor_proto(state["mxfp8.11"])
        names = proto.inner_names()

        def use(*bufs):
            t = proto.create_tensor(device="cuda")
            for n, b in zip(names, bufs):
                getattr(t, n).copy_(b)
            return t.dequantize(torch.float32)

        torch._dynamo.reset()
        got = torch.compile(use, backend="inductor", fullgraph=True)(*state["mxfp8.11"].buffers().values())
        check("torch.compile(fullgraph) create+dequantize on cuda",
              torch.equal(got, state["mxfp8.11"].dequantize(torch.float32)))
        convert_section(tmp)
        hf_section(tmp)
        te_section(tmp)
    print(f"{len(FAILED)} failed, {time.time() - t0:.0f} s")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
