"""The rules schema/README.md states for readers in other languages, checked against te-serial.

Each test names the section it pins: field versions (§10), the order of the first checks (§8),
NVFP4's invalid field combinations (§7.4, exhaustively), the grouped quantizer's fields (§3),
``storage`` / ``scale_layout`` (§4), field types (§3), the msgpack → JSON mapping (§2), 0-d
quantized tensors (§4), region views and range boxes (§13, the README's own code against
te-serial's), and E8M0's ends (§7.2).
"""

from __future__ import annotations

import base64
import itertools
import re
import shutil
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.checkpoint import tree as tree_mod
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME, seal
from te_serial.formats.slicing import buffer_regions, region_views
from helpers import FORMAT_CASES, USAGES

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "schema" / "golden"
README = ROOT / "schema" / "README.md"


# --- rewriting a golden copy's manifest ----------------------------------------------------------

def _doc(raw: bytes) -> dict:
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    doc.pop("manifest_checksum", None)
    return doc


def _encode(doc: dict, sealed: bool) -> bytes:
    return seal(doc) if sealed else tree_mod.pack(doc)


def rewrite(name: str | Path, tmp: Path, edit, *, sealed: bool = True) -> Path:
    """A copy of golden ``name`` (single file or directory; or a checkpoint directory's path) with its
    manifest changed by ``edit(doc)``, re-encoded with its checksum (``sealed``) or without."""
    src = GOLDEN / name
    tmp.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        dst = tmp / src.name
        shutil.copytree(src, dst)
        doc = _doc((dst / MANIFEST_NAME).read_bytes())
        edit(doc)
        (dst / MANIFEST_NAME).write_bytes(_encode(doc, sealed))
        return dst
    src = GOLDEN / f"{name}.safetensors"
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    doc = _doc(base64.b64decode(meta[HEADER_KEY]))
    edit(doc)
    meta[HEADER_KEY] = base64.b64encode(_encode(doc, sealed)).decode("ascii")
    dst = tmp / f"{name}.safetensors"
    save_file(load_file(str(src)), str(dst), metadata=meta)
    return dst


def refused(path: Path, cls=tse.ManifestError) -> tse.TeSerialError:
    with pytest.raises(cls) as e:
        ts.open(path).close()
    return e.value


def reads(path: Path) -> None:
    with ts.open(path) as ckpt:
        ckpt.load_tensors(verify=True)


def _quantizer_index(doc: dict, kind: str) -> int:
    return next(i for i, q in enumerate(doc["quantizers"]) if q["kind"] == kind)


def _version(v):
    return lambda doc: doc.__setitem__("version", list(v))


# --- §10: field versions -------------------------------------------------------------------------

NVFP4_13 = {"row_scaled_nvfp4": False, "nvfp4_use_4over6": False, "nvfp4_e4m3_max": 448,
            "nvfp4_4over6_err_mode": "MAE"}


@pytest.mark.parametrize("field", list(NVFP4_13))
def test_a_1_3_nvfp4_field_in_a_1_2_manifest_is_refused_naming_it(tmp_path, field):
    """Presence counts, even at the default value: the manifest says 1.2, the field is 1.3."""
    def edit(doc):
        doc["version"] = [1, 2]
        doc["quantizers"][_quantizer_index(doc, "nvfp4")][field] = NVFP4_13[field]
    e = refused(rewrite("tied_quantized", tmp_path, edit))
    assert field in str(e) and "needs format 1.3" in str(e) and "says 1.2" in str(e)
    assert re.fullmatch(rf"quantizers/\d+/{field}", e.field)
    for v in ((1, 3), (1, 7)):  # the same field in a 1.3 manifest reads, and so does a newer minor's
        reads(rewrite("tied_quantized", tmp_path / f"v{v[1]}",
                      lambda d, v=v: (edit(d), d.__setitem__("version", list(v)))))


def test_the_1_3_nvfp4_goldens_relabelled_1_2_are_refused(tmp_path):
    for name, field in (("nvfp4_row_scaled", "row_scaled_nvfp4"), ("nvfp4_4over6", "nvfp4_use_4over6")):
        e = refused(rewrite(name, tmp_path / name, _version((1, 2))))
        assert "needs format 1.3" in str(e) and field in str(e) and e.field.endswith(f"/{field}"), e


