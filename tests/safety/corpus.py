"""The hostile-checkpoint corpus: every way the safety tests damage a checkpoint, as data.

The themed test files (``test_manifest.py``, ``test_shard_headers.py``, ...) check each case in
process, with budgets and the names the message must hold. :data:`HOSTILE` flattens the cases
that must be refused into one list of :class:`Hostile` (id, form, damage, expected class) that
``test_corpus_sandboxed.py`` replays in a resource-limited child process, through
``load_quantized`` and through ``convert``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import te_serial
from te_serial.errors import (CheckpointError, CheckpointFileError, ChecksumError, ManifestError,
                       TensorMismatchError, VersionError)
from te_serial.checkpoint import tree as tree_mod
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME, expected_buffers
from te_serial.checkpoint.tree import TensorRef
from te_serial.proto import TensorProto

from .safety_helpers import (MANIFEST_CHECKSUM, B, P, T, Ck, _bj, _fidx, _pbuf, _pi, _proto, _qi, _quant, _ti,
                             key_of, read_st, seal_raw, st_bytes)


# ================================================================================================
# 1. malformed manifests: invariants, names, versions
# ================================================================================================
def _recompute_buffers(doc, tensor=T):
    """Make a prototype's buffer shapes agree with its (edited) shape."""
    d = _proto(doc, tensor)
    q = doc["quantizers"][d["quantizer"]] if d["quantizer"] is not None else None
    proto = TensorProto(tuple(d["shape"]), getattr(torch, d["dtype"]),
                        te_serial.formats.Quantizer.from_dict(q) if q is not None else None)
    shapes = {n: list(s) for n, (s, _) in expected_buffers(proto).items()}
    for b in d["buffers"]:
        b["shape"] = shapes[b["name"]]


MANIFEST_CASES: list = []


#: ids of the manifest edits found at the first read of a tensor (and by verify), not at open: they
#: damage the checksums column, which open keeps as bytes until it is used (the manifest's own
#: checksum still covers it)
FOUND_AT_FIRST_READ: set[str] = set()


def case(id: str, exc=ManifestError, forms=("dir", "file"), xfail: str | None = None, at_open: bool = True):
    """Registers ``fn(doc, ck) -> needles`` as a manifest edit that must raise ``exc``."""
    def deco(fn):
        for f in forms:
            if not at_open:
                FOUND_AT_FIRST_READ.add(f"{id}-{f}")
            marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
            MANIFEST_CASES.append(pytest.param(fn, exc, f, id=f"{id}-{f}", marks=marks))
        return fn
    return deco


def _protos_field(doc, tensor=T) -> str:
    return f"protos/{_pi(doc, tensor)}"


def _quant_field(doc, tensor=T) -> str:
    return f"quantizers/{_qi(doc, tensor)}"


@case("buffer-shape-vs-proto")
def _(doc, ck):
    _pbuf(doc)["shape"] = [64, 32]
    return [ck.source, _protos_field(doc), B]


@case("buffer-dtype-vs-proto")
def _(doc, ck):
    _pbuf(doc)["dtype"] = "uint8"
    return [ck.source, _protos_field(doc), B]


@case("scale-shape-vs-proto")
def _(doc, ck):
    _pbuf(doc, T, "_rowwise_scale_inv")["shape"] = [4, 128]
    return [ck.source, _protos_field(doc), "_rowwise_scale_inv"]


@case("buffer-missing-from-proto")
def _(doc, ck):
    j = _bj(doc, T, "_columnwise_data")
    del _proto(doc)["buffers"][j]
    del doc["tensors"]["files"][_ti(doc)][j]
    del doc["tensors"]["checksums"][_ti(doc)][j]
    return [ck.source, _protos_field(doc)]


@case("buffer-extra-in-proto")
def _(doc, ck):
    _proto(doc)["buffers"].append(dict(_pbuf(doc), name="_evil"))
    doc["tensors"]["files"][_ti(doc)].append(0)
    doc["tensors"]["checksums"][_ti(doc)].append(0)
    return [ck.source, _protos_field(doc)]


@case("proto-shape-vs-buffers")
def _(doc, ck):
    _proto(doc)["shape"] = [32, 64]
    return [ck.source, _protos_field(doc)]


@case("proto-shape-not-quantizable")
def _(doc, ck):
    _proto(doc)["shape"] = [63, 64]
    return [ck.source, _protos_field(doc)]


