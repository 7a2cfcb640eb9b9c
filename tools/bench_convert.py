"""``tools/bench.py convert``: a BF16 Hugging Face checkpoint → te-serial MXFP8, streaming; and an
export line: te-serial NVFP4 → ModelOpt NVFP4 next to a plain safetensors copy of the same bytes
(``tools/bench.py export``: NVFP4 and MXFP8 into every serving layout, and ``export_tensors``).

For a 1 GiB and a 3 GiB source with the same largest tensor, it prints GB/s of source and the
peak RSS of a child process doing only the conversion (``resource.getrusage``), then the two
ratios the conversion issue asks for:

* peak RSS (3 GiB) / peak RSS (1 GiB) — must be ≤ 1.10: memory does not grow with the checkpoint;
* peak RSS / (4 × the largest tensor's FP32 size + 300 MB) — must be ≤ 1.

Each size runs once per ``--stats`` mode (default ``full`` — the conversion's own per-tensor
check, dequantize both usages and compare with the source — and ``none``); ``--eager`` adds the
same runs with ``TE_SERIAL_EAGER=1`` and prints fused / eager.

A gpt-oss line (``--only-gpt-oss`` for it alone): ``te-serial convert`` of a gpt-oss MXFP4 directory
(experts ``_blocks`` / ``_scales``) to te-serial MXFP8, in GB/s of bytes written, against the disk's
write speed measured in the same run (a plain safetensors copy of as many bytes as the conversion
writes: read, ``save_file``, fsync), A/B interleaved; the ratio's target is >= 0.9. Wire it into tools/bench.py with ``add_parser(subparsers)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: lines of a child-process benchmark that read its peak RSS (VmHWM) into ``hwm``
_READ_HWM = r"""
hwm = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
except OSError:
    pass
"""

_CHILD = r"""
import json, resource, sys, time
try:  # VmHWM: forget the high-water mark inherited through fork (ru_maxrss cannot be reset)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
sys.path.insert(0, sys.argv[4])
import torch
import importlib
tc = importlib.import_module("te_serial.conversion")
from te_serial.conversion.transforms import compare, usage_view
from te_serial.formats import fused
from te_serial.recipes import recipe_quantizer
# first-call compile, timed apart: one quantize, the dequantize of each usage and the comparison
# with the source (--stats full), as convert runs them
t0 = time.perf_counter()
q = recipe_quantizer(sys.argv[3])
x = torch.randn(2048, 1024, dtype=torch.bfloat16)
w = q(x)
for u in ("rowwise", "columnwise"):
    d = usage_view(w, u).dequantize(torch.float32)
if sys.argv[5] == "full":
    compare(x, d)
compile_s, compiles = time.perf_counter() - t0, fused.compile_count()
try:  # the conversion's own peak from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = next((int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:")), 0)
t0 = time.perf_counter()
rep = tc.convert(sys.argv[1], sys.argv[2], recipe=sys.argv[3], max_shard_size="1GB", stats=sys.argv[5])
sec = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
""" + _READ_HWM + r"""
print(json.dumps({"seconds": sec, "compile_seconds": compile_s, "compiles": compiles,
                  "src_bytes": rep.src_bytes, "dst_bytes": rep.dst_bytes, "peak_rss": hwm or peak,
                  "import_rss": base, "vm_hwm": hwm, "tensors": len(rep.tensors), "lossy": len(rep.lossy),
                  "threads": torch.get_num_threads()}))