def test_manifest_checksum_in_a_1_0_manifest_is_refused(tmp_path):
    """A 1.0 golden re-encoded with the 1.1 trailer, still saying 1.0: the trailer is a 1.1 field."""
    e = refused(rewrite("mxfp8_1x32", tmp_path, lambda d: None, sealed=True))
    assert e.field == "manifest_checksum" and "needs format 1.1" in str(e) and "says 1.0" in str(e)
    reads(rewrite("mxfp8_1x32", tmp_path / "plain", lambda d: None, sealed=False))  # as it was: reads


def test_chunks_in_a_1_1_manifest_and_grouped_in_a_1_2_manifest_are_refused(tmp_path):
    import te_serial.dcp as tdcp
    tdcp.save({"w": ts.MXFP8Quantizer()(torch.randn(64, 64))}, tmp_path / "ck")  # one process: chunked
    e = refused(rewrite(tmp_path / "ck", tmp_path / "a", _version((1, 1))))
    assert e.field == "tensors/chunks" and "needs format 1.2" in str(e)
    e = refused(rewrite("dcp_two_ranks", tmp_path / "b", _version((1, 1))))  # its first newer field
    assert "needs format 1." in str(e) and "says 1.1" in str(e)
    e = refused(rewrite("grouped_moe", tmp_path / "c", _version((1, 2))))
    assert re.fullmatch(r"quantizers/\d+", e.field) and "format 1.3" in str(e)


def test_every_golden_still_reads_under_its_own_version():
    for p in sorted(GOLDEN.glob("*.expected.json")):
        name = p.name.removesuffix(".expected.json")
        path = GOLDEN / name if (GOLDEN / name).is_dir() else GOLDEN / f"{name}.safetensors"
        with ts.open(path) as ckpt:
            assert ckpt.keys()


def test_the_field_version_table_is_the_code():
    """§10's table lists exactly the quantizer fields the formats declare as later (FIELD_VERSIONS)."""
    from te_serial.checkpoint.manifest import CHECKSUM_VERSION, CHUNKS_VERSION, GROUPED_VERSION
    from te_serial.formats.protocol import QUANTIZER_REGISTRY
    declared = {(cls.kind, f, v) for cls in set(QUANTIZER_REGISTRY.values()) for f, v in cls.FIELD_VERSIONS.items()}
    assert declared == {("nvfp4", f, (1, 3)) for f in NVFP4_13} | {("grouped", "transposed", (1, 4))}
    assert (CHECKSUM_VERSION, CHUNKS_VERSION, GROUPED_VERSION) == ((1, 1), (1, 2), (1, 3))
    text = README.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("  | `nvfp4` fields"))
    assert all(f"`{f}`" in row for f in NVFP4_13) and "| 1.3 |" in row
    row = next(line for line in text.splitlines() if line.startswith("  | `grouped` field"))
    assert "`transposed`" in row and "| 1.4 |" in row


def test_a_transposed_group_in_a_1_3_manifest_is_refused_naming_the_field(tmp_path):
    """gpt-oss's [in, out] expert stacks (format 1.4): the field in a manifest saying 1.3 is refused."""
    from te_serial.formats.grouped import per_expert
    q = per_expert(ts.MXFP8Quantizer(columnwise=False), (4, 64, 96), transposed=True)
    ts.save_quantized({"layers.0.mlp.experts.gate_up_proj": q.quantize(torch.randn(4, 64, 96))}, tmp_path / "ck")
    reads(tmp_path / "ck")
    e = refused(rewrite(tmp_path / "ck", tmp_path / "old", _version((1, 3))))
    assert "transposed" in str(e) and "needs format 1.4" in str(e) and e.field.endswith("/transposed")


def test_the_kind_version_table_is_the_code():
    """§10's table lists exactly the quantizer kinds added after 1.0 by a KIND_VERSION (MXFP4: 1.5)."""
    from te_serial.formats.protocol import QUANTIZER_REGISTRY
    declared = {(cls.kind, cls.KIND_VERSION) for cls in set(QUANTIZER_REGISTRY.values()) if cls.KIND_VERSION > (1, 0)}
    assert declared == {("mxfp4", (1, 5))}
    row = next(line for line in README.read_text(encoding="utf-8").splitlines()
               if line.startswith("  | quantizer kind `mxfp4`"))
    assert "| 1.5 |" in row