@case("plain-shape-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [8, 8]
    return [ck.file_of(P, "data", doc), P]


@case("plain-dtype-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc, P)["dtype"] = _pbuf(doc, P, "data")["dtype"] = "int32"
    return [ck.file_of(P, "data", doc), P]


@case("plain-shape-absurd-vs-file", ManifestError)  # more bytes than the files hold
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1 << 40, 1 << 40]
    return ["more bytes than the checkpoint's files hold", "protos/"]


@case("quantized-shape-vs-file", TensorMismatchError)
def _(doc, ck):
    _proto(doc)["shape"] = [32, 128]
    _recompute_buffers(doc)
    return [ck.file_of(T, B, doc), T]


@case("quantized-shape-absurd-vs-file", ManifestError)  # more bytes than the files hold
def _(doc, ck):
    _proto(doc)["shape"] = [1 << 45, 1 << 20]
    _recompute_buffers(doc)
    return ["more bytes than the checkpoint's files hold", "protos/"]


for _where in ("tensor", "buffer", "quantizer"):
    for _name in ("object", "torch.float32", "float", "os.system", "builtins.eval", ""):
        def _dtype_case(doc, ck, where=_where, name=_name):
            if where == "tensor":
                _proto(doc)["dtype"] = name
                return [ck.source, _protos_field(doc)]
            if where == "buffer":
                _pbuf(doc)["dtype"] = name
                return [ck.source, _protos_field(doc)]
            _quant(doc)["fp8_dtype"] = name
            return [ck.source, _quant_field(doc)]
        case(f"dtype-{_where}-{_name or 'empty'}")(_dtype_case)


def _quantizer_case(id, tensor, field, value, xfail=None):
    def fn(doc, ck):
        _quant(doc, tensor)[field] = value
        return [ck.source, _quant_field(doc, tensor)]
    case(id, xfail=xfail)(fn)


_quantizer_case("quantizer-kind-unknown", T, "kind", "fp8_from_the_future")
_quantizer_case("quantizer-kind-os.system", T, "kind", "os.system")
_quantizer_case("quantizer-kind-int", T, "kind", 5)
_quantizer_case("quantizer-unknown-field", T, "__reduce__", "os.system")
_quantizer_case("quantizer-rowwise-not-bool", T, "rowwise", "yes")
_quantizer_case("quantizer-fp8-dtype-int", T, "fp8_dtype", 5)
_quantizer_case("quantizer-fp8-dtype-e8m0", T, "fp8_dtype", "float8_e8m0fnu")
_quantizer_case("quantizer-block-dim-string", "blocks.0.w_blk", "block_scaling_dim", "os.system")
_quantizer_case("quantizer-block-dim-3", "blocks.0.w_blk", "block_scaling_dim", 3)
_quantizer_case("quantizer-epsilon-string", "blocks.1.w_cs", "amax_epsilon", "os.system")
_quantizer_case("quantizer-scale-string", "blocks.1.w_ds", "scale", "os.system")
_quantizer_case("quantizer-amax-string", "blocks.1.w_ds", "amax", "x")
_quantizer_case("quantizer-2d-string", T, "with_2d_quantization", "os.system")
_quantizer_case("quantizer-rht-string", "blocks.0.w_fp4", "with_rht", "os.system")
_quantizer_case("quantizer-pow2-int", "blocks.1.w_cs", "force_pow_2_scales", 7)


@case("quantizer-none-usage")
def _(doc, ck):
    _quant(doc)["rowwise"] = _quant(doc)["columnwise"] = False
    return [ck.source, _quant_field(doc)]


@case("quantizer-not-a-map")
def _(doc, ck):
    doc["quantizers"][_qi(doc)] = "os.system"
    return [ck.source, _quant_field(doc)]


@case("quantizer-index-out-of-range")
def _(doc, ck):
    _proto(doc)["quantizer"] = 99
    return [ck.source, _protos_field(doc)]


@case("quantizer-index-float")
def _(doc, ck):
    _proto(doc)["quantizer"] = float(_qi(doc))
    return [ck.source, _protos_field(doc)]


for _storage in ("os.system", "builtins.eval", "subprocess.Popen", "pickle.loads", "torch.load",
                 "__import__", "Float8Tensor", "NVFP4TensorStorage", "NoSuchStorage"):
    def _storage_case(doc, ck, storage=_storage):
        _proto(doc)["storage"] = storage
        return [ck.source, _protos_field(doc)]
    case(f"storage-{_storage}")(_storage_case)


@case("storage-on-plain-tensor")
def _(doc, ck):
    _proto(doc, P)["storage"] = "Float8Tensor"
    return [ck.source, _protos_field(doc, P)]


@case("storage-not-a-string")
def _(doc, ck):
    _proto(doc)["storage"] = ["os", "system"]
    return [ck.source, _protos_field(doc)]


# --- grouped (MoE) tensors, format 1.3: T's prototype turned into a group of MXFP8 members ----------
def _as_group(doc, shapes, proto_shape=None, member=None, buffers=False) -> str:
    """T's prototype made a grouped one (a new quantizer entry); ``buffers``: its buffer list made
    what the group describes. Returns the new quantizer's field."""
    q = _quant(doc)
    doc["quantizers"].append({"kind": "grouped", "rowwise": q["rowwise"], "columnwise": q["columnwise"],
                              "member": dict(q) if member is None else member, "member_shapes": shapes})
    p = _proto(doc)
    p["quantizer"], p["storage"] = len(doc["quantizers"]) - 1, "GroupedTensor"
    p["shape"] = proto_shape if proto_shape is not None else [len(shapes), *shapes[0]]
    if buffers:
        g = te_serial.formats.Quantizer.from_dict(doc["quantizers"][-1])
        proto = TensorProto(g.group_shape, getattr(torch, p["dtype"]), g)
        p["buffers"] = [{"name": n, "shape": list(s), "dtype": str(d).replace("torch.", "")}
                        for n, (s, d) in expected_buffers(proto).items()]
    return f"quantizers/{len(doc['quantizers']) - 1}"


@case("grouped-buffers-vs-members")  # a member's buffers where the group's should be
def _(doc, ck):
    _as_group(doc, [[64, 64]])
    return [ck.source, _protos_field(doc), "disagree"]


@case("grouped-member-shapes-vs-packed-sizes")
def _(doc, ck):
    _as_group(doc, [[64, 64]], buffers=True)
    _quant(doc)["member_shapes"] = [[64, 32], [32, 32]]  # fewer bytes than the packed buffers hold
    _proto(doc)["shape"] = [96, 32]
    return [ck.source, _protos_field(doc), "disagree"]


@case("grouped-shape-vs-members")
def _(doc, ck):
    _as_group(doc, [[64, 64]], buffers=True)
    _proto(doc)["shape"] = [2, 64, 64]
    return [ck.source, _protos_field(doc), "has shape [1, 64, 64]"]


@case("grouped-too-many-members")
def _(doc, ck):
    return [ck.source, _as_group(doc, [[32, 32]] * 5_000), "member_shapes"]


@case("grouped-members-over-manifest-total")
def _(doc, ck):
    member = dict(_quant(doc))
    for _ in range(17):  # 17 × 4096 > 2**16 members in all
        _as_group(doc, [[32, 32]] * 4096, member=member)
    return [ck.source, "members together"]


@case("grouped-no-members")
def _(doc, ck):
    return [ck.source, _as_group(doc, [], proto_shape=[0, 64]), "member_shapes"]


@case("grouped-member-is-grouped")
def _(doc, ck):
    inner = {"kind": "grouped", "rowwise": True, "columnwise": True, "member": dict(_quant(doc)),
             "member_shapes": [[64, 64]]}
    return [ck.source, _as_group(doc, [[64, 64]], member=inner), "member"]


@case("grouped-delayed-scaling-member")  # TE does not group delayed-scaling weights
def _(doc, ck):
    return [ck.source, _as_group(doc, [[64, 64]], member=dict(_quant(doc, "blocks.1.w_ds"))), "not grouped"]


@case("grouped-member-shape-float")
def _(doc, ck):
    return [ck.source, _as_group(doc, [[64.0, 64]], proto_shape=[1, 64, 64])]


@case("grouped-huge-vs-file")  # 2**48 elements per member: refused before anything is allocated
def _(doc, ck):
    _as_group(doc, [[1 << 24, 1 << 24]] * 3, buffers=True)
    return [ck.source, _protos_field(doc), "more bytes than the checkpoint's files hold"]


@case("grouped-in-a-1.2-manifest")
def _(doc, ck):
    where = _as_group(doc, [[64, 64]], buffers=True)
    doc["version"] = [1, 2]
    return [ck.source, where, "need format 1.3"]


def _outside_copy(ck) -> str:
    """An absolute path to a real, valid shard outside the checkpoint."""
    src = ck.file_of()
    dst = ck.path.parent / "outside" / src.name
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    return str(dst)


def _subdir_copy(ck) -> str:
    src = ck.file_of()
    dst = (ck.path if ck.is_dir else ck.path.parent) / "sub" / "dir.safetensors"
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    return "sub/dir.safetensors"


BAD_FILE_NAMES = {
    "dotdot": lambda ck: "..",
    "parent": lambda ck: "../outside.safetensors",
    "inner-dotdot": lambda ck: "a..b.safetensors",
    "etc-passwd": lambda ck: "/etc/passwd",
    "absolute-real-shard": _outside_copy,
    "subdir-real-shard": _subdir_copy,
    "dot-hidden": lambda ck: ".hidden.safetensors",
    "backslash": lambda ck: "..\\evil.safetensors",
    "nul": lambda ck: "model\x00.safetensors",
    "newline": lambda ck: "model.safetensors\n",
    "too-long": lambda ck: "m" * 300 + ".safetensors",
    "tilde": lambda ck: "~/evil.safetensors",
    "dot": lambda ck: ".",
    "empty": lambda ck: "",
    "int": lambda ck: 5,
}

for _id, _make in BAD_FILE_NAMES.items():
    def _file_case(doc, ck, make=_make):
        bad = make(ck)
        if ck.is_dir:
            doc["files"][_fidx(doc)]["name"] = bad
        else:
            doc["files"] = [{"name": bad, "size": 1}]
        return [ck.source, "files"]
    case(f"file-name-{_id}")(_file_case)


@case("file-name-manifest-itself", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    """A legal name: the manifest is then read as a shard, and refused as one."""
    doc["files"][_fidx(doc)]["name"] = MANIFEST_NAME
    doc["files"][_fidx(doc)]["size"] = (ck.path / MANIFEST_NAME).stat().st_size
    return [ck.path / MANIFEST_NAME]


@case("file-listed-missing", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    doc["files"].append({"name": "model-00000000-00009-of-00009.safetensors", "size": 1234})
    return [ck.path / "model-00000000-00009-of-00009.safetensors"]


@case("file-listed-twice", forms=("dir",))
def _(doc, ck):
    doc["files"].append(dict(doc["files"][0]))
    return [ck.source, "files"]


@case("file-size-vs-manifest", CheckpointFileError, forms=("dir",))
def _(doc, ck):
    doc["files"][_fidx(doc)]["size"] += 1
    return [ck.file_of(T, B, doc)]


@case("file-size-negative", forms=("dir",))
def _(doc, ck):
    doc["files"][_fidx(doc)]["size"] = -1
    return [ck.source, "files"]


@case("file-list-empty", forms=("dir",))
def _(doc, ck):
    doc["files"] = []
    return [ck.source, "files"]


@case("single-file-lists-files", forms=("file",))
def _(doc, ck):
    doc["files"] = [{"name": "other.safetensors", "size": 10}]
    return [ck.source, "files"]


@case("file-index-out-of-range")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = 99
    return [ck.source, T]


@case("file-index-negative")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = -1
    return [ck.source, "tensors/files"]


@case("file-index-float")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)][0] = 0.0
    return [ck.source, T]


@case("buffer-in-wrong-file", TensorMismatchError, forms=("dir",))
def _(doc, ck):
    j, row = _bj(doc), doc["tensors"]["files"][_ti(doc)]
    row[j] = next(i for i in range(len(doc["files"])) if i != row[j])
    return [ck.path / doc["files"][row[j]]["name"], T, B]


@case("tensor-renamed", TensorMismatchError)
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = "w_renamed"
    doc["tree"]["w_mx"] = TensorRef("w_renamed")
    return [ck.file_of(T, B, ck.doc()), "w_renamed", B]


@case("tensor-names-duplicate")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc, P)] = T
    return [ck.source, "names"]


