"""Write te-serial's golden checkpoints (format v1) and their expected records.

    python tools/make_golden.py             # write schema/golden/ (refuses to change existing files)
    python tools/make_golden.py --force     # overwrite existing golden files
    python tools/make_golden.py --check     # generate twice into temp dirs; compare with each other
                                            # and with schema/golden/, byte for byte
    python tools/make_golden.py --out DIR   # write somewhere else

Golden files are the compatibility contract of format v1: every later te-serial must read them
and get exactly the buffers, dequantized values and tree recorded in ``<name>.expected.json``
(tests/test_golden.py checks this on every run). So they are written **once** and regenerated
only on purpose — a regeneration by a later te-serial is a new set of files, not a fix.

Everything is deterministic: the inputs come from a fixed integer hash of (seed, index) turned
into floats with exact IEEE arithmetic (no torch RNG, whose streams may change between torch
releases), names are fixed, and only the single-file form is written (the directory form puts a
random save id into its shard names). The manifest records the producer's versions (te-serial,
torch, transformer_engine), so byte-identity holds for one environment.

Expected record (``<name>.expected.json``): the file's size and xxh3_64, the manifest's format,
version, producer and metadata, per tensor its prototype (shape, dtype, requires_grad, quantizer
fields, storage, scale_layout) and per buffer its key, shape, dtype (te-serial name and
safetensors code) and the xxh3_64 of its bytes, the xxh3_64 of ``t.dequantize(torch.float32)``
for quantized tensors, and the tree with every plain value in a typed JSON encoding:
``{"$tensor": flat name}``, ``{"$tuple": [...]}``, ``{"$dict": [[key, value], ...]}`` (key order and
int keys kept), ``{"$float": float.hex()}``, ``{"$bytes": hex}``; ints, bools, None, str and
lists as themselves. The digests are computed here from the tensors in memory, independently of
te-serial's reader and checksum code.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import te_serial as ts  # noqa: E402
from te_serial.dtypes import _DTYPES, dtype_name, safetensors_code  # noqa: E402

GOLDEN_DIR = ROOT / "schema" / "golden"
EXPECTED_SCHEMA = "te-serial-golden-expected/1"
MASK32 = 0xFFFFFFFF


# --- deterministic inputs ----------------------------------------------------------------------

def _hash32(i: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (int64 arithmetic that never overflows: operands < 2^32 · 2^27)."""
    x = i & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def det_normal(shape, seed: int) -> torch.Tensor:
    """Roughly N(0, 1) fp32 values, a pure function of (shape, seed), bit-identical everywhere.

    Four uniforms in [0, 1) with 24-bit resolution (exact in fp32) per element, summed exactly in
    fp64 (Irwin-Hall), centred and scaled by sqrt(3) with one rounding, then rounded to fp32.
    """
    n = math.prod(shape)
    idx = torch.arange(4 * n, dtype=torch.int64) + (seed * 0x9E3779B1) % (1 << 32)
    u = (_hash32(idx) >> 8).to(torch.float64) / float(1 << 24)
    s = u.reshape(n, 4).sum(dim=1)  # exact: four 24-bit fractions
    return ((s - 2.0) * math.sqrt(3.0)).to(torch.float32).reshape(shape)


def make_input(shape, seed: int, dtype: torch.dtype = torch.bfloat16, *, scale: float = 1.0,
               zero_tile: bool = False, tiny_tile: bool = False, outliers: bool = False) -> torch.Tensor:
    """A fixed input: det_normal · scale, optionally with edge cases in its 2-D view [M, K]:
    a zero 16×16 tile at the top left (an all-zero block in every format), a tile scaled by
    2^-100 next to it (tiny magnitudes, subnormal scales), and a few outliers (×1000)."""
    x = det_normal(shape, seed) * scale
    m, k = math.prod(shape[:-1]), shape[-1]
    x2 = x.reshape(m, k)
    if zero_tile:
        x2[:16, :16] = 0.0
    if tiny_tile:
        x2[:16, 16:32] *= 2.0 ** -100
    if outliers:
        flat = x2.reshape(-1)
        for j in range(3):
            flat[(j * 7919 + 13) % flat.numel()] *= 1000.0
    return x.to(dtype)


def param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=True)