def test_mxfp4_in_a_1_4_manifest_is_refused_naming_the_kind(tmp_path):
    """Format 1.5 added kind mxfp4: a manifest saying 1.4 that names it is refused, alone or as a member."""
    x = torch.randn(64, 64)
    t = ts.MXFP4Quantizer()(x)
    ts.save_quantized({"w": t, "g": tsf.GroupedTensor.from_members([t, t])}, tmp_path / "ck")
    with ts.open(tmp_path / "ck") as ckpt:
        assert ckpt.manifest.version == (1, 5)
    reads(tmp_path / "ck")
    e = refused(rewrite(tmp_path / "ck", tmp_path / "old", _version((1, 4))))
    assert "'mxfp4' needs format 1.5" in str(e) and e.field.endswith("/kind")


# --- §8: the order of the first checks -----------------------------------------------------------

def test_checksum_is_checked_before_the_version(tmp_path):
    def damage(path: Path) -> Path:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
        raw = bytearray(base64.b64decode(meta[HEADER_KEY]))
        raw[-1] ^= 1
        meta[HEADER_KEY] = base64.b64encode(bytes(raw)).decode("ascii")
        save_file(load_file(str(path)), str(path), metadata=meta)
        return path
    v2 = _version((2, 0))
    e = refused(damage(rewrite("tied_quantized", tmp_path / "a", v2)))
    assert not isinstance(e, tse.VersionError) and e.field == "manifest_checksum"
    refused(rewrite("tied_quantized", tmp_path / "b", v2, sealed=False), tse.VersionError)
    e = refused(rewrite("tied_quantized", tmp_path / "c", lambda d: None, sealed=False))
    assert "must end with its manifest_checksum" in str(e)


# --- §7.4: NVFP4's invalid combinations, exhaustively --------------------------------------------

NVFP4_FLAGS = ("rowwise", "columnwise", "with_rht", "with_post_rht_amax", "with_random_sign_mask",
               "with_2d_quantization", "stochastic_rounding", "row_scaled_nvfp4", "nvfp4_use_4over6")


def spec_valid_nvfp4(f: dict) -> bool:
    """§7.4's table of invalid combinations, as written."""
    if not (f["rowwise"] or f["columnwise"]):
        return False
    if f["with_rht"] and not f["with_post_rht_amax"]:
        return False
    if f["nvfp4_use_4over6"] and (f["with_rht"] or f["stochastic_rounding"]):
        return False
    if f["row_scaled_nvfp4"] and (f["columnwise"] or not f["rowwise"] or f["with_2d_quantization"]
                                  or f["with_rht"] or f["stochastic_rounding"]):
        return False
    if f["nvfp4_e4m3_max"] not in (448, 256) or (f["nvfp4_e4m3_max"] == 256 and not f["nvfp4_use_4over6"]):
        return False
    return f["nvfp4_4over6_err_mode"].upper() in ("MAE", "MSE")


def test_nvfp4_validation_is_exactly_the_spec_list():
    seen = {True: 0, False: 0}
    for bits in itertools.product((False, True), repeat=len(NVFP4_FLAGS)):
        for e4m3_max, mode in itertools.product((448, 256, 300), ("MAE", "mse", "MAX")):
            f = dict(zip(NVFP4_FLAGS, bits), nvfp4_e4m3_max=e4m3_max, nvfp4_4over6_err_mode=mode)
            try:
                q = tsf.Quantizer.from_dict({"kind": "nvfp4", **f})
                ok = True
            except tse.FormatError:
                ok = False
            assert ok == spec_valid_nvfp4(f), f
            if ok:
                assert q == ts.NVFP4Quantizer(**f)
            seen[ok] += 1
    assert seen[True] and seen[False]


def test_rht_without_post_rht_amax_is_refused_naming_the_field(tmp_path):
    with pytest.raises(tse.FormatError, match="with_post_rht_amax"):
        ts.NVFP4Quantizer(with_rht=True)
    ts.NVFP4Quantizer(with_post_rht_amax=True)  # without RHT: valid, no effect

    def edit(doc):
        doc["quantizers"][_quantizer_index(doc, "nvfp4")]["with_post_rht_amax"] = False
    e = refused(rewrite("nvfp4_rht_columnwise", tmp_path, edit))
    assert "with_post_rht_amax" in str(e) and re.fullmatch(r"quantizers/\d+", e.field)


# --- §3: field types and defaults -----------------------------------------------------------------

@pytest.mark.parametrize("value", [256.0, "256", True, 512])
def test_nvfp4_e4m3_max_is_the_int_448_or_256(value):
    with pytest.raises(tse.FormatError, match="nvfp4_e4m3_max"):
        tsf.Quantizer.from_dict({"kind": "nvfp4", "nvfp4_use_4over6": True, "nvfp4_e4m3_max": value})
    q = tsf.Quantizer.from_dict({"kind": "nvfp4", "nvfp4_use_4over6": True, "nvfp4_e4m3_max": 256})
    assert q.nvfp4_e4m3_max == 256