@case("tensor-name-empty")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = ""
    return [ck.source, "tensors/names"]


@case("tensor-name-not-a-string")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = 5
    return [ck.source, "tensors/names"]


@case("tensor-columns-differ")
def _(doc, ck):
    doc["tensors"]["protos"].pop()
    return [ck.source, "tensors"]


@case("proto-index-out-of-range")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = 99
    return [ck.source, T]


@case("proto-index-huge-float")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = 1e300
    return [ck.source, T]


@case("proto-index-float")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = float(_pi(doc))
    return [ck.source, T]


@case("proto-index-wrong-kind")
def _(doc, ck):
    doc["tensors"]["protos"][_ti(doc)] = _pi(doc, P)
    return [ck.source, T]


@case("file-row-too-short")
def _(doc, ck):
    doc["tensors"]["files"][_ti(doc)].pop()
    return [ck.source, T]


@case("checksum-row-too-short", at_open=False)
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)].pop()
    return [ck.source, T]


@case("checksum-row-too-long", at_open=False)
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)].append(0)
    return [ck.source, T, "checksums"]


@case("checksum-negative", at_open=False)
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)][0] = -1
    return [ck.source, "checksums"]


@case("checksum-string", at_open=False)
def _(doc, ck):
    doc["tensors"]["checksums"][_ti(doc)][0] = "xxh3_64:0123456789abcdef"
    return [ck.source, "checksums"]