"""


def _parse_shape(text: str) -> tuple[int, int]:
    m, k = (int(v) for v in text.lower().split("x"))
    return m, k


def make_source(path: Path, total_bytes: int, largest: tuple[int, int], seed: int = 0,
                shard_bytes: int = 512 << 20) -> dict:
    """A Llama-like BF16 checkpoint of ~``total_bytes`` whose largest tensor is ``largest``:
    per layer one ``largest`` MLP weight, a (K x K) and a (K/2 x K) attention weight, a norm."""
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    m, k = largest
    layer_shapes = [("mlp.up_proj.weight", (m, k)), ("self_attn.q_proj.weight", (k, k)),
                    ("self_attn.k_proj.weight", (k // 2, k)), ("input_layernorm.weight", (k,))]
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict]] = []
    total = layer = 0

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"part-{len(files):05d}"
            save_file(shard, str(path / f"{name}.safetensors"), metadata={"format": "pt"})
            files.append((name, dict.fromkeys(shard)))
            shard, shard_size = {}, 0

    while total < total_bytes:
        for suffix, shape in layer_shapes:
            name = f"model.layers.{layer}.{suffix}"
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            n = t.numel() * 2
            if shard_size + n > shard_bytes:
                flush()
            shard[name] = t
            shard_size += n
            total += n
        layer += 1
    flush()
    n_files = len(files)
    for i, (name, keys) in enumerate(files):  # HF names: model-0000i-of-0000n.safetensors
        final = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        os.replace(path / f"{name}.safetensors", path / final)
        weight_map.update(dict.fromkeys(keys, final))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"bytes": total, "layers": layer, "files": n_files, "largest_fp32": m * k * 4}


def _make_in_child(path: Path, total_bytes: int, largest: tuple[int, int]) -> dict:
    """make_source in a child process: the parent stays small, so a later child's peak RSS (which
    on Linux starts from the parent's RSS at fork time) is the conversion's own."""
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_make", str(path), str(total_bytes),
                          f"{largest[0]}x{largest[1]}"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"making the source failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _child(src: Path, dst: Path, recipe: str, stats: str = "full", env: dict | None = None) -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), recipe, str(ROOT), stats],
                         capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise SystemExit(f"conversion child failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


_EXPORT_CHILD = r"""
import json, os, resource, sys, time
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
sys.path.insert(0, sys.argv[4])
import importlib
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file
mode, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
mode, _, layout = mode.partition(":")
ts = importlib.import_module("te_serial") if mode != "copy" else None
t0 = time.perf_counter()  # imports are done on both sides: the clock times the work alone
if mode == "export":
    rep = ts.convert(src, dst, recipe=layout, max_shard_size="1GB")
    nbytes, labels = rep.dst_bytes, rep.counts()
elif mode == "stream":  # export_tensors: every tensor handed over, nothing written; GB/s of source
    nbytes, labels = 0, {}
    for name, t in ts.export_tensors(src, layout):
        labels[str(t.dtype)] = labels.get(str(t.dtype), 0) + 1
    nbytes = sum(p.stat().st_size for p in Path(src).glob("*.safetensors"))