def test_err_mode_is_case_insensitive_and_written_upper_case():
    q = tsf.Quantizer.from_dict({"kind": "nvfp4", "nvfp4_use_4over6": True, "nvfp4_4over6_err_mode": "mse"})
    assert q.to_dict()["nvfp4_4over6_err_mode"] == "MSE"


def test_delayed_scaling_defaults():
    q = tsf.Quantizer.from_dict({"kind": "fp8_delayed_scaling"})
    assert (q.fp8_dtype, q.scale, q.amax, q.rowwise, q.columnwise) == (torch.float8_e4m3fn, 1.0, 0.0, True, True)


MX = {"kind": "mxfp8", "rowwise": True, "columnwise": False, "fp8_dtype": "float8_e4m3fn",
      "with_2d_quantization": False}


@pytest.mark.parametrize("fields,match", [
    ({"member": MX, "member_shapes": [[32, 32]], "rowwise": True, "columnwise": False}, None),
    ({"member_shapes": [[16]], "dtype": "bfloat16", "rowwise": True, "columnwise": False}, None),  # member nil
    ({"member": None, "member_shapes": [[16]], "dtype": "bfloat16", "rowwise": True, "columnwise": False}, None),
    ({"member": MX, "rowwise": True, "columnwise": False}, "members"),                   # member_shapes required
    ({"member_shapes": [[16]], "rowwise": True, "columnwise": False}, "dtype"),          # dtype with plain members
    ({"member": MX, "member_shapes": [[32, 32]], "dtype": "bfloat16", "rowwise": True, "columnwise": False},
     "no plain dtype"),
    ({"member": MX, "member_shapes": [[32, 32]], "dtype": None, "rowwise": True, "columnwise": False}, "dtype"),
    ({"member_shapes": [[16]], "dtype": "int32", "rowwise": True, "columnwise": False}, "floating-point"),
    ({"member": MX, "member_shapes": [[32, 32]], "rowwise": True, "columnwise": True}, "columnwise"),
    ({"member_shapes": [[16]], "dtype": "bfloat16", "rowwise": False, "columnwise": True}, "rowwise"),
])
def test_grouped_fields(fields, match):
    """§3's grouped table: member_shapes required, dtype exactly with plain members, usages the member's."""
    d = {"kind": "grouped", **fields}
    if match is None:
        q = tsf.Quantizer.from_dict(d)
        assert (q.rowwise, q.columnwise) == (d["rowwise"], d["columnwise"])
        return
    with pytest.raises(tse.FormatError, match=match):
        tsf.Quantizer.from_dict(d)


def test_grouped_usage_mismatch_in_a_manifest_is_refused(tmp_path):
    def edit(doc):
        i = _quantizer_index(doc, "grouped")
        doc["quantizers"][i]["columnwise"] = not doc["quantizers"][i]["columnwise"]
    e = refused(rewrite("grouped_moe", tmp_path, edit))
    assert "columnwise" in str(e)


def test_the_schema_states_the_grouped_rules():
    import jsonschema_rs
    from te_serial.checkpoint.manifest import schema
    v = jsonschema_rs.validator_for({"$defs": schema()["$defs"], **schema()["properties"]["quantizers"]})
    base = {"kind": "grouped", "rowwise": True, "columnwise": False}
    assert v.is_valid([{**base, "member_shapes": [[16]], "dtype": "bfloat16"}])
    assert v.is_valid([{**base, "member": dict(MX, kind="mxfp8"), "member_shapes": [[32, 32]]}])
    assert not v.is_valid([{**base, "dtype": "bfloat16"}])                                   # no member_shapes
    assert not v.is_valid([{**base, "member_shapes": [[16]]}])                               # no dtype
    assert not v.is_valid([{**base, "member": MX, "member_shapes": [[32, 32]], "dtype": "bfloat16"}])


# --- §4: storage / scale_layout, 0-d tensors -------------------------------------------------------

def _proto_index(doc: dict, quantized: bool) -> int:
    return next(i for i, p in enumerate(doc["protos"]) if (p["quantizer"] is not None) == quantized)


@pytest.mark.parametrize("edit", ["drop storage", "drop scale_layout", "drop both", "nil storage",
                                  "storage class", "storage-only class"])