# --- the golden cases --------------------------------------------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def case_fp8_delayed() -> dict:
    Q = ts.Float8Quantizer
    w = make_input((64, 64), 1, torch.bfloat16, zero_tile=True)
    amax = float(w.float().abs().amax())
    p = make_input((2, 8, 48), 2, torch.float32, scale=20.0)
    c = make_input((48, 32), 3, torch.float16, outliers=True)
    return {
        "layers": [{"weight": Q(scale=448.0 / amax, amax=amax)(w)}],
        "proj": {"weight": Q(scale=_fp32(0.7), amax=0.0, fp8_dtype=E5M2, columnwise=False)(p)},
        "columnwise_only": Q(scale=3.0, amax=12.5, rowwise=False)(c),
        "zeros": Q(scale=1.0, amax=0.0)(torch.zeros(16, 16, dtype=torch.bfloat16)),
    }


def _current(fp8_dtype: torch.dtype) -> dict:
    Q = ts.Float8CurrentScalingQuantizer
    return {
        "layers": [{"weight": Q(fp8_dtype)(make_input((64, 64), 11, torch.bfloat16, zero_tile=True,
                                                      tiny_tile=True))}],
        "proj": {"weight": Q(fp8_dtype, force_pow_2_scales=True, columnwise=False)(
            make_input((2, 8, 48), 12, torch.float32, scale=300.0))},
        "columnwise_only": Q(fp8_dtype, amax_epsilon=1e-3, rowwise=False)(
            make_input((48, 32), 13, torch.float16, outliers=True)),
        "tiny": Q(fp8_dtype, amax_epsilon=1.0)(make_input((16, 32), 14, torch.float32, scale=1e-3)),
        "zeros": Q(fp8_dtype)(torch.zeros(16, 16, dtype=torch.bfloat16)),
    }


def case_fp8_current_e4m3() -> dict:
    return _current(E4M3)


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict of tensors as one flat dict keyed by dotted names (the manifest then stores
    no tree: a flat dict of tensors under their own names is the implied default)."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "."))
        elif isinstance(v, list):
            out.update(_flat(dict(enumerate(v)), name + "."))
        else:
            out[name] = v
    return out


def case_fp8_current_e5m2() -> dict:
    return _flat(_current(E5M2))


def _mxfp8(two_d: bool) -> dict:
    Q = ts.MXFP8Quantizer
    kw = {"with_2d_quantization": two_d}
    return {
        "layers": [{"weight": Q(**kw)(make_input((64, 64), 21, torch.bfloat16, zero_tile=True,
                                                 tiny_tile=True, outliers=True))}],
        "proj": {"weight": Q(E5M2, rowwise=True, columnwise=False, **kw)(
            make_input((2, 32, 64), 22, torch.float32, scale=1e4))},
        "columnwise_only": Q(rowwise=False, **kw)(make_input((32, 96), 23, torch.float16)),
        "param": param(Q(**kw)(make_input((32, 32), 24, torch.bfloat16))),
    }


def case_mxfp8_1x32() -> dict:
    return _mxfp8(False)


def case_mxfp8_2d() -> dict:
    return _mxfp8(True)


def _blockwise(dim: int) -> dict:
    Q = ts.Float8BlockQuantizer
    kw = {"block_scaling_dim": dim}
    return {
        # 3-D, K = 130: a full and a 2-wide block along K
        "layers": [{"weight": Q(**kw)(make_input((2, 10, 130), 31, torch.bfloat16, zero_tile=True,
                                                 outliers=True))}],
        # M = 130: a full and a 2-high block along M
        "tall": Q(**kw)(make_input((130, 16), 32, torch.float32, scale=50.0)),
        "proj": {"weight": Q(force_pow_2_scales=False, columnwise=False, **kw)(
            make_input((3, 4, 40), 33, torch.float32, tiny_tile=True))},
        "columnwise_only": Q(E5M2, amax_epsilon=1e-2, rowwise=False, **kw)(
            make_input((20, 136), 34, torch.float16)),
    }


def case_fp8_blockwise_1d() -> dict:
    return _blockwise(1)


def case_fp8_blockwise_2d() -> dict:
    return _flat(_blockwise(2))


