"""The ``te-serial`` command line: inspect, convert, verify, diff, demo."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from .errors import TeSerialError
from .fusion import FUSED_MODES

EPILOG = """\
examples:
  te-serial inspect ckpt/                         table of tensors: shape, recipe, usages, bytes
  te-serial inspect model/ --as mxfp8             ... and the size each would take as MXFP8
  te-serial inspect ckpt/ --json                  the same as JSON
  te-serial convert hf-model/ out/ --recipe mxfp8         BF16 safetensors -> te-serial MXFP8
  te-serial convert deepseek-v3/ out/ --recipe fp8_block  DeepSeek FP8 -> TE blockwise (lossless)
  te-serial convert ckpt/ served/ --recipe compressed_tensors_fp8   -> vLLM-loadable FP8
  te-serial convert ckpt/ served/ --recipe modelopt_nvfp4           -> ModelOpt NVFP4 (TE's bytes kept)
  te-serial convert ckpt/ hf/ --recipe bf16 --report report.json    -> plain BF16 for any HF loader
  te-serial convert ckpt/ out/ --recipe nvfp4_2d --rules rules.txt  per-tensor targets by glob
  te-serial verify ckpt/                          schema, sizes and checksums
  te-serial diff a/ b/                            per-tensor numeric comparison
  te-serial demo                                  quantize sample tensors with every recipe

rules file: one 'PATTERN TARGET' per line (or a JSON object), first match wins, e.g.
  *.mlp.*.weight   nvfp4_2d
  *.attn.*.weight  mxfp8
  *                keep

exit status: 0 success; 1 error (one line on stderr naming the file and tensor); 2 bad usage;
diff: 0 identical, 1 different, 2 error.
"""


def _serving_targets() -> str:
    """The serving layouts, from the target table (one place for what each writes)."""
    from .conversion.targets import TARGETS
    rows = [(t.name, t.description) for t in TARGETS.values() if t.scheme is not None]
    width = max(len(n) for n, _ in rows) + 2
    return "\n".join(f"  {n:<{width}}{d}" for n, d in rows)


CONVERT_EPILOG = """\
serving layouts (a model directory: shards + model.safetensors.index.json + config.json, the
source's config.json / generation_config.json / tokenizer files copied, te_serial_export.json):
{targets}
NVFP4 exports keep TE's codes and block scales byte for byte; the layout's reader applies the
global scale with its own formula, so values can land a few fp32 ulp away: the report labels
them "exact codes" with the measured bound. Every other exact path is "lossless". Weights an
engine fuses into one GEMM (q/k/v, gate/up, ...) are quantized with one shared tensor scale;
copied per-tensor FP8 weights keep their own, which engines requantize to the group's largest at
load (--fused).

examples:
  te-serial convert model/ out/ --recipe mxfp8
  te-serial convert out/ hf/ --recipe bf16 --report r.json
  te-serial convert te-ckpt/ served/ --recipe modelopt_nvfp4 --activation-amax amax.json
  te-serial convert te-ckpt/ served/ --recipe compressed_tensors_fp8 --activations dynamic
  te-serial convert served/ back/                      ModelOpt / compressed-tensors -> te-serial
"""


def _targets_help() -> str:
    from .conversion.targets import TARGETS
    return ", ".join(TARGETS)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="te-serial",
        description="Pickle-free checkpoints for Transformer Engine quantized tensors.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="quantize a few tensors with every recipe; print sizes and errors")
    sub.add_parser("build-kernels", help="build the C kernels for this machine now (else the first compiled "
                                         "quantize builds them; eager paths never do)")

    p = sub.add_parser("inspect", help="list a checkpoint's tensors (any layout te-serial reads)",
                       epilog="example:\n  te-serial inspect model/ --as nvfp4_2d",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint: te-serial, safetensors (file/dir/index), DeepSeek FP8, compressed-tensors FP8")
    p.add_argument("--as", dest="as_recipe", metavar="RECIPE", help=f"estimate sizes under RECIPE ({_targets_help()})")
    p.add_argument("--rules", metavar="FILE", help="rules file for --as (default rules otherwise)")
    p.add_argument("--usages", choices=("rowwise", "columnwise", "both"), help="usages for --as")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    c = sub.add_parser("convert", help="convert a checkpoint to another recipe or layout",
                       epilog=CONVERT_EPILOG.format(targets=_serving_targets()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("src", help="source checkpoint (layout auto-detected)")
    c.add_argument("dst", help="destination directory (or a .safetensors file for te-serial / plain targets)")
    c.add_argument("--recipe", metavar="R", help=f"target of the default rule: {_targets_help()}")
    c.add_argument("--rules", metavar="FILE", help="rules file: 'PATTERN TARGET' lines or a JSON object")
    c.add_argument("--dtype", default="bf16", help="nominal dtype of quantized tensors / dtype of dequantized ones (bf16)")
    c.add_argument("--usages", choices=("rowwise", "columnwise", "both"),
                   help="usages of te-serial recipe targets (default: the source's, or both)")
    c.add_argument("--max-shard-size", default="5GB", help="largest shard (5GB; '500MB', '2GiB' or bytes)")
    c.add_argument("--report", metavar="FILE", help="also write the report as JSON")
    c.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    c.add_argument("--activations", default="auto", choices=("auto", "weight_only", "none", "dynamic", "static"),
                   help="serving layouts' activation scheme: auto (static scales when every quantized layer has an "
                        "activation amax, else weight-only W8A16/W4A16 where the layout has it, else dynamic), "
                        "weight_only (= none), dynamic, static (W8A8 / W4A4 from recorded amax)")
    c.add_argument("--activation-amax", metavar="FILE",
                   help="JSON {module: amax of its input} from a calibration pass (te_serial.conversion.ActivationAmax)")
    c.add_argument("--fused", default="auto", choices=FUSED_MODES,
                   help="auto: weights an engine fuses (q/k/v, gate/up, ...) are quantized with one shared tensor "
                        "scale, and copied NVFP4 weights are requantized to it; copied per-tensor FP8 weights keep "
                        "their own (engines requantize them to the group's largest at load); shared: those too; "
                        "off: each its own (engines then serve NVFP4 groups with wrong values; the report warns)")
    c.add_argument("--stats", default="full", choices=("full", "sample", "none"),
                   help="error figures of requantized tensors: every element (full), evenly spread row blocks, "
                        "about 1/16 of the rows (sample), or none; lossless paths are verified in full in every mode")
    c.add_argument("--device", default=None,
                   help="where tensors are quantized: cuda or cpu (default: cuda when available)")
    prog = c.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show a progress bar on stderr (default: when stderr is a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_false")
    c.add_argument("--quiet", action="store_true", help="print only the summary line, not the per-tensor table")
    c.add_argument("--json", action="store_true", help="print the report as JSON")

    v = sub.add_parser("verify", help="check a checkpoint completely (schema, sizes, checksums)")
    v.add_argument("path")
    v.add_argument("--json", action="store_true")

    d = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (values, in fp32)")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--all", action="store_true", help="list identical tensors too")
    d.add_argument("--json", action="store_true")
    return parser


# --- helpers -------------------------------------------------------------------------------------

def _table(rows: list[tuple], right: set[int], out: TextIO) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        out.write("  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths))).rstrip() + "\n")
        if j == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def _shape(s) -> str:
    return "x".join(map(str, s)) or "scalar"


def _fnum(x: float) -> Any:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


class _ProgressBar:
    """convert's ``progress(done, total, name)`` drawn by tqdm: bytes with SI units (right on a
    kilobyte job and a terabyte one), throughput, ETA, and the tensor being converted."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream, self.label, self.bar = stream, label, None

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.bar is None:  # made at the first call, when the total is known
            from tqdm import tqdm
            tty = self.stream.isatty()
            self.bar = tqdm(total=total, desc=self.label, unit="B", unit_scale=True, unit_divisor=1000,
                            file=self.stream, dynamic_ncols=tty, mininterval=0.1 if tty else 1.0, ascii=not tty)
        self.bar.update(done - self.bar.n)
        if name:
            self.bar.set_postfix_str(name, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- commands ------------------------------------------------------------------------------------

def cmd_inspect(args, out: TextIO) -> int:
    from .conversion import open_source, plan_conversion
    from .conversion.report import format_bytes
    with open_source(args.path) as src:
        estimate = None
        if args.as_recipe or args.rules:
            _, _, plans = plan_conversion(src, recipe=args.as_recipe, rules=args.rules, usages=args.usages)
            estimate = {p.name: (p.nbytes, p.target) for p in plans}
        items = []
        for name, st in src.tensors.items():
            row = {"name": name, "shape": list(st.shape), "dtype": str(st.dtype).replace("torch.", ""),
                   "recipe": st.fmt, "usages": st.usages, "bytes": st.nbytes}
            if st.alias_of:
                row["tied_to"] = st.alias_of
            if estimate is not None:
                row["as_bytes"], row["as_format"] = estimate[name]
            items.append(row)
        dropped = [{"name": n, "reason": why, "bytes": b} for n, (why, b) in src.dropped.items()]
        total = src.nbytes
        by_fmt: dict[str, list[int]] = {}
        for it in items:
            if "tied_to" in it:
                continue
            e = by_fmt.setdefault(it["recipe"], [0, 0])
            e[0] += 1
            e[1] += it["bytes"]
        doc: dict[str, Any] = {"path": args.path, "layout": src.layout, "tensors": items, "count": len(items),
                               "total_bytes": total, "by_recipe": {k: {"tensors": v[0], "bytes": v[1]}
                                                                   for k, v in by_fmt.items()}}
        if dropped:
            doc["not_weights"] = dropped
        if estimate is not None:
            est = sum(b for n, (b, _) in estimate.items() if not src.tensors[n].alias_of)
            doc["as"] = {"recipe": args.as_recipe, "rules": args.rules, "total_bytes": est,
                         "ratio": est / total if total else None}
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
        return 0
    out.write(f"{args.path}: {src.layout} checkpoint, {len(items)} tensors\n")
    head = ["tensor", "shape", "recipe", "usages", "bytes"]
    if estimate is not None:
        head += [f"as {args.as_recipe or 'rules'}", "bytes"]
    rows = [tuple(head)]
    for it in items:
        r = [it["name"], _shape(it["shape"]), it["recipe"] + (f" (tied to {it['tied_to']})" if "tied_to" in it else ""),
             it["usages"], str(it["bytes"])]
        if estimate is not None:
            r += [it["as_format"], str(it["as_bytes"])]
        rows.append(tuple(r))
    _table(rows, {1, 4, 6}, out)
    for dname in dropped:
        out.write(f"not a weight: {dname['name']} ({dname['reason']}), {dname['bytes']} bytes\n")
    parts = ", ".join(f"{k}: {v[0]} tensors {format_bytes(v[1])}" for k, v in by_fmt.items())
    out.write(f"total: {len(items)} tensors, {total} bytes ({format_bytes(total)}); {parts}\n")
    if estimate is not None:
        a = doc["as"]
        ratio = f" ({a['ratio']:.3f}x)" if a["ratio"] is not None else ""
        out.write(f"as {args.as_recipe or 'rules'}: {a['total_bytes']} bytes ({format_bytes(a['total_bytes'])}){ratio}\n")
    return 0


def cmd_convert(args, out: TextIO, err: TextIO) -> int:
    from .conversion import convert
    show = args.progress if args.progress is not None else err.isatty()
    bar = _ProgressBar(err, "converting") if show else None
    try:
        rep = convert(args.src, args.dst, recipe=args.recipe, rules=args.rules, dtype=args.dtype,
                      max_shard_size=args.max_shard_size, report=args.report, progress=bar,
                      usages=args.usages, overwrite=args.overwrite, activations=args.activations,
                      activation_amax=args.activation_amax, stats=args.stats, device=args.device,
                      fused=args.fused)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        out.write(rep.to_json() + "\n")
    elif args.quiet:
        out.write(rep.summary() + "\n")
    else:
        out.write(rep.table() + "\n")
    return 0


def cmd_verify(args, out: TextIO) -> int:
    from .conversion import open_source
    with open_source(args.path) as src:
        layout = src.layout
        n = len(src.tensors)
        if layout == "te-serial":
            from .checkpoint import verify
            buffers = verify(args.path)
            what = f"{buffers} buffers: manifest schema, file sizes, headers and checksums"
        else:
            for name in src.tensors:
                src.load(name)  # every header entry, offset and layout rule checked; bytes read
            buffers = None
            what = "headers, offsets and layout (this layout has no checksums)"
    if args.json:
        out.write(json.dumps({"path": args.path, "ok": True, "layout": layout, "tensors": n,
                              "buffers": buffers}) + "\n")
    else:
        out.write(f"ok: {args.path}: {layout}, {n} tensors; checked {what}\n")
    return 0


def cmd_diff(args, out: TextIO) -> int:
    from .conversion import compare, open_source, values
    rows = []
    with open_source(args.a) as a, open_source(args.b) as b:
        names = list(a.tensors) + [n for n in b.tensors if n not in a.tensors]
        for name in names:
            ta, tb = a.tensors.get(name), b.tensors.get(name)
            if ta is None or tb is None:
                rows.append({"name": name, "status": "only in A" if tb is None else "only in B",
                             "a": ta.fmt if ta else None, "b": tb.fmt if tb else None})
                continue
            row = {"name": name, "a": ta.fmt, "b": tb.fmt, "shape": list(ta.shape)}
            if ta.shape != tb.shape:
                row.update(status="shape", shape_b=list(tb.shape))
            else:
                s = compare(values(a.load(name)), values(b.load(name)))
                row.update(status="same" if s.exact else "differs", max_abs_err=_fnum(s.max_abs_err),
                           rel_rmse=_fnum(s.rel_rmse), snr_db=_fnum(s.snr_db))
            rows.append(row)
    differ = [r for r in rows if r["status"] != "same"]
    if args.json:
        out.write(json.dumps({"a": args.a, "b": args.b, "identical": not differ, "tensors": rows}, indent=2) + "\n")
        return 1 if differ else 0
    shown = rows if args.all else differ
    if shown:
        table = [("tensor", "status", "A", "B", "max abs err", "rel rmse", "SNR dB")]
        for r in shown:
            num = r["status"] in ("same", "differs")
            table.append((r["name"], r["status"] + (f" {_shape(r['shape'])} vs {_shape(r['shape_b'])}"
                                                    if r["status"] == "shape" else ""),
                          r.get("a") or "-", r.get("b") or "-",
                          f"{r['max_abs_err']:.4g}" if num and r["status"] == "differs" else "0" if num else "-",
                          f"{r['rel_rmse']:.4g}" if num and r["status"] == "differs" else "0" if num else "-",
                          (f"{r['snr_db']:.1f}" if isinstance(r["snr_db"], float) else r["snr_db"])
                          if num and r["status"] == "differs" else "inf" if num else "-"))
        _table(table, {4, 5, 6}, out)
    same = len(rows) - len(differ)
    out.write(f"{len(rows)} tensors: {same} identical, {len(differ)} different"
              + ("" if differ else " - the checkpoints hold the same values") + "\n")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    fail = 2 if args.command == "diff" else 1
    try:
        if args.command == "demo":
            from .demo import run_demo
            return run_demo()
        if args.command == "build-kernels":
            from . import native
            path = native.build()
            out.write(f"te-serial C kernels: {path}\n" if path else "te-serial C kernels could not be built "
                      "(see the warning); torch's own ops run instead\n")
            return 0 if path else 1
        if args.command == "inspect":
            return cmd_inspect(args, out)
        if args.command == "convert":
            return cmd_convert(args, out, err)
        if args.command == "verify":
            return cmd_verify(args, out)
        if args.command == "diff":
            return cmd_diff(args, out)
    except TeSerialError as e:
        msg = " ".join(str(e).split())
        print(f"te-serial: error: {type(e).__name__}: {msg}", file=err)
        return fail
    except (OSError, ValueError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        print(f"te-serial: error: {type(e).__name__}: {msg}", file=err)
        return fail
    except KeyboardInterrupt:
        print("te-serial: interrupted", file=err)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