for _id, _pairs in {"self": [[0, 0]], "out-of-range": [[0, 99]], "different-protos": [[0, 1]],
                    "chained": [[2, 3], [3, 4]], "negative": [[-1, 0]], "triple": [[0, 1, 2]]}.items():
    def _alias_case(doc, ck, pairs=_pairs):
        doc["tensors"]["aliases"] = pairs
        return [ck.source, "aliases"]
    case(f"alias-{_id}")(_alias_case)


@case("alias-float")
def _(doc, ck):
    doc["tensors"]["aliases"] = [[0.0, 1.0]]
    return [ck.source, "aliases"]


@case("alias-chained-same-proto")
def _(doc, ck):
    n = len(doc["tensors"]["names"])
    p, row, sums = _pi(doc, P), doc["tensors"]["files"][_ti(doc, P)], doc["tensors"]["checksums"][_ti(doc, P)]
    for extra in ("tied_a", "tied_b"):
        doc["tensors"]["names"].append(extra)
        doc["tensors"]["protos"].append(p)
        doc["tensors"]["files"].append(list(row))
        doc["tensors"]["checksums"].append(list(sums))
    doc["tensors"]["aliases"] = [[n, _ti(doc, P)], [n + 1, n]]
    return [ck.source, "aliases"]


for _v in ([2, 0], [99, 7]):
    def _major(doc, ck, v=_v):
        doc["version"] = v
        return [ck.source, "version", f"{v[0]}.{v[1]}"]
    case(f"version-major-{_v[0]}", VersionError)(_major)

for _id, _v in {"string": "1.0", "short": [1], "long": [1, 0, 0], "bool": [True, 0], "negative": [-1, 0],
                "none": None, "float": [1.0, 0], "tuple-ext": (1, 0)}.items():
    def _bad_version(doc, ck, v=_v):
        doc["version"] = v
        return [ck.source, "version"]
    case(f"version-{_id}")(_bad_version)


@case("version-missing")
def _(doc, ck):
    del doc["version"]
    return [ck.source, "version"]


for _f in ("pickle", "te-serial2", "", None, 1):
    def _format(doc, ck, f=_f):
        doc["format"] = f
        return [ck.source, "format"]
    case(f"format-{_f!r}")(_format)

for _key in ("format", "tensors", "files", "producer", "metadata", "quantizers", "protos"):
    def _missing(doc, ck, key=_key):
        del doc[key]
        return [ck.source]
    case(f"missing-{_key}")(_missing)

for _key in ("names", "protos", "files"):
    def _missing_column(doc, ck, key=_key):
        del doc["tensors"][key]
        return [ck.source, "tensors"]
    case(f"missing-column-{_key}")(_missing_column)


@case("tensors-not-a-map")
def _(doc, ck):
    doc["tensors"] = [doc["tensors"]["names"]]
    return [ck.source, "tensors"]


