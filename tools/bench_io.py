"""``tools/bench.py io``: the I/O regression guard, one short run (under a minute by default).

Side by side with safetensors in the same run, as ratios (> 1: te-serial is faster):

* open: ``te_serial.open`` + every prototype built (``ckpt.protos[name]`` for each name) of a
  10,000-tensor checkpoint (2,000 MXFP8, 8,000 BF16), saved as a directory and as a single
  ``.safetensors`` file, each against ``safe_open`` + ``keys()`` + every key's shape and dtype of
  the same file (the directory's shard); and the first read (open + one tensor) of each against
  ``safe_open`` + ``get_tensor``;
* save: ``save_quantized`` of a mixed quantized state dict against ``save_file`` + fsync of the
  same bytes, with default settings and with ``TE_SERIAL_DIRECT_IO=1`` and ``=0``;
* load: ``load_quantized`` + reading every byte against ``load_file`` + the same, right after
  the save (what an evaluation after a save, or a resume on the same node, does).

``--against REV`` runs the same measurements on commit ``REV``'s sources (``git archive``) in a
child process, so a change is measured before and after in one run. The measuring code imports
only te-serial's public API, so it runs on older commits too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent


def add_parser(sub) -> None:
    p = sub.add_parser("io", help="open / save / load against safetensors, one short run (the regression guard)")
    p.add_argument("--gib", type=float, default=0.5, help="size of the mixed state dict saved and loaded")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--against", default=None, metavar="REV", help="also measure commit REV's sources, in a child")


def _state(total_bytes: int):
    """~total_bytes of transformer-like tensors: quantized weights of four recipes, BF16 beside them."""
    import torch
    import te_serial as ts
    from te_serial.recipes import recipe_quantizer
    g = torch.Generator().manual_seed(0)
    recipes = ["mxfp8", "nvfp4", "fp8_block", "fp8_current"]
    sd, layer, size = {}, 0, 0
    while size < total_bytes:
        for j, shape in enumerate([(4096, 4096), (4096, 2048), (2048, 4096)]):
            t = ts.TensorProto(shape, torch.bfloat16, recipe_quantizer(recipes[(layer + j) % 4], columnwise=False)) \
                .create_tensor()
            for b in t.buffers().values():
                flat = b.view(torch.uint8).reshape(-1)
                flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
            sd[f"layers.{layer}.w{j}"] = t
            size += sum(b.numel() * b.element_size() for b in t.buffers().values())
        sd[f"layers.{layer}.norm"] = torch.randn(4096, generator=g).to(torch.bfloat16)
        sd[f"layers.{layer}.proj"] = torch.randn(1024, 4096, generator=g).to(torch.bfloat16)
        size += 4096 * 2 + 1024 * 4096 * 2
        layer += 1
    return sd


def _plain(sd):
    """The same bytes as plain tensors (what safetensors is given)."""
    out = {}
    for name, t in sd.items():
        if hasattr(t, "buffers") and hasattr(t, "quantizer"):
            out.update({f"{name}.{n}": b for n, b in t.buffers().items()})
        else:
            out[name] = t
    return out


def _touch(tensors) -> None:
    for t in tensors:
        bufs = t.buffers().values() if hasattr(t, "quantizer") else [t]
        for b in bufs:
            if b.numel():
                b.reshape(-1).view(__import__("torch").uint8).max()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def every_proto(path) -> list:
    """``te_serial.open`` of a checkpoint and every prototype built, ``ckpt.protos[name]`` for each
    name (public API only, so that other commits' sources run it too)."""
    import te_serial as ts
    with ts.open(path) as ckpt:
        return [ckpt.protos[name] for name in ckpt.protos]


def measure(work: Path, gib: float, repeat: int) -> dict[str, float]:
    """{measure: te-serial's speed / safetensors'} for this process's te_serial."""
    import torch
    import te_serial as ts
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    sys.path.insert(0, str(TOOLS))
    from timing import ab
    out: dict[str, float] = {}

    g = torch.Generator().manual_seed(1)
    q = ts.MXFP8Quantizer()
    many = {f"layers.{i // 10}.t{i % 10}": (q(torch.randn(32, 64, generator=g)) if i % 5 == 0 else
                                           torch.randn(64, generator=g).to(torch.bfloat16)) for i in range(10_000)}
    first = "layers.0.t0"
    for layout, path in (("dir", work / "many"), ("file", work / "many.safetensors")):
        ts.save_quantized(many, path)
        st_path = str(next(path.glob("*.safetensors")) if layout == "dir" else path)

        def st_keys(st_path=st_path):
            with safe_open(st_path, "pt") as f:
                return [(s.get_shape(), s.get_dtype()) for s in map(f.get_slice, f.keys())]

        def st_first(st_path=st_path):
            with safe_open(st_path, "pt") as f:
                return f.get_tensor(first + "._rowwise_data")

        def ours_first(path=path):
            with ts.open(path) as ckpt:
                return ckpt.get(first)

        t = ab({"ours": lambda path=path: every_proto(path), "st": st_keys}, max(repeat, 11))
        out[f"open_{layout}_ms"], out[f"safe_open_keys_{layout}_ms"] = t["ours"] * 1e3, t["st"] * 1e3
        out[f"open_{layout}"] = t["st"] / t["ours"]
        t = ab({"ours": ours_first, "st": st_first}, max(repeat, 11))
        out[f"first_read_{layout}_ms"], out[f"safe_open_get_{layout}_ms"] = t["ours"] * 1e3, t["st"] * 1e3
        out[f"first_read_{layout}"] = t["st"] / t["ours"]
    del many

    sd = _state(int(gib * (1 << 30)))
    flat = _plain(sd)
    counter = iter(range(10 ** 6))

    def save_ours(setting):
        def run():
            if setting is None:
                os.environ.pop("TE_SERIAL_DIRECT_IO", None)
            else:
                os.environ["TE_SERIAL_DIRECT_IO"] = setting
            p = work / f"s{next(counter)}"
            ts.save_quantized(sd, p)
            shutil.rmtree(p)
        return run

    def save_st():
        p = work / f"s{next(counter)}.safetensors"
        save_file(flat, str(p))
        _fsync(p)
        p.unlink()

    before = os.environ.get("TE_SERIAL_DIRECT_IO")
    try:
        t = ab({"default": save_ours(None), "direct=1": save_ours("1"), "direct=0": save_ours("0"), "st": save_st},
               repeat)
    finally:
        os.environ.pop("TE_SERIAL_DIRECT_IO", None)
        if before is not None:
            os.environ["TE_SERIAL_DIRECT_IO"] = before
    out["save_GBps_safetensors"] = sum(v.numel() * v.element_size() for v in flat.values()) / 1e9 / t["st"]
    for k in ("default", "direct=1", "direct=0"):
        out[f"save[{k}]"] = t["st"] / t[k]

    ours, theirs = work / "load", work / "load.safetensors"
    ts.save_quantized(sd, ours)            # default settings, as a training loop saves
    save_file(flat, str(theirs))
    shards = sorted(str(p) for p in ours.glob("*.safetensors"))
    t = ab({"ours": lambda: _touch(ts.load_quantized(ours).values()),
            "st_same_files": lambda: _touch(v for f in shards for v in load_file(f).values()),
            "st": lambda: _touch(load_file(str(theirs)).values())}, repeat)
    out["load"] = t["st"] / t["ours"]
    out["load_vs_same_files"] = t["st_same_files"] / t["ours"]
    return out


def _child_against(rev: str, work: Path, gib: float, repeat: int) -> dict[str, float] | None:
    with tempfile.TemporaryDirectory(prefix="te-serial-rev-") as tmp:
        try:
            tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "te_serial", "schema"], capture_output=True,
                                 check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
            code = (f"import sys, json; sys.path.insert(0, {str(TOOLS)!r}); import bench_io; "
                    f"print(json.dumps(bench_io.measure(__import__('pathlib').Path({str(work)!r}), {gib}, {repeat})))")
            res = subprocess.run([sys.executable, "-c", code], cwd=tmp, env={**os.environ, "PYTHONPATH": tmp},
                                 capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"({rev} could not be measured: {getattr(e, 'stderr', '') or e})")
            return None
    return json.loads(res.stdout.strip().splitlines()[-1])