def _nvfp4(two_d: bool) -> dict:
    Q = ts.NVFP4Quantizer
    kw = {"with_2d_quantization": two_d}
    out = {
        "layers": [{"weight": Q(**kw)(make_input((64, 64), 41, torch.bfloat16, zero_tile=True,
                                                 tiny_tile=True, outliers=True))}],
        "proj": {"weight": Q(columnwise=False, **kw)(make_input((2, 16, 32), 42, torch.float32, scale=7.0))},
        "columnwise_only": Q(rowwise=False, **kw)(make_input((32, 48), 43, torch.float16)),
        "zeros": Q(**kw)(torch.zeros(16, 16, dtype=torch.bfloat16)),
    }
    if not two_d:  # the activation/gradient recipe: RHT on the columnwise copy (rowwise dequantizes)
        out["rht"] = Q(with_rht=True, with_post_rht_amax=True)(make_input((64, 32), 44, torch.bfloat16))
        out["rht_no_sign_mask"] = Q(with_rht=True, with_post_rht_amax=True, with_random_sign_mask=False)(
            make_input((32, 32), 45, torch.bfloat16))
    return out


def case_nvfp4_1d() -> dict:
    return _nvfp4(False)


def case_nvfp4_2d() -> dict:
    return _flat(_nvfp4(True))