@case("metadata-not-string")
def _(doc, ck):
    doc["metadata"] = {"a": 1}
    return [ck.source, "metadata"]


@case("metadata-int-key")
def _(doc, ck):
    doc["metadata"] = {1: "a"}
    return [ck.source]


@case("metadata-bytes-value")
def _(doc, ck):
    doc["metadata"] = {"a": b"os.system"}
    return [ck.source]


@case("requires-grad-not-bool")
def _(doc, ck):
    _proto(doc)["requires_grad"] = "yes"
    return [ck.source, _protos_field(doc)]


@case("shape-negative")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [-64]
    return [ck.source, _protos_field(doc, P)]


@case("shape-fraction")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [64.5]
    return [ck.source, _protos_field(doc, P)]


@case("shape-too-many-dims")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1] * 17 + [64]
    return [ck.source, _protos_field(doc, P)]


@case("shape-over-2^53")
def _(doc, ck):
    _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1 << 60]
    return [ck.source, _protos_field(doc, P)]


@case("buffer-name-dunder")
def _(doc, ck):
    _pbuf(doc, P, "data")["name"] = "__class__"
    return [ck.source, _protos_field(doc, P)]


@case("buffer-name-path")
def _(doc, ck):
    _pbuf(doc, P, "data")["name"] = "../data"
    return [ck.source, _protos_field(doc, P)]


@case("tree-unknown-ref")
def _(doc, ck):
    doc["tree"]["ghost"] = TensorRef("ghost")
    return [ck.source, "tree", "ghost"]


@case("tree-too-deep")
def _(doc, ck):
    deep = TensorRef(T)
    for _ in range(200):
        deep = [deep]
    doc["tree"]["deep"] = deep
    return [ck.source, "tree"]


@case("tree-deep-dicts")
def _(doc, ck):
    deep = {"x": 1}
    for _ in range(900):  # below msgpack's own stack limit, above te-serial's MAX_DEPTH
        deep = {"x": deep}
    doc["tree"]["deep"] = deep
    return [ck.source, "tree"]


@case("tree-ref-in-metadata")
def _(doc, ck):
    doc["metadata"] = {"a": TensorRef(T)}
    return [ck.source]


@case("tree-ref-as-name")
def _(doc, ck):
    doc["tensors"]["names"][_ti(doc)] = TensorRef(T)
    return [ck.source]


# ================================================================================================
# 1b. malformed manifest bytes: truncation, flips, hostile msgpack
# ================================================================================================
CUTS = [0, 1, 2, 3, 8, 0.25, 0.5, 0.75, -2, -1]


ABSURD = {
    "array32-max": b"\xdd\xff\xff\xff\xff" + b"\x00" * 4,
    "map32-max": b"\xdf\xff\xff\xff\xff" + b"\x00" * 4,
    "str32-max": b"\xdb\xff\xff\xff\xff" + b"abcd",
    "bin32-max": b"\xc6\xff\xff\xff\xff" + b"abcd",
    "ext32-max": b"\xc9\xff\xff\xff\xff\x01abcd",
    "array32-4M": b"\xdd\x00\x40\x00\x00" + b"\x00" * 4,
    "map32-4M": b"\xdf\x00\x40\x00\x00" + b"\x00" * 4,
    "array32-4M-x64": b"\xdd\x00\x3f\xff\xff" * 64 + b"\xc0",
    "map32-4M-x64": b"\xdf\x00\x3f\xff\xff" * 64 + b"\xc0",
    "str32-16M": b"\xdb\x00\xff\xff\xff" + b"a",
    "nested-arrays-100000": b"\x91" * 100_000 + b"\xc0",
    "nested-maps-100000": b"\x81\xc0" * 100_000 + b"\xc0",
    "ext-unknown-42": b"\xd4\x2a\x00",
    "ext-negative-77": b"\xd4\xb3\x00",
    "ext-tensorref-bad-utf8": b"\xd4\x01\xff",
    "ext-tuple-not-msgpack": b"\xd4\x02\xc1",
    "ext-tuple-extra-data": b"\xd5\x02\x90\x90",
    "ext-tuple-not-a-list": b"\xd4\x02\x05",
}


def _with_raw_field(doc: dict, key: str, raw_value: bytes) -> bytes:
    """msgpack of ``doc`` with ``key`` set to the raw msgpack bytes ``raw_value`` (sealed)."""
    doc = {k: v for k, v in doc.items() if k not in (key, MANIFEST_CHECKSUM)}
    body = tree_mod.pack(doc)
    assert 0x80 <= body[0] < 0x8e, "expected a small fixmap"
    return seal_raw(bytes([body[0] + 1]) + body[1:] + tree_mod.pack(key) + raw_value)


def _nested_tuple_ext(levels: int) -> bytes:
    """``levels`` tuples (msgpack ext type 2) nested inside each other, built without copying."""
    parts, inner = [], 1  # innermost: nil
    for _ in range(levels):
        body = 1 + inner  # fixarray(1) + inner
        if body < 1 << 8:
            head = b"\xc7" + bytes([body]) + b"\x02"
        elif body < 1 << 16:
            head = b"\xc8" + struct.pack(">H", body) + b"\x02"
        else:
            head = b"\xc9" + struct.pack(">I", body) + b"\x02"
        parts.append(head + b"\x91")
        inner = body + len(head)
    return b"".join(reversed(parts)) + b"\xc0"


