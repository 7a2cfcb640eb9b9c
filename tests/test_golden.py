"""Golden checkpoints (schema/golden/): every te-serial must read format v1 exactly.

Each ``<name>.safetensors`` (or, for a directory checkpoint, ``<name>/``) was written once by
tools/make_golden.py, next to ``<name>.expected.json`` holding what a reader must get: per tensor
its prototype, each buffer's key, shape, dtype, xxh3_64 (and shard), the xxh3_64 of
``dequantize(torch.float32)``, and the tree with its plain values. Ten files are frozen at format
1.0, the later ones at 1.1 and 1.3 (:data:`GOLDENS`); every version must keep reading all of them. These
tests read the files through te-serial (``open``, ``load_quantized``, ``verify``) and,
independently, with plain ``safetensors`` + ``msgpack`` following schema/README.md. They never
regenerate anything: a failure here means a reader change broke v1 compatibility (or a golden file
was changed), not that the goldens need refreshing.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.checkpoint.manifest import format_checksum

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "schema" / "golden"
README = ROOT / "schema" / "README.md"

#: every golden checkpoint and the format version it was frozen at; removing one (or its record)
#: must fail CI
GOLDENS = {
    "fp8_delayed": (1, 0), "fp8_current_e4m3": (1, 0), "fp8_current_e5m2": (1, 0), "mxfp8_1x32": (1, 0),
    "mxfp8_2d": (1, 0), "fp8_blockwise_1d": (1, 0), "fp8_blockwise_2d": (1, 0), "nvfp4_1d": (1, 0),
    "nvfp4_2d": (1, 0), "mixed": (1, 0),
    "dir_two_shards": (1, 1), "tied_quantized": (1, 1), "nvfp4_rht_columnwise": (1, 1), "no_checksums": (1, 1),
    "extra_state_enum": (1, 1),
    "grouped_moe": (1, 3), "nvfp4_row_scaled": (1, 3), "nvfp4_4over6": (1, 3),
    "mxfp8_e8m0_edges": (1, 3), "dcp_two_ranks": (1, 3),
    "grouped_transposed": (1, 4),
    "mxfp4": (1, 5),
}
GOLDEN_NAMES = tuple(GOLDENS)
#: goldens in the directory layout (te_serial.msgpack + shards); the others are single files
DIRECTORY_GOLDENS = {"dir_two_shards", "dcp_two_ranks"}
#: goldens holding chunked tensors (format 1.2's tensors.chunks, schema/README.md §13)
CHUNKED_GOLDENS = {"dcp_two_ranks"}
#: the quantizer kinds and storage classes the goldens must cover between them
KINDS = {"fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_blockwise", "nvfp4", "mxfp4"}
MAX_GOLDEN_BYTES = 590_000  # format 1.3 added grouped_moe, nvfp4_row_scaled, nvfp4_4over6, mxfp8_e8m0_edges,
# dcp_two_ranks; 1.5 mxfp4 (30 KB)

HEADER_KEY = "te_serial.manifest"
MANIFEST_NAME = "te_serial.msgpack"
MANIFEST_CHECKSUM = "manifest_checksum"
TENSOR_EXT, TUPLE_EXT, TE_EXTRA_STATE_EXT = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class TEExtra:
    """A TE ``_extra_state`` (msgpack ext type 3; ``{"$te_extra_state": ...}`` in the records): the
    decoded state, tensors as ``("$tensor", name)`` markers."""

    state: dict


# --- helpers independent of te-serial ------------------------------------------------------------

def digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    data = b"" if flat.numel() == 0 else flat.view(torch.uint8).numpy().tobytes()
    return "xxh3_64:" + xxhash.xxh3_64(data).hexdigest()


def digest_values(t: torch.Tensor) -> str:
    """``dequantized_float32_xxh3_64`` (schema/README.md §11): the fp32 values' little-endian bytes in C
    order, each NaN as 0x7FC00000 (a NaN's sign and payload are not part of the format)."""
    v = t.detach().to(torch.float32).contiguous()
    bits = torch.where(torch.isnan(v), torch.tensor(0x7FC00000, dtype=torch.int32), v.view(torch.int32))
    return digest(bits)


#: schema/README.md §13: (rows, columns) of one block of each block-scale buffer, whether stored
#: transposed; key (kind, block_scaling_dim or None, buffer)
SCALE_GRIDS = {
    ("mxfp8", None, "_rowwise_scale_inv"): (1, 32, False), ("mxfp8", None, "_columnwise_scale_inv"): (32, 1, False),
    ("fp8_blockwise", 1, "_rowwise_scale_inv"): (1, 128, True),
    ("fp8_blockwise", 1, "_columnwise_scale_inv"): (128, 1, False),
    ("fp8_blockwise", 2, "_rowwise_scale_inv"): (128, 128, False),
    ("fp8_blockwise", 2, "_columnwise_scale_inv"): (128, 128, True),
    ("nvfp4", None, "_rowwise_scale_inv"): (1, 16, False), ("nvfp4", None, "_columnwise_scale_inv"): (16, 1, True),
    ("mxfp4", None, "_rowwise_scale_inv"): (1, 32, False), ("mxfp4", None, "_columnwise_scale_inv"): (32, 1, True),
}


def spec_region_view(shape: list, q: dict | None, bname: str, stored: list) -> list:
    """A buffer's region view R, from schema/README.md §13's table alone (no te-serial)."""
    if q is None or q["kind"] == "grouped":
        return list(stored)
    kind, m, k = q["kind"], math.prod(shape[:-1]), shape[-1]
    p = 2 if kind in ("nvfp4", "mxfp4") else 1
    if bname in ("_data", "_rowwise_data") or (kind == "mxfp8" and bname == "_columnwise_data"):
        return [m, k // p]
    if bname in ("_transpose", "_columnwise_data"):
        return [k, m // p]
    if bname == "_amax_rowwise" and q.get("row_scaled_nvfp4"):
        return [m]
    grid = SCALE_GRIDS.get((kind, q.get("block_scaling_dim"), bname))
    if grid is None:
        return list(stored)
    r, c, transposed = grid
    cells = [-(-m // r), -(-k // c)]
    return cells[::-1] if transposed else cells


def decode_value(v):
    """Inverse of make_golden.encode_value, with tensors left as ``("$tensor", name)`` markers."""
    if isinstance(v, dict):
        (tag, x), = v.items()
        if tag == "$tensor":
            return ("$tensor", x)
        if tag == "$dict":
            return {k: decode_value(y) for k, y in x}
        if tag == "$tuple":
            return tuple(decode_value(y) for y in x)
        if tag == "$float":
            return float.fromhex(x)
        if tag == "$bytes":
            return bytes.fromhex(x)
        if tag == "$te_extra_state":
            return TEExtra(decode_value(x))
        raise AssertionError(f"unknown tag {tag}")
    if isinstance(v, list):
        return [decode_value(y) for y in v]
    return v


def assert_same_tree(got, want, tensors: dict, path: str = "<root>") -> None:
    """``got`` (a loaded object) has ``want``'s structure, types and values exactly; tensor
    markers must be the very objects ``tensors[name]``."""
    if isinstance(want, tuple) and len(want) == 2 and want[0] == "$tensor" and isinstance(want[1], str):
        assert got is tensors[want[1]], f"{path}: not the tensor {want[1]!r}"
        return
    if isinstance(want, TEExtra):  # see _decode_extra_states: the loaded value, decoded
        assert type(got) is dict, f"{path}: a TE extra state, got {type(got).__name__}"
        assert_same_tree(got, want.state, tensors, path)
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        assert [type(k) for k in got] == [type(k) for k in want], f"{path}: key types differ"
        for k in want:
            assert_same_tree(got[k], want[k], tensors, f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, tensors, f"{path}.{i}")
    elif isinstance(want, float):
        assert math.copysign(1, got) == math.copysign(1, want) and (got == want or got != got and want != want), \
            f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def record(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.expected.json").read_text(encoding="utf-8"))


def golden(name: str) -> Path:
    """The checkpoint: ``<name>/`` for a directory golden, else ``<name>.safetensors``."""
    return GOLDEN / name if name in DIRECTORY_GOLDENS else GOLDEN / f"{name}.safetensors"


def has_checksums(rec: dict) -> bool:
    return rec.get("checksums", True)  # 1.0 records: always saved with checksums


def buffer_files(name: str) -> list[Path]:
    """The safetensors files of a golden, in file-index order."""
    if name in DIRECTORY_GOLDENS:
        return [golden(name) / s for s in record(name)["shards"]]
    return [golden(name)]


def as_recorded(q: tsf.Quantizer, recorded: dict) -> bool:
    """``q`` has the recorded fields, and the fields added by later versions (format 1.3's NVFP4
    variant fields) at their defaults: what ``from_dict`` of the record gives."""
    got = q.to_dict()
    return {k: got.get(k) for k in recorded} == recorded and q == tsf.Quantizer.from_dict(recorded)


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# --- the files are there and unchanged -----------------------------------------------------------

def test_golden_files_exist():
    assert GOLDEN.is_dir(), f"{GOLDEN} is missing: golden checkpoints must never be deleted"
    for name in GOLDEN_NAMES:
        if name in DIRECTORY_GOLDENS:
            assert (golden(name) / MANIFEST_NAME).is_file(), f"golden checkpoint {golden(name)} is missing"
        else:
            assert golden(name).is_file(), f"golden checkpoint {golden(name)} is missing"
        assert (GOLDEN / f"{name}.expected.json").is_file(), f"expected record of {name} is missing"
    found = {p.name.removesuffix(".safetensors") for p in GOLDEN.glob("*.safetensors")}
    found |= {p.name for p in GOLDEN.iterdir() if p.is_dir()}
    recorded = {p.name.removesuffix(".expected.json") for p in GOLDEN.glob("*.expected.json")}
    assert found == recorded, f"golden files without a record or records without a file: {found ^ recorded}"
    assert found >= set(GOLDEN_NAMES)
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert total <= MAX_GOLDEN_BYTES, f"schema/golden is {total} bytes; keep it small"


def test_records_match_the_golden_list():
    for name, version in GOLDENS.items():
        rec = record(name)
        assert rec["name"] == name and tuple(rec["version"]) == version, name
        assert rec.get("layout", "file") == ("directory" if name in DIRECTORY_GOLDENS else "file"), name
        assert rec["file"] == golden(name).name, name
    # every format version so far has golden files
    assert {v for v in GOLDENS.values()} == {(1, 0), (1, 1), (1, 3), (1, 4), (1, 5)}


def test_goldens_cover_every_format():
    kinds, storages, usages = set(), set(), set()
    for name in GOLDEN_NAMES:
        for t in record(name)["tensors"].values():
            q = t["quantizer"]
            if q is not None:
                kinds.add(q["kind"])
                storages.add(t["storage"])
                usages.add((q["kind"], q["rowwise"], q["columnwise"]))
    assert kinds == KINDS | {"grouped"}  # grouped (MoE) tensors: format 1.3's grouped_moe
    assert storages == {"Float8Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor", "GroupedTensor",
                        "MXFP4Tensor"}
    for kind in KINDS:  # both usages, rowwise only and columnwise only, for every format
        assert {(kind, True, True), (kind, True, False), (kind, False, True)} <= usages, kind


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_file_unchanged(name):
    rec = record(name)
    if name in DIRECTORY_GOLDENS:  # the manifest and every shard, and nothing else
        assert _files_under(golden(name)) == {f["name"] for f in rec["files"]}, \
            f"{golden(name)} gained or lost files; golden files are immutable"
        assert [f["name"] for f in rec["files"]] == [MANIFEST_NAME, *rec["shards"]]
        for f in rec["files"]:
            data = (golden(name) / f["name"]).read_bytes()
            assert len(data) == f["bytes"], f["name"]
            assert "xxh3_64:" + xxhash.xxh3_64(data).hexdigest() == f["xxh3_64"], \
                f"{golden(name) / f['name']} was modified; golden files are immutable"
        return
    data = golden(name).read_bytes()
    assert len(data) == rec["file_bytes"]
    assert "xxh3_64:" + xxhash.xxh3_64(data).hexdigest() == rec["file_xxh3_64"], \
        f"{golden(name)} was modified; golden files are immutable"


def raw_manifest_bytes(path: Path) -> bytes:
    """The manifest's msgpack bytes (schema/README.md §1), without te-serial."""
    if path.is_dir():
        return (path / MANIFEST_NAME).read_bytes()
    with safe_open(str(path), framework="pt") as f:
        return base64.b64decode(f.metadata()[HEADER_KEY], validate=True)


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_manifest_checksum(name):
    """Format 1.1 manifests end with ``manifest_checksum``: a uint64 (msgpack 0xcf, big-endian)
    equal to XXH3-64 of every manifest byte before it. 1.0 manifests have none."""
    from te_serial.checkpoint.manifest import sealed
    rec = record(name)
    raw = raw_manifest_bytes(golden(name))
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    if GOLDENS[name] < (1, 1):
        assert MANIFEST_CHECKSUM not in doc and MANIFEST_CHECKSUM not in rec
        assert sealed(raw) is None
        return
    trailer = msgpack.packb(MANIFEST_CHECKSUM) + b"\xcf"
    assert raw[-8 - len(trailer):-8] == trailer, "the manifest's last field is not its uint64 checksum"
    value = int.from_bytes(raw[-8:], "big")
    assert value == xxhash.xxh3_64_intdigest(raw[:-8])
    assert list(doc)[-1] == MANIFEST_CHECKSUM and doc[MANIFEST_CHECKSUM] == value
    assert rec["manifest_checksum"] == f"xxh3_64:{value:016x}"
    assert sealed(raw) is True


# --- through te-serial ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_manifest_as_recorded(name):
    rec = record(name)
    with ts.open(golden(name)) as ckpt:
        m = ckpt.manifest
        assert tuple(m.version) == tuple(rec["version"]) == GOLDENS[name]
        assert dict(m.producer) == rec["producer"]
        if name in DIRECTORY_GOLDENS:
            assert m.files == {f["name"]: f["bytes"] for f in rec["files"][1:]}
            assert list(m.files) == rec["shards"]
        else:
            assert m.files == {}
        assert ckpt.metadata == rec["metadata"]
        assert ckpt.keys() == list(rec["tensors"])
        protos = ckpt.protos
        for tname, want in rec["tensors"].items():
            p = protos[tname]
            assert list(p.shape) == want["shape"], tname
            assert p.dtype == getattr(torch, want["dtype"]), tname
            assert p.requires_grad == want["requires_grad"], tname
            if want["quantizer"] is None:
                assert p.quantizer is None, tname
            else:
                assert as_recorded(p.quantizer, want["quantizer"]), tname
                assert type(p.quantizer) is tsf.resolve_quantizer(want["quantizer"]["kind"])
                assert p.quantizer.tensor_class.__name__ == want["storage"], tname
            entry = m.tensors[tname]
            assert list(entry.buffers) == list(want["buffers"]), tname
            chunked = {b: (view, pcs) for b, view, _, pcs in m.pieces(tname)} if m.is_chunked(tname) else {}
            assert set(chunked) == {b for b, wb in want["buffers"].items() if "pieces" in wb}, tname
            for bname, wb in want["buffers"].items():
                b = entry.buffers[bname]
                assert b.key == wb["key"], (tname, bname)
                assert list(b.shape) == wb["shape"], (tname, bname)
                assert b.dtype == getattr(torch, wb["dtype"]), (tname, bname)
                if bname in chunked:  # format 1.2: the pieces, as recorded
                    view, pcs = chunked[bname]
                    assert list(view) == wb["region"], (tname, bname)
                    assert [(f, k, list(o), list(z), format_checksum(c)) for f, k, o, z, c in pcs] == \
                        [(pc["file"], pc["key"], pc["offsets"], pc["sizes"], pc["xxh3_64"]) for pc in wb["pieces"]]
                    continue
                if name in DIRECTORY_GOLDENS:
                    assert b.file == wb["file"], (tname, bname)
                if not has_checksums(rec):
                    assert b.checksum is None, (tname, bname)
                    continue
                assert b.checksum is not None, (tname, bname)
                cs = b.checksum if isinstance(b.checksum, str) else f"xxh3_64:{b.checksum:016x}"
                assert cs == wb["xxh3_64"], (tname, bname)


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_tensors_as_recorded(name):
    rec = record(name)
    with ts.open(golden(name)) as ckpt:
        loaded = ckpt.load_tensors(verify=has_checksums(rec))
    assert list(loaded) == list(rec["tensors"])
    for tname, want in rec["tensors"].items():
        t = loaded[tname]
        assert list(t.shape) == want["shape"], tname
        assert t.dtype == getattr(torch, want["dtype"]), tname
        assert t.requires_grad == want["requires_grad"], tname
        if want["quantizer"] is None:
            assert type(t) in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, tsf.QuantizedTensor)
            assert digest(t) == want["buffers"]["data"]["xxh3_64"], tname
            continue
        assert type(t).__name__ == want["storage"], tname
        assert as_recorded(t.quantizer, want["quantizer"]), tname
        values = t.quantizer.value_dtypes()
        bufs = t.buffers()
        assert list(bufs) == list(want["buffers"]), tname
        for bname, wb in want["buffers"].items():
            stored = bufs[bname].view(values[bname])
            assert list(stored.shape) == wb["shape"] and stored.dtype == getattr(torch, wb["dtype"]), (tname, bname)
            assert digest(stored) == wb["xxh3_64"], f"{tname}.{bname}: bytes differ"
        dq = t.dequantize(torch.float32)
        assert dq.dtype == torch.float32 and list(dq.shape) == want["shape"]
        assert digest_values(dq) == want["dequantized_float32_xxh3_64"], f"{tname}: dequantized values differ"


def _leaves_of(obj, want) -> dict:
    """flat name → the object found in ``obj`` where ``want`` has that tensor's marker."""
    out = {}

    def walk(w, g):
        if isinstance(w, tuple) and len(w) == 2 and w[0] == "$tensor" and isinstance(w[1], str):
            out[w[1]] = g
        elif isinstance(w, TEExtra):
            walk(w.state, g)
        elif isinstance(w, dict) and isinstance(g, dict):
            for k in w:
                if k in g:
                    walk(w[k], g[k])
        elif isinstance(w, (list, tuple)) and isinstance(g, (list, tuple)):
            for x, y in zip(w, g):
                walk(x, y)

    walk(want, obj)
    return out


def _decode_extra_states(obj, want):
    """``obj`` with the value loaded at each TE extra state's place (``TEExtra`` in ``want``) as its
    decoded state. With TE importable, te-serial loads TE's own bytes (a uint8 tensor), decoded
    here by te-serial's restricted decoder (nothing is unpickled); without TE it returns the
    decoded dict itself."""
    from te_serial.te.extra_state import decode_te_extra_state
    if isinstance(want, TEExtra):
        if isinstance(obj, torch.Tensor):
            assert obj.dtype == torch.uint8 and obj.dim() == 1
            obj = decode_te_extra_state(obj)
        return _decode_extra_states(obj, want.state)
    if isinstance(want, dict) and isinstance(obj, dict):
        return {k: _decode_extra_states(v, want[k]) if k in want else v for k, v in obj.items()}
    if isinstance(want, (list, tuple)) and isinstance(obj, (list, tuple)) and len(want) == len(obj):
        return type(obj)(_decode_extra_states(v, w) for v, w in zip(obj, want))
    return obj


def _load_tree(name: str, want):
    rec = record(name)
    with warnings.catch_warnings():  # without TE, extra states come back decoded, with a warning
        warnings.filterwarnings("ignore", message=r"te-serial: TE extra state .*returned decoded")
        obj = ts.load_quantized(golden(name), verify=has_checksums(rec))
    return _decode_extra_states(obj, want)


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_tree_as_recorded(name):
    """load_quantized gives back the saved structure: keys (and their types) in order, tuples as
    tuples, every plain value exactly, and the recorded tensor at each tensor's place."""
    rec = record(name)
    want = decode_value(rec["tree"])
    obj = _load_tree(name, want)
    leaves = _leaves_of(obj, want)
    assert set(leaves) == set(rec["tensors"])
    for n, t in leaves.items():
        w = rec["tensors"][n]
        assert isinstance(t, torch.Tensor), n
        if w["quantizer"] is None:
            assert digest(t) == w["buffers"]["data"]["xxh3_64"], n
        else:
            assert digest_values(t.dequantize(torch.float32)) == w["dequantized_float32_xxh3_64"], n
    assert_same_tree(obj, want, leaves)


def test_tied_tensors_come_back_as_one():
    obj = ts.load_quantized(golden("mixed"))
    assert obj["emb"]["weight"] is obj["head"]["weight"]
    rec = record("mixed")["tensors"]
    assert rec["head.weight"]["buffers"]["data"]["key"] == "emb.weight"


def test_tied_quantized_tensors_come_back_as_one():
    """A quantized tensor under two names is stored once (the second row an alias using the
    first's keys) and loads as one object, a Parameter still; an equal-prototype tensor that is
    not tied stays separate."""
    rec = record("tied_quantized")["tensors"]
    for alias, first in (("lm_head.weight", "embed.weight"), ("layers.1.proj", "layers.0.proj"),
                         ("pos_out.weight", "pos.weight")):
        assert rec[alias]["buffers"] == rec[first]["buffers"], alias
        assert all(b["key"].startswith(first) for b in rec[alias]["buffers"].values()), alias
    assert rec["embed.weight"]["quantizer"]["kind"] == "mxfp8" and rec["layers.0.proj"]["quantizer"]["kind"] == "nvfp4"
    doc = msgpack.unpackb(raw_manifest_bytes(golden("tied_quantized")), ext_hook=_ext_hook, raw=False,
                          strict_map_key=False)
    names = doc["tensors"]["names"]
    assert sorted((names[i], names[j]) for i, j in doc["tensors"]["aliases"]) == \
        [("layers.1.proj", "layers.0.proj"), ("lm_head.weight", "embed.weight"), ("pos_out.weight", "pos.weight")]
    obj = ts.load_quantized(golden("tied_quantized"), verify=True)
    assert obj["lm_head"]["weight"] is obj["embed"]["weight"]
    assert obj["embed"]["weight"].requires_grad  # saved from a Parameter
    assert isinstance(obj["embed"]["weight"], tsf.MXFP8Tensor)
    assert obj["layers"][1]["proj"] is obj["layers"][0]["proj"]
    assert isinstance(obj["layers"][0]["proj"], tsf.NVFP4Tensor)
    assert obj["pos_out"]["weight"] is obj["pos"]["weight"]
    other = obj["layers"][0]["other"]
    assert other is not obj["embed"]["weight"]
    assert ts.to_tensor_proto(other).shape == ts.to_tensor_proto(obj["embed"]["weight"]).shape
    with ts.open(golden("tied_quantized")) as ckpt:  # the lazy handle ties them too
        assert ckpt.get("lm_head.weight") is not None


@pytest.mark.parametrize("name", [n for n in GOLDEN_NAMES if n != "no_checksums"])  # see test_no_checksums
def test_verify_passes(name):
    rec = record(name)
    assert has_checksums(rec), name
    distinct = {b["key"] for t in rec["tensors"].values() for b in t["buffers"].values()}
    checked = ts.verify(golden(name))
    assert checked >= len(distinct)


def test_no_checksums():
    """Saved with checksums=False: tensors.checksums is nil; the checkpoint loads exactly, and
    verify (or verify=True) says there is nothing to check against (ChecksumError), not that it
    passed."""
    rec = record("no_checksums")
    assert rec["checksums"] is False
    doc = msgpack.unpackb(raw_manifest_bytes(golden("no_checksums")), ext_hook=_ext_hook, raw=False,
                          strict_map_key=False)
    assert "checksums" in doc["tensors"] and doc["tensors"]["checksums"] is None
    obj = ts.load_quantized(golden("no_checksums"))
    assert obj["step"] == 7
    assert digest_values(obj["weight"].dequantize(torch.float32)) == \
        rec["tensors"]["weight"]["dequantized_float32_xxh3_64"]
    with pytest.raises(tse.ChecksumError, match="saved without checksums"):
        ts.verify(golden("no_checksums"))
    with pytest.raises(tse.ChecksumError, match="saved without checksums"):
        ts.load_quantized(golden("no_checksums"), verify=True)


def test_dir_two_shards_splits_one_tensor():
    """The directory golden has two shards, each within its max_shard_size, and one quantized
    tensor (NVFP4) whose rowwise buffers are in the first and the rest in the second."""
    rec = record("dir_two_shards")
    shards = rec["shards"]
    assert len(shards) == 2 and all(re.fullmatch(r"model-0123abcd-\d{5}-of-00002\.safetensors", s) for s in shards)
    limit = int(re.search(r"max_shard_size=(\d+)", rec["description"]).group(1))
    split = {n for n, t in rec["tensors"].items() if len({b["file"] for b in t["buffers"].values()}) > 1}
    assert split == {"layers.0.weight"}
    files = {b: w["file"] for b, w in rec["tensors"]["layers.0.weight"]["buffers"].items()}
    assert files == {"_rowwise_data": shards[0], "_rowwise_scale_inv": shards[0], "_columnwise_data": shards[1],
                     "_columnwise_scale_inv": shards[1], "_amax_rowwise": shards[1], "_amax_columnwise": shards[1]}
    with ts.open(golden("dir_two_shards")) as ckpt:  # te-serial sees the same split
        assert {b: e.file for b, e in ckpt.manifest.tensors["layers.0.weight"].buffers.items()} == files
    for i, shard in enumerate(shards):  # and so does any safetensors reader
        raw = (golden("dir_two_shards") / shard).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__")
        assert meta == {"format": "pt"}
        data = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
        assert data <= limit, (shard, data)
        assert {k for k in header if k.startswith("layers.0.weight.")} == \
            {f"layers.0.weight.{b}" for b, f in files.items() if f == shard}
    t = ts.load_quantized(golden("dir_two_shards"), verify=True)["layers"][0]["weight"]
    assert digest_values(t.dequantize(torch.float32)) == \
        rec["tensors"]["layers.0.weight"]["dequantized_float32_xxh3_64"]


def test_extra_state_enum_tree():
    """The TE _extra_state is msgpack ext type 3 whose payload decodes to the recorded state: the
    recipe as plain data with its enum field as {"__enum__": "Format", "name": "E4M3"}, the scales
    and amax histories as tensor references (ext type 1), the extra variables as plain values."""
    doc = msgpack.unpackb(raw_manifest_bytes(golden("extra_state_enum")), ext_hook=_ext_hook, raw=False,
                          strict_map_key=False)
    extra = doc["tree"]["fc1._extra_state"]
    assert isinstance(extra, TEExtra)
    recipe = extra.state["recipe"]
    assert recipe["__class__"] == "DelayedScaling"
    assert recipe["fields"]["fp8_format"] == {"__enum__": "Format", "name": "E4M3"}
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert extra.state[k] == ("$tensor", f"fc1._extra_state.{k}")
    assert extra.state["extra_fp8_variables"]["fp8_group_sizes"] == (1, 2)
    assert doc["tree"]["fc2._extra_state"] == ("$tensor", "fc2._extra_state")  # stateless: a plain empty tensor
    assert record("extra_state_enum")["tensors"]["fc2._extra_state"]["shape"] == [0]
    assert extra == decode_value(record("extra_state_enum")["tree"])["fc1._extra_state"]


def test_extra_state_enum_loads_as_te_bytes():
    """With TE importable (on CPU through tests/te_shim.py), the extra state comes back as TE's own
    ``_extra_state`` bytes, and they hold the recorded recipe (enum member included) and tensors."""
    import te_shim
    if te_shim.install() is None:
        pytest.skip("transformer-engine wheel not installed")
    from te_serial.te.extra_state import decode_te_extra_state
    rec = record("extra_state_enum")
    obj = ts.load_quantized(golden("extra_state_enum"), verify=True)
    payload = obj["fc1._extra_state"]
    assert isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8 and payload.dim() == 1
    state = decode_te_extra_state(payload)
    want = decode_value(rec["tree"])["fc1._extra_state"].state
    assert state["recipe"] == want["recipe"]
    assert state["extra_fp8_variables"] == want["extra_fp8_variables"]
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert digest(state[k]) == rec["tensors"][f"fc1._extra_state.{k}"]["buffers"]["data"]["xxh3_64"], k


def test_extra_state_enum_loads_decoded_without_te(monkeypatch):
    """Where TE is not importable, the decoded state comes back (with a warning), holding the
    loaded tensors themselves."""
    import sys
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", None)  # TE not importable
    rec = record("extra_state_enum")
    want = decode_value(rec["tree"])
    with pytest.warns(UserWarning, match="returned decoded"):
        obj = ts.load_quantized(golden("extra_state_enum"), verify=True)
    state = obj["fc1._extra_state"]
    assert isinstance(state, dict)
    assert_same_tree(obj, want, _leaves_of(obj, want))
    assert state["recipe"]["fields"]["fp8_format"] == {"__enum__": "Format", "name": "E4M3"}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_meta_device_protos(name):
    """Prototypes alone (no buffer read) rebuild every tensor's shape, dtype and buffer layout."""
    rec = record(name)
    for tname, p in ts.read_protos(golden(name)).items():
        want = rec["tensors"][tname]
        t = p.create_tensor(device="meta")
        assert list(t.shape) == want["shape"] and t.dtype == getattr(torch, want["dtype"])
        if p.quantizer is not None:
            specs = p.buffer_specs()
            assert list(specs) == list(want["buffers"])
            for bname, wb in want["buffers"].items():
                assert list(specs[bname].shape) == wb["shape"]


# --- without te-serial: plain safetensors + msgpack, as schema/README.md describes ----------------

def _ext_hook(code, data):
    if code == TENSOR_EXT:
        return ("$tensor", data.decode("utf-8"))
    if code == TUPLE_EXT:
        return tuple(msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False))
    if code == TE_EXTRA_STATE_EXT:
        return TEExtra(msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False))
    raise ValueError(f"unknown ext type {code}")


def raw_manifest(path: Path) -> dict:
    return msgpack.unpackb(raw_manifest_bytes(path), ext_hook=_ext_hook, raw=False, strict_map_key=False)


def raw_buffers(doc: dict) -> dict[str, dict[str, dict]]:
    """tensor name → buffer name → {key, shape, dtype, checksum, file} from the manifest's columns;
    a chunked tensor's buffers (format 1.2) have ``view`` (the region view, §13) and ``pieces``
    [(key, offsets, sizes, file, checksum)] instead of ``file`` and ``checksum``."""
    cols = doc["tensors"]
    aliases = {a: b for a, b in cols.get("aliases", [])}
    chunks = cols.get("chunks") or [None] * len(cols["names"])
    out = {}
    for i, tname in enumerate(cols["names"]):
        proto = doc["protos"][cols["protos"][i]]
        q = doc["quantizers"][proto["quantizer"]] if proto["quantizer"] is not None else None
        src = aliases.get(i, i)
        bufs = {}
        for j, b in enumerate(proto["buffers"]):
            key = cols["names"][src] if b["name"] == "data" else f"{cols['names'][src]}.{b['name']}"
            entry = {"key": key, "shape": b["shape"], "dtype": b["dtype"]}
            c = chunks[i]
            if c is not None:
                sums = c["checksums"][j] if c["checksums"] is not None else [None] * len(c["files"][j])
                entry["view"] = spec_region_view(proto["shape"], q, b["name"], b["shape"])
                entry["pieces"] = [(f"{key}@{n}", o, z, f, cs) for n, (o, z, f, cs)
                                   in enumerate(zip(c["offsets"][j], c["sizes"][j], c["files"][j], sums))]
            else:
                entry["checksum"] = cols["checksums"][src][j] if cols.get("checksums") is not None else None
                entry["file"] = cols["files"][src][j]
            bufs[b["name"]] = entry
        out[tname] = bufs
    return out


def assemble(b: dict, sts: list) -> torch.Tensor:
    """A chunked buffer from its pieces (§13): zero bytes of its shape, viewed as its region view R (a
    reshape, or the top-left corner of a padded scale), each piece copied into its box."""
    dtype = getattr(torch, b["dtype"])
    view = b["view"]
    out = torch.zeros(math.prod(b["shape"]) * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(b["shape"])
    full = view if math.prod(view) == math.prod(b["shape"]) else b["shape"]
    region = out.reshape(full)[tuple(slice(0, v) for v in view)]
    for key, offsets, sizes, f, _ in b["pieces"]:
        piece = sts[f][key]
        assert piece.dtype == dtype and list(piece.shape) == sizes, key
        region[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))] = piece
    return out


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_raw_read_without_te_serial(name):
    rec = record(name)
    doc = raw_manifest(golden(name))
    assert doc["format"] == "te-serial" and doc["version"] == rec["version"]
    if name in DIRECTORY_GOLDENS:
        assert doc["files"] == [{"name": f["name"], "size": f["bytes"]} for f in rec["files"][1:]]
    else:
        assert doc["files"] == [], "a single-file checkpoint lists no other files"
    assert doc["producer"] == rec["producer"] and doc["metadata"] == rec["metadata"]
    raw = raw_buffers(doc)
    assert list(raw) == list(rec["tensors"])
    paths = buffer_files(name)
    sts = [load_file(str(p)) for p in paths]
    used = set()
    for tname, want in rec["tensors"].items():
        proto = doc["protos"][doc["tensors"]["protos"][doc["tensors"]["names"].index(tname)]]
        assert proto["shape"] == want["shape"] and proto["dtype"] == want["dtype"]
        assert proto["requires_grad"] == want["requires_grad"]
        q = proto["quantizer"]
        assert (doc["quantizers"][q] if q is not None else None) == want["quantizer"]
        assert proto.get("storage") == want["storage"]
        assert proto.get("scale_layout") == want["scale_layout"]
        for bname, wb in want["buffers"].items():
            b = raw[tname][bname]
            assert b["key"] == wb["key"] and b["shape"] == wb["shape"] and b["dtype"] == wb["dtype"]
            if "pieces" in b:  # format 1.2: assembled from its pieces by §13's region view
                assert b["view"] == wb["region"], (tname, bname)
                assert [(k, o, z, doc["files"][f]["name"], f"xxh3_64:{c:016x}") for k, o, z, f, c in b["pieces"]] \
                    == [(pc["key"], pc["offsets"], pc["sizes"], pc["file"], pc["xxh3_64"]) for pc in wb["pieces"]]
                for (k, _, _, f, _), pc in zip(b["pieces"], wb["pieces"]):
                    assert digest(sts[f][k]) == pc["xxh3_64"], k
                    used.add((f, k))
                assert digest(assemble(b, sts)) == wb["xxh3_64"], (tname, bname)
                continue
            if name in DIRECTORY_GOLDENS:
                assert doc["files"][b["file"]]["name"] == wb["file"], (tname, bname)
            else:
                assert b["file"] == 0
            if has_checksums(rec):
                assert f"xxh3_64:{b['checksum']:016x}" == wb["xxh3_64"]
            else:
                assert b["checksum"] is None
            t = sts[b["file"]][b["key"]]
            assert t.dtype == getattr(torch, wb["dtype"]) and list(t.shape) == wb["shape"]
            assert digest(t) == wb["xxh3_64"], (tname, bname)
            used.add((b["file"], b["key"]))
        if want["buffers"] and all(b["key"] == (tname if n == "data" else f"{tname}.{n}")
                                   for n, b in want["buffers"].items()):
            continue
        assert "aliases" in doc["tensors"], f"{tname} uses another tensor's keys but is no alias"
    assert used == {(i, k) for i, st in enumerate(sts) for k in st}, "a file holds keys no tensor uses"
    if "tree" not in doc:  # the implied tree: a flat dict of every tensor under its own name
        assert decode_value(rec["tree"]) == {n: ("$tensor", n) for n in rec["tensors"]}
    else:
        assert doc["tree"] == decode_value(rec["tree"])


def test_safetensors_dtypes_on_disk():
    """Generic tools see the true dtypes (README table)."""
    codes = {}
    for name in GOLDEN_NAMES:
        header = {}
        for path in buffer_files(name):
            raw = path.read_bytes()
            n = int.from_bytes(raw[:8], "little")
            header.update(json.loads(raw[8:8 + n]))
        for tname, want in record(name)["tensors"].items():
            if want["quantizer"] is None:
                continue
            kind = want["quantizer"]["kind"]
            for bname, wb in want["buffers"].items():
                for key in [pc["key"] for pc in wb["pieces"]] if "pieces" in wb else [wb["key"]]:
                    assert header[key]["dtype"] == wb["safetensors_dtype"], key
                codes.setdefault((kind, bname), set()).add(wb["safetensors_dtype"])
    assert codes[("mxfp8", "_rowwise_scale_inv")] == {"F8_E8M0"}
    assert codes[("mxfp8", "_rowwise_data")] == {"F8_E4M3", "F8_E5M2"}
    assert codes[("fp8_blockwise", "_rowwise_scale_inv")] == {"F32"}
    assert codes[("nvfp4", "_rowwise_data")] == {"U8"}
    assert codes[("nvfp4", "_columnwise_scale_inv")] == {"F8_E4M3"}
    assert codes[("nvfp4", "_amax_rowwise")] == {"F32"}
    assert codes[("fp8_delayed_scaling", "_transpose")] == {"F8_E4M3", "F8_E5M2"}  # E5M2: dcp_two_ranks
    assert codes[("fp8_current_scaling", "_data")] == {"F8_E4M3", "F8_E5M2"}


def _readme_example() -> dict:
    """The README's python blocks (§12's reader, §13's chunk assembly and region views), run together."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert any("def read_checkpoint" in b for b in blocks), "schema/README.md lost its python example"
    assert any("def region_view" in b for b in blocks), "schema/README.md lost its region-view example"
    ns: dict = {"__name__": "readme_example"}
    exec(compile("\n\n".join(blocks), str(README), "exec"), ns)  # noqa: S102 - our own documentation
    return ns


def _check_readme_reader(ns: dict, path: Path, rec: dict) -> None:
    tensors = ns["read_checkpoint"](path)
    assert list(tensors) == list(rec["tensors"])
    for tname, want in rec["tensors"].items():
        t = tensors[tname]
        assert t["shape"] == want["shape"] and t["dtype"] == want["dtype"] and t["quantizer"] == want["quantizer"]
        assert {n: digest(b) for n, b in t["buffers"].items()} == \
            {n: wb["xxh3_64"] for n, wb in want["buffers"].items()}, tname
        if want["quantizer"] is not None and want["quantizer"]["kind"] == "mxfp8":
            assert digest_values(ns["dequantize_mxfp8"](t)) == want["dequantized_float32_xxh3_64"], tname


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_readme_example_reads_goldens(name):
    """The README's reader (plain safetensors + msgpack) finds every buffer, and its hand-written
    MXFP8 dequantization gives te-serial's fp32 bytes exactly."""
    _check_readme_reader(_readme_example(), golden(name), record(name))


def test_readme_example_reads_directory_layout(tmp_path):
    """The same reader on the directory layout: a golden checkpoint re-saved as several shards."""
    name = "mxfp8_1x32"
    ckpt = tmp_path / "ckpt"
    ts.save_quantized(ts.load_quantized(golden(name)), ckpt, max_shard_size=10_000)
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(shards) > 1 and all(re.fullmatch(r"model-[0-9a-f]{8}-\d{5}-of-\d{5}\.safetensors", s)
                                   for s in shards), shards
    assert (ckpt / "te_serial.msgpack").is_file()
    _check_readme_reader(_readme_example(), ckpt, record(name))


# --- versioning rules, on copies of a golden file ------------------------------------------------

def _rewrite(src: Path, dst: Path, edit) -> Path:
    from te_serial.checkpoint.manifest import seal
    """Copy a single-file checkpoint with its manifest changed by ``edit(doc)`` (ext types kept)."""
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    doc = msgpack.unpackb(base64.b64decode(meta[HEADER_KEY]), raw=False, strict_map_key=False)
    edit(doc)
    meta[HEADER_KEY] = base64.b64encode(seal(doc)).decode("ascii")  # a 1.1+ manifest ends with its checksum
    save_file(load_file(str(src)), str(dst), metadata=meta)
    return dst


def test_newer_major_version_is_refused(tmp_path):
    path = _rewrite(golden("mxfp8_1x32"), tmp_path / "v2.safetensors",
                    lambda d: d.__setitem__("version", [2, 0]))
    with pytest.raises(tse.VersionError, match=r"2\.0.*newer"):
        ts.load_quantized(path)


def test_newer_minor_version_with_unknown_optional_fields_loads(tmp_path):
    def edit(doc):
        doc["version"] = [1, 7]
        doc["future_top_level"] = {"anything": [1, 2, 3]}
        doc["protos"][0]["future_proto_field"] = "ignored"
        doc["protos"][0]["buffers"][0]["future_buffer_field"] = 1
        doc["tensors"]["future_column"] = [None] * len(doc["tensors"]["names"])
        doc["producer"]["future_tool"] = "x"

    name = "mxfp8_1x32"
    path = _rewrite(golden(name), tmp_path / "v1_7.safetensors", edit)
    rec = record(name)
    with ts.open(path) as ckpt:
        loaded = ckpt.load_tensors(verify=True)
    for tname, want in rec["tensors"].items():
        t = loaded[tname]
        if want["quantizer"] is not None:
            assert digest_values(t.dequantize(torch.float32)) == want["dequantized_float32_xxh3_64"]


def test_golden_copy_reads_the_same(tmp_path):
    """A golden file moved elsewhere (another name, another directory) reads the same."""
    dst = tmp_path / "sub" / "renamed.safetensors"
    dst.parent.mkdir()
    shutil.copy(golden("nvfp4_1d"), dst)
    rec = record("nvfp4_1d")
    loaded = ts.open(dst).load_tensors(verify=True)
    for tname, want in rec["tensors"].items():
        assert digest_values(loaded[tname].dequantize(torch.float32)) == want["dequantized_float32_xxh3_64"]


def test_verify_catches_a_flipped_byte(tmp_path):
    """verify really reads the checksums: one flipped bit in a buffer of a golden copy fails it."""
    src = golden("nvfp4_1d")
    data = bytearray(src.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = record("nvfp4_1d")["tensors"]["layers.0.weight"]["buffers"]["_rowwise_data"]["key"]
    start = 8 + n + header[key]["data_offsets"][0]
    data[start + 5] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(tse.ChecksumError, match="_rowwise_data"):
        ts.verify(bad)


def test_the_published_schema_is_the_one_the_package_ships():
    """schema/manifest-v1.schema.json (what a stranger reads) and the package data the reader
    validates against (te_serial/checkpoint/) are one document: byte-identical."""
    shipped = ROOT / "te_serial" / "checkpoint" / "manifest-v1.schema.json"
    assert (ROOT / "schema" / "manifest-v1.schema.json").read_bytes() == shipped.read_bytes()