def case_mixed() -> dict:
    """Plain tensors of every dtype te-serial knows, edge-case tensors, and a tree of plain values."""
    every = {}
    for i, (name, (dt, _)) in enumerate(_DTYPES.items()):
        if dt == torch.bool:
            t = (torch.arange(10) % 3) == 0
        elif dt == torch.complex64:
            t = torch.complex(det_normal((2, 3), 50), det_normal((2, 3), 51))
        elif dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = (det_normal((2, 5), 52 + i) * 10).to(dt)
        elif dt == torch.float8_e8m0fnu:
            t = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8).view(dt)
        elif dt.is_floating_point:
            t = (det_normal((3, 4), 52 + i) * 100).to(dt)
        else:
            info = torch.iinfo(dt)
            t = torch.tensor([info.min, info.max, 0, 1, info.max // 3, 7], dtype=dt)
        every[name] = t
    tied = det_normal((4, 4), 60)
    base = det_normal((6, 8), 61)
    return {
        "every_dtype": every,
        "empty": torch.empty((0, 3), dtype=torch.float32),
        "scalar": torch.tensor(2.75, dtype=torch.float64),
        "trainable": param(det_normal((5,), 62)),
        "non_contiguous": base.t()[1:5],           # a strided view: saved as its values
        "emb": {"weight": tied},
        "head": {"weight": tied},                   # tied: stored once, refers to emb.weight
        "layers": [
            {"weight": ts.MXFP8Quantizer()(make_input((32, 64), 63, torch.bfloat16)),
             "bias": det_normal((32,), 64).to(torch.bfloat16)},
            ({"scale": torch.tensor([1.5]), 0: "zero", 1: torch.arange(3, dtype=torch.int32)}, 3),
        ],
        "config": {
            "int": 42, "neg": -7, "u64_max": (1 << 64) - 1, "i64_min": -(1 << 63),
            "float": 0.1, "neg_zero": -0.0, "inf": float("inf"), "big": 1e300,
            "str": "héllo ✓", "empty_str": "", "true": True, "false": False, "none": None,
            "bytes": b"\x00\xffte",
            "list": [1, 2.5, "x", None, [True, []]], "tuple": (1, ("a", ()), [2]),
            "empty_dict": {}, "empty_list": [], "empty_tuple": (),
            7: "int key", -1: {"nested": {0: [None]}}, "7": "str key that looks like an int",
        },
        "step": 1000,
    }


CASES: dict[str, tuple[Callable[[], dict], str]] = {
    "fp8_delayed": (case_fp8_delayed, "per-tensor FP8, delayed scaling (scale/amax in the quantizer)"),
    "fp8_current_e4m3": (case_fp8_current_e4m3, "per-tensor FP8 current scaling, E4M3"),
    "fp8_current_e5m2": (case_fp8_current_e5m2, "per-tensor FP8 current scaling, E5M2 (flat dict: no tree)"),
    "mxfp8_1x32": (case_mxfp8_1x32, "MXFP8, 1x32 blocks"),
    "mxfp8_2d": (case_mxfp8_2d, "MXFP8, 32x32 tiles (with_2d_quantization)"),
    "fp8_blockwise_1d": (case_fp8_blockwise_1d, "blockwise FP8, 1x128 blocks"),
    "fp8_blockwise_2d": (case_fp8_blockwise_2d, "blockwise FP8, 128x128 blocks (flat dict: no tree)"),
    "nvfp4_1d": (case_nvfp4_1d, "NVFP4, 1x16 blocks (+ RHT tensors)"),
    "nvfp4_2d": (case_nvfp4_2d, "NVFP4, 16x16 tiles (with_2d_quantization; flat dict: no tree)"),
    "mixed": (case_mixed, "plain tensors of every dtype, edge-case tensors, nested tree of plain values"),
}


# --- expected records ----------------------------------------------------------------------------

def digest_bytes(data: bytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64(data).hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values in C order, as little-endian bytes (what safetensors stores)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def digest(t: torch.Tensor) -> str:
    return digest_bytes(tensor_bytes(t))


def encode_value(v: Any, path: tuple = ()) -> Any:
    """The typed JSON form of a tree; a tensor becomes its flat name (its path joined by dots)."""
    if isinstance(v, (torch.Tensor, ts.QuantizedTensorStorage)):
        return {"$tensor": ".".join(map(str, path))}
    if isinstance(v, dict):
        return {"$dict": [[k, encode_value(x, path + (k,))] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x, path + (i,)) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode_value(x, path + (i,)) for i, x in enumerate(v)]
    if isinstance(v, float):
        return {"$float": v.hex()}
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    raise TypeError(f"cannot encode {type(v).__name__}")


def _flat_names(obj: Any, path: tuple = ()) -> dict[int, str]:
    """id(tensor) → flat name, first occurrence wins (as te-serial names tied tensors)."""
    out: dict[int, str] = {}
    if isinstance(obj, (torch.Tensor, ts.QuantizedTensorStorage)):
        out.setdefault(id(obj), ".".join(map(str, path)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            for i, n in _flat_names(v, path + (k,)).items():
                out.setdefault(i, n)
    elif isinstance(obj, (list, tuple)):
        for j, v in enumerate(obj):
            for i, n in _flat_names(v, path + (j,)).items():
                out.setdefault(i, n)
    return out


def _all_tensors(obj: Any, path: tuple = ()) -> list[tuple[str, Any]]:
    """(flat name, tensor) for every tensor leaf, tied ones at each of their places."""
    if isinstance(obj, (torch.Tensor, ts.QuantizedTensorStorage)):
        return [(".".join(map(str, path)), obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _all_tensors(v, path + (k,))]
    if isinstance(obj, (list, tuple)):
        return [x for j, v in enumerate(obj) for x in _all_tensors(v, path + (j,))]
    return []


def tensor_record(name: str, t: Any, manifest_entry) -> dict:
    """What a reader must find for one tensor, computed from the tensor in memory."""
    first_key = {b: e.key for b, e in manifest_entry.buffers.items()}
    if isinstance(t, ts.QuantizedTensorStorage):
        q = t.quantizer
        values = q.value_dtypes()
        buffers = {}
        for bname, b in t.buffers().items():
            stored = b.view(values[bname])
            buffers[bname] = {"key": first_key[bname], "shape": list(stored.shape),
                              "dtype": dtype_name(stored.dtype),
                              "safetensors_dtype": safetensors_code(stored.dtype),
                              "xxh3_64": digest(stored)}
        return {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                "requires_grad": bool(getattr(t, "requires_grad", False)),
                "quantizer": q.to_dict(), "storage": type(t).__name__, "scale_layout": "compact",
                "buffers": buffers, "dequantized_float32_xxh3_64": digest(t.dequantize(torch.float32))}
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "requires_grad": bool(t.requires_grad),
            "quantizer": None, "storage": None, "scale_layout": None,
            "buffers": {"data": {"key": first_key["data"], "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                                 "safetensors_dtype": safetensors_code(t.dtype), "xxh3_64": digest(t)}}}


def write_case(name: str, out_dir: Path) -> tuple[Path, Path]:
    build, description = CASES[name]
    obj = build()
    path = out_dir / f"{name}.safetensors"
    metadata = {"golden": name, "description": description}
    manifest = ts.save_quantized(obj, path, metadata=metadata)
    ids = _flat_names(obj)
    tensors = {}
    for flat, t in _all_tensors(obj):
        if flat in tensors:
            continue
        tensors[flat] = tensor_record(flat, t, manifest.tensors[flat])
        for bname, b in tensors[flat]["buffers"].items():  # the key rule, ties aside
            own = flat if bname == "data" else f"{flat}.{bname}"
            assert b["key"] == own or ids[id(t)] != flat, (flat, bname, b["key"])
    assert list(tensors) == list(manifest.tensors), "tensor order differs from the manifest's"
    data = path.read_bytes()
    record = {
        "schema": EXPECTED_SCHEMA,
        "name": name,
        "description": description,
        "file": path.name,
        "file_bytes": len(data),
        "file_xxh3_64": digest_bytes(data),
        "format": "te-serial",
        "version": list(manifest.version),
        "producer": manifest.producer,
        "metadata": metadata,
        "tensors": tensors,
        "tree": encode_value(obj),
    }
    exp = out_dir / f"{name}.expected.json"
    exp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _self_check(path, record)
    return path, exp


def _self_check(path: Path, record: dict) -> None:
    """The file reads back (through te-serial) as the record says."""
    assert ts.verify(path) == sum(len({b["key"] for b in t["buffers"].values()})
                                  for t in record["tensors"].values())
    with ts.open(path) as ckpt:
        loaded = ckpt.load_tensors()
    for n, want in record["tensors"].items():
        t = loaded[n]
        if want["quantizer"] is None:
            assert digest(t) == want["buffers"]["data"]["xxh3_64"], n
        else:
            values = t.quantizer.value_dtypes()
            for bname, b in t.buffers().items():
                assert digest(b.view(values[bname])) == want["buffers"][bname]["xxh3_64"], (n, bname)
            assert digest(t.dequantize(torch.float32)) == want["dequantized_float32_xxh3_64"], n


# --- driver ------------------------------------------------------------------------------------

def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name in CASES:
        files.extend(write_case(name, out_dir))
    return files


def _header(data: bytes) -> tuple[bytes, list[str]]:
    n = struct.unpack("<Q", data[:8])[0]
    raw = data[8:8 + n]
    return raw, list(json.loads(raw).get("__metadata__", {}))


def explain_difference(a: bytes, b: bytes, name: str) -> str:
    """Why two generations of one golden file differ (as far as can be told)."""
    if not name.endswith(".safetensors"):
        return "contents differ"
    try:
        (ha, ka), (hb, kb) = _header(a), _header(b)
    except Exception:  # noqa: BLE001
        return "contents differ (not parseable as safetensors)"
    if a[8 + len(ha):] != b[8 + len(hb):]:
        return "tensor bytes differ"
    if ka != kb and json.loads(ha) == json.loads(hb):
        return (f"only the order of the safetensors __metadata__ keys differs ({ka} vs {kb}): "
                "safetensors serializes __metadata__ from a Rust HashMap, whose order is random per "
                "process, and save_quantized writes two metadata keys in single-file mode")
    return "safetensors header differs"


def check(golden: Path) -> int:
    """Generate twice into temp dirs; compare the two with each other and with ``golden``."""
    problems = 0
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        for d in (d1, d2):
            # one process per generation, so per-process state (hash seeds, hash-map orders) differs
            # as between real reruns
            subprocess.run([sys.executable, __file__, "--out", d, "--force"], check=True,
                           stdout=subprocess.DEVNULL)
        names = sorted(p.name for p in Path(d1).iterdir())
        for n in names:
            a, b = (Path(d1) / n).read_bytes(), (Path(d2) / n).read_bytes()
            if a != b:
                problems += 1
                print(f"NOT DETERMINISTIC {n}: {explain_difference(a, b, n)}")
            g = golden / n
            if not g.exists():
                print(f"missing in {golden}: {n}")
                problems += 1
            elif g.read_bytes() != a:
                print(f"differs from {g}: {explain_difference(g.read_bytes(), a, n)}")
                problems += 1
    print("check:", "OK, byte-identical" if not problems else f"{problems} problem(s)")
    return 1 if problems else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR)
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    ap.add_argument("--check", action="store_true", help="regenerate twice in temp dirs and compare")
    args = ap.parse_args(argv)
    if args.check:
        return check(args.out)
    if not args.force:
        existing = [n for n in CASES for s in (".safetensors", ".expected.json") if (args.out / (n + s)).exists()]
        if existing:
            print(f"{args.out} already holds golden files ({', '.join(existing[:3])}, ...); they are the v1 "
                  "contract and are not regenerated without --force", file=sys.stderr)
            return 1
    files = generate(args.out)
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        print(f"{size:>8}  {f.relative_to(args.out.parent) if f.is_relative_to(args.out.parent) else f}")
    print(f"{total:>8}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