# ================================================================================================
# 1c. damaged safetensors files: truncation, absurd headers
# ================================================================================================
def _truncation_points(path: Path) -> dict[str, int]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return {"0": 0, "1": 1, "7": 7, "8": 8, "mid-header": 8 + n // 2, "end-of-header": 8 + n,
            "mid-data": 8 + n + (len(raw) - 8 - n) // 2, "size-1": len(raw) - 1}


TRUNCATIONS = ["0", "1", "7", "8", "mid-header", "end-of-header", "mid-data", "size-1"]


def _hdr_len(value):
    def edit(header, data, key):
        return st_bytes(header, data, header_len=value if isinstance(value, int) else None)
    return edit


def _set_entry(field, value):
    def edit(header, data, key):
        header[key][field] = value(header[key]) if callable(value) else value
        return st_bytes(header, data)
    return edit


def _header_json(text: bytes):
    def edit(header, data, key):
        hb = text + b" " * (-len(text) % 8)
        return struct.pack("<Q", len(hb)) + hb + data
    return edit


def _header_len_plus(delta):
    def edit(header, data, key):
        good = st_bytes(header, data)
        n = struct.unpack("<Q", good[:8])[0]
        return struct.pack("<Q", n + delta) + good[8:]
    return edit


def _overlap(header, data, key):
    other = next(k for k in header if k not in ("__metadata__", key))
    header[other]["data_offsets"] = list(header[key]["data_offsets"])
    header[other]["shape"], header[other]["dtype"] = header[key]["shape"], header[key]["dtype"]
    return st_bytes(header, data)


def _metadata_not_str(header, data, key):
    header.setdefault("__metadata__", {})["x"] = 5
    return st_bytes(header, data)


SAFETENSORS_EDITS = {
    "header-len-2^64-1": _hdr_len(2**64 - 1),
    "header-len-2^63": _hdr_len(2**63),
    "header-len-2^32": _hdr_len(2**32),
    "header-len-100MB+8": _hdr_len(100_000_008),
    "header-len-beyond-file": _header_len_plus(1 << 20),
    "header-len-short-by-1": _header_len_plus(-1),
    "header-len-zero": _hdr_len(0),
    "header-not-json": _header_json(b"{\"a\":"),
    "header-json-list": _header_json(b"[]"),
    "header-json-null": _header_json(b"null"),
    "header-json-deep": _header_json(b"[" * 100_000 + b"]" * 100_000),
    "offsets-beyond-file": _set_entry("data_offsets", lambda e: [e["data_offsets"][0], 1 << 40]),
    "offsets-u64-max": _set_entry("data_offsets", lambda e: [e["data_offsets"][0], 2**64 - 1]),
    "offsets-reversed": _set_entry("data_offsets", lambda e: e["data_offsets"][::-1]),
    "offsets-negative": _set_entry("data_offsets", lambda e: [-1, e["data_offsets"][1]]),
    "offsets-overlap": _overlap,
    "shape-absurd": _set_entry("shape", [1 << 40, 1 << 40]),
    "shape-overflow": _set_entry("shape", [1 << 32, 1 << 32, 1 << 32]),
    "dtype-unknown": _set_entry("dtype", "PICKLE"),
    "metadata-not-str": _metadata_not_str,
}


# ================================================================================================
# 2. checksums
# ================================================================================================
def _flip_data_byte(ck: Ck, tensor=T, buffer=B) -> tuple[Path, int]:
    """Flip one byte in the middle of a buffer's data; returns (file, byte index inside the buffer)."""
    path = ck.file_of(tensor, buffer)
    key = key_of(tensor, buffer)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    inside = (end - start) // 2
    raw[8 + n + start + inside] ^= 0x5A
    path.write_bytes(bytes(raw))
    return path, inside


# ================================================================================================
# damage as functions of a checkpoint copy, shared by the in-process tests and HOSTILE
# ================================================================================================
def truncate_manifest(ck: Ck, cut) -> None:
    raw = ck.raw()
    at = cut if isinstance(cut, int) and cut >= 0 else (len(raw) + cut if isinstance(cut, int)
                                                        else int(len(raw) * cut))
    ck.write_raw(raw[:at])


NOT_A_MAP = {"empty": b"", "list": tree_mod.pack([1, 2]), "int": tree_mod.pack(5),
             "str": tree_mod.pack("te-serial"), "nil": tree_mod.pack(None), "reserved-byte": b"\xc1",
             "ff": b"\xff" * 16}

NOT_BASE64 = ["!!!not base64!!!", "QUJD", "QUJ", "", "=" * 8, "\u00e9t\u00e9"]


def drop_single_file_manifest(path: Path) -> None:
    header, data = read_st(path)
    del header["__metadata__"][HEADER_KEY]
    path.write_bytes(st_bytes(header, data))


def set_single_file_manifest(path: Path, value: str) -> None:
    header, data = read_st(path)
    header["__metadata__"][HEADER_KEY] = value
    path.write_bytes(st_bytes(header, data))


HOSTILE_MSGPACK_PLACES = ["whole", "tree", "tensors", "tree-leaf"]


def hostile_msgpack(ck: Ck, kind: str, where: str) -> None:
    """Writes the hostile msgpack ``ABSURD[kind]`` as the whole manifest or inside it."""
    raw_value = ABSURD[kind]
    if where == "whole":
        data = raw_value
    elif where == "tree-leaf":  # inside the tree's map, not at the manifest's top level
        doc = ck.doc()
        tree = dict(doc.pop("tree"))
        tree.pop("step")
        inner = tree_mod.pack(tree)
        assert 0x80 <= inner[0] < 0x8f
        data = _with_raw_field(doc, "tree", bytes([inner[0] + 1]) + inner[1:] + tree_mod.pack("step") + raw_value)
    else:
        data = _with_raw_field(ck.doc(), where, raw_value)
    ck.write_raw(data)


def timestamp_in_tree(ck: Ck) -> None:
    ck.write_raw(_with_raw_field(ck.doc(), "tree", b"\xd6\xff\x00\x00\x00\x01"))


def nested_tuples_in_tree(ck: Ck, levels: int) -> None:
    ck.write_raw(_with_raw_field(ck.doc(), "tree", _nested_tuple_ext(levels)))


def missing_shard(ck: Ck) -> Path:
    shard = ck.file_of()
    shard.unlink()
    return shard


def manifest_is_a_directory(ck: Ck) -> Path:
    (ck.path / MANIFEST_NAME).unlink()
    (ck.path / MANIFEST_NAME).mkdir()
    return ck.path / MANIFEST_NAME


def manifest_is_a_fifo(ck: Ck) -> Path:
    fifo = ck.path / MANIFEST_NAME
    fifo.unlink()
    os.mkfifo(fifo)
    return fifo


def shard_is_a_directory(ck: Ck) -> Path:
    shard = ck.file_of()
    shard.unlink()
    shard.mkdir()
    ck.sync_sizes()
    return shard


def shard_is_a_fifo(ck: Ck) -> Path:
    shard = ck.file_of()
    shard.unlink()
    os.mkfifo(shard)
    ck.sync_sizes()
    return shard


def truncate_shard(ck: Ck, where: str, sync: bool) -> Path:
    """sync=True also fixes the manifest's file size, so the truncated file itself is parsed."""
    shard = ck.file_of()
    at = _truncation_points(shard)[where]
    with open(shard, "r+b") as f:
        f.truncate(at)
    if sync:
        ck.sync_sizes()
    return shard


def truncate_file(path: Path, where: str) -> None:
    at = _truncation_points(path)[where]
    with open(path, "r+b") as f:
        f.truncate(at)


def edit_shard_header(ck: Ck, edit: str) -> Path:
    """Applies ``SAFETENSORS_EDITS[edit]`` to the file holding ``T``'s ``B`` buffer."""
    path = ck.file_of()
    header, data = read_st(path)
    path.write_bytes(SAFETENSORS_EDITS[edit](header, data, key_of()))
    ck.sync_sizes()
    return path


def set_shard_entry(ck: Ck, field: str, value) -> Path:
    """A valid safetensors file whose entry for ``T``'s ``B`` buffer has another ``field``."""
    path = ck.file_of()
    header, data = read_st(path)
    header[key_of()][field] = value
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    return path


def rename_shard_key(ck: Ck) -> Path:
    path = ck.file_of()
    header, data = read_st(path)
    header["renamed"] = header.pop(key_of())
    path.write_bytes(st_bytes(header, data))
    ck.sync_sizes()
    return path


def shard_replaced_by_torch_save(ck: Ck) -> Path:
    """A torch.save (zip + pickle) file where a shard should be."""
    path = ck.file_of()
    torch.save({"x": torch.ones(3)}, path)
    ck.sync_sizes()
    return path


def alter_checksum(ck: Ck) -> None:
    ck.edit(lambda d: d["tensors"]["checksums"][_ti(d)].__setitem__(_bj(d), 0x0123456789ABCDEF))


class _Reduce:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


PICKLE_PAYLOAD = pickle.dumps(_Reduce(), protocol=2)


def pickle_as_buffer_data(ck: Ck) -> bytes:
    """Overwrites the plain tensor's bytes with a pickle; returns the bytes now stored."""
    path = ck.file_of(P, "data")
    header, data = read_st(path)
    start, end = header[key_of(P, "data")]["data_offsets"]
    payload = PICKLE_PAYLOAD[: end - start].ljust(end - start, b".")
    path.write_bytes(st_bytes(header, data[:start] + payload + data[end:]))
    ck.sync_sizes()
    return payload


def pickle_instead_of_checkpoint(ck: Ck) -> None:
    """A torch.save-like zip/pickle file as the single file, a pickle as the manifest."""
    if ck.is_dir:
        (ck.path / MANIFEST_NAME).write_bytes(b"\x80\x02" + PICKLE_PAYLOAD)
    else:
        ck.path.write_bytes(b"PK\x03\x04" + PICKLE_PAYLOAD)


FLIPPED_BUFFERS = [(T, B), (T, "_columnwise_scale_inv"), (P, "data"), ("blocks.0.w_fp4", "_amax_rowwise")]


# ================================================================================================
# HOSTILE: every case above that must be refused, flattened
# ================================================================================================
@dataclass(frozen=True)
class Hostile:
    """One damaged checkpoint: ``damage(ck)`` turns a copy of the golden checkpoint (``form``)
    into it; ``load_quantized(path, verify=verify)`` must raise ``exc``."""

    id: str
    form: str
    damage: Callable[[Ck], object] = field(repr=False)
    exc: type = CheckpointError
    verify: bool = False
    #: the damage edits the checksum column or buffer bytes: meaningless without checksums
    needs_checksums: bool = False
    marks: tuple = ()

    def param(self, *marks):
        return pytest.param(self, id=self.id, marks=(*self.marks, *marks))


def _manifest_edit(mutate):
    def damage(ck: Ck) -> None:
        doc = ck.doc()
        mutate(doc, ck)
        ck.write(doc)
    return damage


def _hostile() -> list[Hostile]:
    out: list[Hostile] = []
    both = ("dir", "file")

    def add(name, damage, exc, forms=both, **kw):
        for f in forms:
            out.append(Hostile(f"{name}-{f}", f, damage, exc, **kw))

    for p in MANIFEST_CASES:
        mutate, exc, form = p.values
        edits_sums = any(s in p.id for s in ("checksum", "buffer-missing-from-proto",
                                             "buffer-extra-in-proto", "alias-chained-same-proto"))
        out.append(Hostile(f"manifest-{p.id}", form, _manifest_edit(mutate), exc,
                           needs_checksums=edits_sums, marks=tuple(p.marks)))
    for cut in CUTS:
        add(f"manifest-truncated-{cut}", lambda ck, cut=cut: truncate_manifest(ck, cut), ManifestError)
    add("manifest-trailing-bytes", lambda ck: ck.write_raw(ck.raw() + b"\xc0"), ManifestError)
    for name, data in NOT_A_MAP.items():
        add(f"manifest-not-a-map-{name}", lambda ck, data=data: ck.write_raw(data), ManifestError)
    add("single-file-header-without-manifest", lambda ck: drop_single_file_manifest(ck.path),
        ManifestError, forms=("file",))
    for i, value in enumerate(NOT_BASE64):
        add(f"single-file-manifest-not-base64-{i}",
            lambda ck, value=value: set_single_file_manifest(ck.path, value), ManifestError, forms=("file",))
    for kind in ABSURD:
        for where in HOSTILE_MSGPACK_PLACES:
            add(f"msgpack-{kind}-{where}", lambda ck, kind=kind, where=where: hostile_msgpack(ck, kind, where),
                ManifestError)
    add("msgpack-timestamp-in-tree", timestamp_in_tree, ManifestError)
    add("msgpack-tuples-nested-100", lambda ck: nested_tuples_in_tree(ck, 100), ManifestError)
    add("msgpack-tuples-nested-100000", lambda ck: nested_tuples_in_tree(ck, 100_000), ManifestError,
        forms=("dir",))
    add("file-missing-shard", missing_shard, CheckpointFileError, forms=("dir",))
    add("file-missing-manifest", lambda ck: (ck.path / MANIFEST_NAME).unlink(), ManifestError, forms=("dir",))
    add("file-manifest-is-a-directory", manifest_is_a_directory, ManifestError, forms=("dir",))
    add("file-manifest-is-a-fifo", manifest_is_a_fifo, ManifestError, forms=("dir",))
    add("file-shard-is-a-directory", shard_is_a_directory, CheckpointFileError, forms=("dir",))
    add("file-shard-is-a-fifo", shard_is_a_fifo, CheckpointFileError, forms=("dir",))
    for where in TRUNCATIONS:
        for sync in (False, True):
            add(f"file-truncated-shard-{where}-{'size-synced' if sync else 'size-as-saved'}",
                lambda ck, where=where, sync=sync: truncate_shard(ck, where, sync), CheckpointFileError,
                forms=("dir",))
        add(f"file-truncated-{where}", lambda ck, where=where: truncate_file(ck.path, where),
            CheckpointFileError, forms=("file",))
    add("file-shard-is-torch-save", shard_replaced_by_torch_save, CheckpointFileError, forms=("dir",))
    add("file-pickle-instead-of-checkpoint", pickle_instead_of_checkpoint, ManifestError, forms=("dir",))
    add("file-pickle-instead-of-checkpoint", pickle_instead_of_checkpoint, CheckpointFileError, forms=("file",))
    for edit in SAFETENSORS_EDITS:
        add(f"header-{edit}", lambda ck, edit=edit: edit_shard_header(ck, edit), CheckpointFileError)
    add("header-dtype-vs-manifest", lambda ck: set_shard_entry(ck, "dtype", "U8"), TensorMismatchError)
    add("header-shape-vs-manifest", lambda ck: set_shard_entry(ck, "shape", [32, 128]), TensorMismatchError)
    add("header-key-missing", rename_shard_key, TensorMismatchError, forms=("dir",))
    for tensor, buffer in FLIPPED_BUFFERS:
        add(f"checksum-flipped-{tensor}.{buffer}", lambda ck, t=tensor, b=buffer: _flip_data_byte(ck, t, b),
            ChecksumError, verify=True, needs_checksums=True)
    add("checksum-altered-in-manifest", alter_checksum, ChecksumError, verify=True, needs_checksums=True)
    add("checksum-pickle-as-buffer-data", pickle_as_buffer_data, ChecksumError, forms=("dir",), verify=True,
        needs_checksums=True)
    ids = [h.id for h in out]
    assert len(ids) == len(set(ids)), "duplicate hostile case ids"
    return out


HOSTILE: list[Hostile] = _hostile()