def test_storage_and_scale_layout_are_optional_each_on_its_own(tmp_path, edit):
    def change(doc):
        p = doc["protos"][_proto_index(doc, True)]
        if edit in ("drop storage", "drop both"):
            del p["storage"]
        if edit in ("drop scale_layout", "drop both"):
            del p["scale_layout"]
        if edit == "nil storage":
            p["storage"] = None
        if edit == "storage-only class":
            p["storage"] += "Storage"
    reads(rewrite("tied_quantized", tmp_path, change))


@pytest.mark.parametrize("key,value,match", [("scale_layout", "compact", "no scale layout"),
                                              ("storage", "MXFP8Tensor", "no storage class")])
def test_a_plain_tensor_has_neither(tmp_path, key, value, match):
    e = refused(rewrite("tied_quantized", tmp_path,
                        lambda d: d["protos"][_proto_index(d, False)].__setitem__(key, value)))
    assert match in str(e)


def test_a_quantized_tensor_of_storage_of_another_kind_is_refused(tmp_path):
    e = refused(rewrite("tied_quantized", tmp_path,
                        lambda d: d["protos"][_proto_index(d, True)].__setitem__("storage", "Float8Tensor")))
    assert "does not hold" in str(e)


def test_a_quantized_0_d_tensor_is_refused(tmp_path):
    e = refused(rewrite("tied_quantized", tmp_path,
                        lambda d: d["protos"][_proto_index(d, True)].__setitem__("shape", [])))
    assert "at least one dim" in str(e)
    for make, _ in FORMAT_CASES:
        with pytest.raises(tse.ShapeError):
            make(True, True).describe_buffers(())


# --- §2: the msgpack → JSON mapping ----------------------------------------------------------------

@pytest.mark.parametrize("case,ok", [
    ("bin in an unknown top-level field", True), ("int-keyed map in an unknown top-level field", True),
    ("bin in an unknown producer field", True), ("bin in an unknown proto field", True),
    ("bin in an unknown tensors column", True),
    ("bin in metadata", False), ("int key in producer", False), ("bin in an unknown quantizer field", False),
    ("NaN in a quantizer field", False), ("inf in a quantizer field", False), ("NaN for a nil-able field", False),
    ("float shape", False), ("float version", False), ("bool version", False),
])
def test_msgpack_to_json_mapping(tmp_path, case, ok):
    q = lambda d: d["quantizers"][_quantizer_index(d, "mxfp8")]  # noqa: E731
    edits = {
        "bin in an unknown top-level field": lambda d: d.__setitem__("future", b"\x00"),
        "int-keyed map in an unknown top-level field": lambda d: d.__setitem__("future", {1: 2}),
        "bin in an unknown producer field": lambda d: d["producer"].__setitem__("future", b"\x00"),
        "bin in an unknown proto field": lambda d: d["protos"][0].__setitem__("future", b"\x00"),
        "bin in an unknown tensors column": lambda d: d["tensors"].__setitem__("future", [b"\x00"]),
        "bin in metadata": lambda d: d["metadata"].__setitem__("k", b"\x00"),
        "int key in producer": lambda d: d["producer"].__setitem__(1, "x"),
        "bin in an unknown quantizer field": lambda d: q(d).__setitem__("future", b"\x00"),
        "NaN in a quantizer field": lambda d: q(d).__setitem__("fp8_dtype", float("nan")),
        "inf in a quantizer field": lambda d: q(d).__setitem__("fp8_dtype", float("inf")),
        "NaN for a nil-able field": lambda d: d["protos"][0].__setitem__("storage", float("nan")),
        "float shape": lambda d: d["protos"][0]["shape"].__setitem__(0, float(d["protos"][0]["shape"][0])),
        "float version": _version((1.0, 3)),
        "bool version": _version((1, True)),
    }
    path = rewrite("tied_quantized", tmp_path, edits[case])
    if ok:
        reads(path)
    else:
        refused(path)


# --- §13: region views and boxes, the README's code against te-serial's ----------------------------

def _readme_code() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    ns: dict = {"__name__": "readme_example"}
    exec(compile("\n\n".join(blocks), str(README), "exec"), ns)  # noqa: S102 - our own documentation
    return ns


def _quantizers():
    for make, shape in FORMAT_CASES:
        for r, c in USAGES:
            yield make(r, c), shape
    nv = ts.NVFP4Quantizer
    yield nv(row_scaled_nvfp4=True, columnwise=False), (3, 32, 64)
    yield nv(nvfp4_use_4over6=True, nvfp4_e4m3_max=256), (48, 64)
    g = tsf.GroupedTensor.from_members([nv(columnwise=False)(torch.randn(r, 32)) for r in (16, 32)])
    yield g.quantizer, tuple(g.shape)