_ROWS = [("open_dir", "open + every prototype, 10,000 tensors, dir", "open_dir_ms", "safe_open_keys_dir_ms",
          "≥ 1.0, ≤ 15 ms"),
         ("open_file", "  the same, one .safetensors file", "open_file_ms", "safe_open_keys_file_ms",
          "≥ 1.0, ≤ 15 ms"),
         ("first_read_dir", "open + first tensor, dir", "first_read_dir_ms", "safe_open_get_dir_ms", ""),
         ("first_read_file", "  the same, one .safetensors file", "first_read_file_ms", "safe_open_get_file_ms", ""),
         ("save[default]", "save, default settings", None, None, "≥ 1.0"),
         ("save[direct=1]", "save, TE_SERIAL_DIRECT_IO=1", None, None, "≥ 0.9"),
         ("save[direct=0]", "save, TE_SERIAL_DIRECT_IO=0", None, None, "≥ 0.9"),
         ("load", "load + read every byte, after the save", None, None, "≥ 1.0"),
         ("load_vs_same_files", "  (load_file of te-serial's own shards)", None, None, "")]


def run(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="te-serial-io-", dir=args.dir))
    try:
        (work / "now").mkdir()
        now = measure(work / "now", args.gib, args.repeat)
        then = None
        if args.against:
            (work / "then").mkdir()
            then = _child_against(args.against, work / "then", args.gib, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    head = f"io: {args.gib} GiB mixed state dict, median of {args.repeat} interleaved; ratios vs safetensors " \
           f"(> 1: te-serial faster); safetensors save_file + fsync {now['save_GBps_safetensors']:.2f} GB/s"
    print(head)
    cols = f"  {'':<44}{'now':>26}" + (f"{args.against:>26}" if then else "") + "   target"
    print(cols)
    for key, label, ms, base_ms, target in _ROWS:
        def cell(r):
            if r is None or key not in r:
                return "-"
            return f"{r[key]:.2f}x" + (f" ({r[ms]:.1f} vs {r[base_ms]:.1f} ms)" if ms else "")
        print(f"  {label:<44}{cell(now):>26}" + (f"{cell(then):>26}" if then else "") + f"   {target}")