else:  # a plain safetensors copy of the same bytes: every tensor read, written with save_file, fsync'd
    os.makedirs(dst, exist_ok=True)
    nbytes, labels = 0, {}
    for p in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out = os.path.join(dst, p.name)
        save_file(tensors, out, metadata={"format": "pt"})
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
sec = time.perf_counter() - t0
""" + _READ_HWM + r"""
print(json.dumps({"seconds": sec, "bytes": nbytes, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "vm_hwm": hwm, "labels": labels}))
"""


#: the export matrix: te-serial source recipe → the serving layouts that hold its bytes exactly
EXPORTS = {"nvfp4": ("modelopt_nvfp4", "compressed_tensors_nvfp4"), "mxfp8": ("modelopt_mxfp8", "compressed_tensors_mxfp8")}


def make_export_source(path: Path, total_bytes: int, shape: tuple[int, int], recipe: str = "nvfp4",
                       seed: int = 0) -> dict:
    """A te-serial checkpoint of rowwise NVFP4 or MXFP8 weights (TE's inference layout) of
    ~``total_bytes``, built from random codes, block scales and amaxes (quantizing this much on 2
    cores would take an hour; the export moves bytes, so their values do not matter)."""
    import te_serial as ts
    from te_serial.recipes import recipe_quantizer
    g = torch.Generator().manual_seed(seed)
    q = recipe_quantizer(recipe, rowwise=True, columnwise=False)
    lay = q.usage_layout("rowwise")
    per = q.nbytes(shape)
    n = max(1, total_bytes // per)
    protos = {f"model.layers.{i}.mlp.up_proj.weight": ts.TensorProto(shape, torch.bfloat16, q) for i in range(n)}
    from te_serial.checkpoint import CheckpointWriter
    with CheckpointWriter(path, protos, max_shard_size="1GB") as w:
        for name in protos:
            b = q.alloc_tensors(shape)
            data = b[lay.data].view(torch.uint8)
            data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=g) & (0xFF if lay.pack == 2 else 0x7E))
            grid = (shape[0], shape[1] // lay.grid[1])
            scales = torch.randint(0x28, 0x60, grid, dtype=torch.uint8, generator=g) if lay.pack == 2 else \
                torch.randint(110, 140, grid, dtype=torch.uint8, generator=g)
            b[lay.scale].copy_(q.scale_buffer(scales, shape, "rowwise"))
            if lay.amax is not None:
                b[lay.amax].fill_(float(torch.rand((), generator=g)) * 4 + 0.5)
            w.write(name, q.tensor_class(shape, torch.bfloat16, q, **b))
    return {"bytes": n * per, "tensors": n}


def make_gpt_oss_source(path: Path, total_bytes: int, hidden: int = 2880, experts: int = 32, seed: int = 0) -> dict:
    """A gpt-oss MXFP4 directory of ~``total_bytes``: layers of ``experts`` experts (gpt-oss-120b's hidden and
    intermediate size 2880), ``gate_up_proj`` / ``down_proj`` as ``_blocks`` U8 [E, out, in/32, 16] and ``_scales``
    U8 [E, out, in/32] of random codes and E8M0 bytes, with BF16 biases; one shard per layer."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    h = i = hidden
    per_layer = experts * (2 * i * h + h * i) * 17 // 32
    layers = max(1, total_bytes // per_layer)
    weight_map, nbytes = {}, 0
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        tensors = {}
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            tensors[p + proj + "_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, generator=g)
            tensors[p + proj + "_scales"] = torch.randint(118, 130, (experts, n, k // 32), dtype=torch.uint8, generator=g)
            tensors[p + proj + "_bias"] = torch.randn(experts, n, generator=g).to(torch.bfloat16)
        name = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": nbytes},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": h, "intermediate_size": i,
        "num_local_experts": experts, "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}))
    return {"bytes": nbytes, "layers": layers}


def run_gpt_oss(args) -> None:
    """The gpt-oss line: convert of a gpt-oss MXFP4 directory to te-serial MXFP8 (GB/s of bytes written)
    against the disk's write speed: a plain safetensors copy of the bytes the conversion writes (the
    MXFP8 output, twice the MXFP4 source: a copy of the source alone would write half as much, within
    what the page cache absorbs), A/B interleaved, median of ``--repeat``, on disk (``--dir``)."""
    work = Path(tempfile.mkdtemp(prefix="te-serial-bench-gpt-oss-", dir=args.dir))
    try:
        src = work / "gpt-oss-mxfp4"
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_make_gpt_oss", str(src),
                              str(int(args.export_gib * 2 ** 30))], capture_output=True, text=True, check=True)
        info = json.loads(res.stdout.strip().splitlines()[-1])
        out = work / "mxfp8"   # the bytes a conversion writes, for the copy to write as many
        _export_child("export:mxfp8", src, out)
        rows = []
        direct = {"TE_SERIAL_DIRECT_IO": "1"}
        for r in range(args.repeat):
            for mode, env in (("copy", None), ("export:mxfp8", None), ("direct", direct)):
                dst = work / f"{mode.replace(':', '-')}-{r}"
                os.sync()
                rows.append((mode, _export_child("export:mxfp8" if mode == "direct" else mode,
                                                 out if mode == "copy" else src, dst, env)))
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {}
    for m in ("copy", "export:mxfp8", "direct"):
        rates = sorted(r["bytes"] / r["seconds"] for mm, r in rows if mm == m)
        med[m] = rates[len(rates) // 2]
    conv = next(r for mm, r in rows if mm == "export:mxfp8")
    print(f"gpt-oss: te-serial convert of a gpt-oss MXFP4 directory ({info['layers']} layers of 32 experts, "
          f"H = I = 2880, {info['bytes'] / 2 ** 30:.2f} GiB) -> te-serial mxfp8, vs the disk's write speed (a plain "
          f"safetensors copy of the MXFP8 output's bytes); GB/s of bytes written, median of {args.repeat}, "
          "A/B interleaved")
    print(f"{'safetensors copy of the output (disk write)':>44}{med['copy'] / 1e9:>8.3f}")
    print(f"{'convert gpt-oss mxfp4 -> mxfp8':>44}{med['export:mxfp8'] / 1e9:>8.3f}"
          f"   {med['export:mxfp8'] / med['copy']:.2f}x disk write (target >= 0.9)   labels {conv['labels']}")
    print(f"{'  the same, TE_SERIAL_DIRECT_IO=1':>44}{med['direct'] / 1e9:>8.3f}"
          f"   {med['direct'] / med['copy']:.2f}x disk write")


def _export_child(mode: str, src: Path, dst: Path, env: dict | None = None) -> dict:
    res = subprocess.run([sys.executable, "-c", _EXPORT_CHILD, mode, str(src), str(dst), str(ROOT)],
                         capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _export_ab(args, where: str | None, shape: tuple[int, int], recipe: str = "nvfp4",
               layouts: tuple[str, ...] = ("modelopt_nvfp4",)) -> dict:
    """A plain copy and each layout's export of one ``recipe`` source in ``where`` (None: the system
    temp dir), A/B interleaved, then ``export_tensors`` into the first layout: {mode: (median GB/s,
    the best run's row)}, modes "copy", "export:<layout>" and "stream:<layout>"."""
    work = Path(tempfile.mkdtemp(prefix="te-serial-bench-export-", dir=where))
    modes = ["copy", *(f"export:{lay}" for lay in layouts)]
    try:
        src = work / f"te-{recipe}"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_make_export", str(src),
                        str(int(args.export_gib * 2 ** 30)), args.export_shape, recipe], check=True, capture_output=True)
        rows = []
        for rep in range(args.repeat):
            for mode in modes:  # interleaved, A/B
                dst = work / f"{mode.replace(':', '-')}-{rep}"
                os.sync()  # each side starts with the previous run's writes and deletions on disk
                rows.append((mode, _export_child(mode, src, dst)))
                shutil.rmtree(dst, ignore_errors=True)
        for _ in range(args.repeat):
            rows.append((f"stream:{layouts[0]}", _export_child(f"stream:{layouts[0]}", src, work / "none")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {}
    for m in dict.fromkeys(mm for mm, _ in rows):
        runs = [r for mm, r in rows if mm == m]
        rates = sorted(r["bytes"] / r["seconds"] for r in runs)
        out[m] = (rates[len(rates) // 2], max(runs, key=lambda r: r["bytes"] / r["seconds"]))
    return out


def run_export(args, recipes: tuple[str, ...] = ("nvfp4",)) -> None:
    """The export lines: a te-serial ``recipe`` checkpoint -> each serving layout that holds its bytes
    (an exact relayout) against a plain safetensors copy of the same bytes, each in a child process
    (GB/s of bytes written, peak RSS); on disk (``--dir``), and again in a RAM file system when there
    is one (the CPU side alone: this VM's page-cache writes vary up to 4x from minute to minute).
    Then ``export_tensors`` (weight sync, nothing written): GB/s of source bytes handed over."""
    shape = _parse_shape(args.export_shape)
    places = [("disk", args.dir)]
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * args.export_gib * 2 ** 30:
        places.append(("tmpfs", str(shm)))
    for recipe in recipes:
        layouts = EXPORTS[recipe]
        print(f"export: te-serial {recipe} (rowwise, {shape[0]}x{shape[1]} tensors, ~{args.export_gib:.2f} GiB) "
              f"-> {', '.join(layouts)}, vs a plain safetensors copy of the same bytes (read + save_file + fsync); "
              f"median of {args.repeat}, A/B interleaved")
        print(f"{'':>44}{'GB/s':>8}{'peak RSS MB':>13}")
        for label, where in places:
            res = _export_ab(args, where, shape, recipe, layouts)
            c_rate, c = res["copy"]
            print(f"{'safetensors copy, ' + label:>44}{c_rate / 1e9:>8.3f}{c['peak_rss'] / 1e6:>13.0f}")
            for lay in layouts:
                e_rate, e = res[f"export:{lay}"]
                print(f"{lay + ', ' + label:>44}{e_rate / 1e9:>8.3f}{e['peak_rss'] / 1e6:>13.0f}"
                      f"   {e_rate / c_rate:.2f}x copy (target >= 0.5)   labels {e['labels']}")
            s_rate, s = res[f"stream:{layouts[0]}"]
            print(f"{'export_tensors ' + layouts[0] + ', ' + label:>44}{s_rate / 1e9:>8.3f}{s['peak_rss'] / 1e6:>13.0f}"
                  f"   GB/s of source (target >= 1.0)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="BF16 checkpoint -> MXFP8: GB/s and peak RSS at two sizes, per --stats mode")
    p.add_argument("--gib", default="1,3", help="source sizes in GiB, comma-separated (default 1,3)")
    p.add_argument("--largest", default="8192x4096", help="largest tensor, MxK BF16 (default 8192x4096)")
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--stats", default="full,none", help="convert --stats modes to run, comma-separated (default full,none)")
    p.add_argument("--eager", action="store_true", help="also run each conversion with TE_SERIAL_EAGER=1 (ratio)")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--export-gib", type=float, default=1.0, help="size of the NVFP4 export line's source (GiB)")
    p.add_argument("--export-shape", default="8192x4096", help="its tensors' shape (default 8192x4096)")
    p.add_argument("--repeat", type=int, default=3, help="export line: runs of each side (median)")
    p.add_argument("--only-export", action="store_true", help="print only the export line")
    p.add_argument("--only-gpt-oss", action="store_true", help="print only the gpt-oss MXFP4 -> MXFP8 line")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if getattr(args, "only_export", False):
        run_export(args)
        return 0
    if getattr(args, "only_gpt_oss", False):
        run_gpt_oss(args)
        return 0
    sizes = [float(s) for s in str(args.gib).split(",") if s.strip()]
    modes = [m for m in str(args.stats).split(",") if m.strip()]
    largest = _parse_shape(args.largest)
    work = Path(tempfile.mkdtemp(prefix="te-serial-bench-convert-", dir=args.dir))
    results = []
    runs = [(m, False) for m in modes] + ([(m, True) for m in modes] if args.eager else [])
    try:
        for gib in sizes:
            src = work / f"src-{gib:g}g"
            t0 = time.perf_counter()
            info = _make_in_child(src, int(gib * 2 ** 30), largest)
            gen = time.perf_counter() - t0
            for mode, eager in runs:
                dst = work / f"dst-{gib:g}g-{mode}"
                os.sync()  # the source's and the previous run's writes are on disk, not in this run's way
                r = _child(src, dst, args.recipe, mode, {"TE_SERIAL_EAGER": "1"} if eager else None)
                r.update(info, gib=gib, gen_seconds=gen, stats=mode, eager=eager)
                results.append(r)
                shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    largest_fp32 = largest[0] * largest[1] * 4
    bound = 4 * largest_fp32 + 300e6
    print(f"convert: BF16 safetensors -> te-serial {args.recipe} (both usages), largest tensor "
          f"{largest[0]}x{largest[1]} ({largest_fp32 / 1e6:.0f} MB as FP32), "
          f"{results[0]['threads'] if results else '?'} threads; peak RSS of a child doing only the conversion")
    print(f"{'source':>10}{'stats':>7}{'path':>7}{'tensors':>9}{'seconds':>9}{'GB/s':>8}{'peak RSS MB':>13}"
          f"{'base RSS MB':>13}{'vs bound':>10}{'compile s':>11}")
    for r in results:
        print(f"{r['bytes'] / 2 ** 30:>8.2f}Gi{r['stats']:>7}{'eager' if r['eager'] else 'fused':>7}{r['tensors']:>9}"
              f"{r['seconds']:>9.1f}{r['bytes'] / r['seconds'] / 1e9:>8.3f}"
              f"{r['peak_rss'] / 1e6:>13.0f}{r['import_rss'] / 1e6:>13.0f}{r['peak_rss'] / bound:>10.3f}"
              f"{r['compile_seconds']:>8.1f} ({r['compiles']})")
    print("compile s: the first quantize + dequantize in the child (graphs compiled), before the timed "
          "conversion; peak RSS is VmHWM reset after it (the conversion's own high-water mark)")
    print(f"bound: 4 x largest FP32 + 300 MB = {bound / 1e6:.0f} MB (ratio must be <= 1)")
    for mode in modes:
        rs = [r for r in results if r["stats"] == mode and not r["eager"]]
        if len(rs) >= 2:
            growth = rs[-1]["peak_rss"] / rs[0]["peak_rss"]
            print(f"stats {mode}: peak RSS {rs[-1]['gib']:g} GiB / {rs[0]['gib']:g} GiB = {growth:.3f} (must be <= 1.10)")
        eager = [r for r in results if r["stats"] == mode and r["eager"]]
        for f, e in zip(rs, eager):
            print(f"stats {mode}, {f['gib']:g} GiB: fused / eager = {e['seconds'] / f['seconds']:.2f}x")
    run_export(args)
    run_gpt_oss(args)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_make_export"]:
        print(json.dumps(make_export_source(Path(argv[1]), int(argv[2]), _parse_shape(argv[3]), argv[4])))
        return 0
    if argv[:1] == ["_make_gpt_oss"]:
        print(json.dumps(make_gpt_oss_source(Path(argv[1]), int(argv[2]))))
        return 0
    if argv[:1] == ["_make"]:
        print(json.dumps(make_source(Path(argv[1]), int(argv[2]), _parse_shape(argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