def test_region_views_are_the_spec_table():
    """§13's table (the README's ``region_view``) gives te-serial's region view of every buffer."""
    region_view = _readme_code()["region_view"]
    for q, shape in _quantizers():
        specs = q.describe_buffers(shape)
        views = region_views(q, shape)
        for b, spec in specs.items():
            assert tuple(region_view(list(shape), q.to_dict(), b, list(spec.shape))) == views[b], (q, shape, b)


def _spec_boxes(q: dict, r0, r1, c0, c1, views) -> dict:
    """§13's "A range's boxes", as written."""
    kind = q["kind"]
    p = 2 if kind in ("nvfp4", "mxfp4") else 1
    grids = _readme_code()["SCALE_GRIDS"]
    out = {}
    for b, view in views.items():
        if b in ("_data", "_rowwise_data") or (kind == "mxfp8" and b == "_columnwise_data"):
            out[b] = ((r0, c0 // p), (r1 - r0, -(-c1 // p) - c0 // p))
        elif b in ("_transpose", "_columnwise_data"):
            out[b] = ((c0, r0 // p), (c1 - c0, -(-r1 // p) - r0 // p))
        elif b == "_amax_rowwise" and q.get("row_scaled_nvfp4"):
            out[b] = ((r0,), (r1 - r0,))
        elif (kind, q.get("block_scaling_dim"), b) in grids:
            r, c, transposed = grids[(kind, q.get("block_scaling_dim"), b)]
            rows, cols = (r0 // r, -(-r1 // r)), (c0 // c, -(-c1 // c))
            (a0, a1), (b0, b1) = (cols, rows) if transposed else (rows, cols)
            out[b] = ((a0, b0), (a1 - a0, b1 - b0))
        else:
            out[b] = ((0,), (1,))
    return out


def test_range_boxes_are_the_spec_rule():
    for q, shape in _quantizers():
        if q.is_container:
            continue
        m, k = torch.Size(shape[:-1]).numel(), shape[-1]
        ra, ca = q.slice_alignment()
        views = region_views(q, shape)
        for (r0, r1), (c0, c1) in itertools.product({(0, m), (0, ra), (ra, m)} if m > ra else {(0, m)},
                                                    {(0, k), (0, ca), (ca, k)} if k > ca else {(0, k)}):
            got = buffer_regions(q, shape, (r0, r1), (c0, c1))
            assert got == _spec_boxes(q.to_dict(), r0, r1, c0, c1, views), (q, shape, r0, r1, c0, c1)


# --- §7.2: E8M0's ends ------------------------------------------------------------------------------

def test_e8m0_ends():
    from te_serial import numerics as nx
    s = nx.e8m0_dequant_scale(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert s.view(torch.int32)[0].item() == 0x00400000 and s[0].item() == 2.0 ** -127
    assert s[1:4].tolist() == [2.0 ** -126, 1.0, 2.0 ** 127] and torch.isnan(s[4])
    amax = torch.tensor([0.0, 448 * 2.0 ** -128, float("inf"), float("nan")])
    assert nx.e8m0_from_amax(amax, torch.float8_e4m3fn).tolist() == [0, 0, 254, 255]
    # a NaN input does not make a NaN scale: the block amax ignores it (as TE's)
    x = torch.ones(32, 32)
    x[0, 0] = float("nan")
    t = ts.MXFP8Quantizer(columnwise=False)(x)
    assert 255 not in t._rowwise_scale_inv.view(torch.uint8).unique().tolist()
    # scale 255: every value of the block NaN, zero codes included; scale 0: exact subnormal products
    bufs = {n: b.clone() for n, b in t.buffers().items()}
    bufs["_rowwise_data"].view(torch.uint8)[1] = 0
    bufs["_rowwise_scale_inv"].view(torch.uint8)[1, 0] = 255
    bufs["_rowwise_scale_inv"].view(torch.uint8)[2, 0] = 0
    d = type(t)((32, 32), torch.float32, t.quantizer, **bufs).dequantize(torch.float32)
    assert torch.isnan(d[1]).all() and not torch.isnan(d[2:]).any()
    want = t._rowwise_data[2].view(torch.float8_e4m3fn).to(torch.float64) * 2.0 ** -127
    assert torch.equal(d[2], want.to(torch.float32)) and (d[2] != 0).all()
