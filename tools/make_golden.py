"""Write te-serial's golden checkpoints (format v1) and their expected records.

    python tools/make_golden.py             # write the current format version's cases into
                                            # schema/golden/ (refuses to overwrite existing files)
    python tools/make_golden.py --force     # overwrite them (cases of older versions: never)
    python tools/make_golden.py --only NAME # just that case (repeatable; with --force to replace it)
    python tools/make_golden.py --check     # generate the current version's cases twice in temp dirs;
                                            # compare with each other and with schema/golden/, byte
                                            # for byte
    python tools/make_golden.py --out DIR   # write somewhere else

Golden files are the compatibility contract of format v1: every later te-serial must read them
and get exactly the buffers, dequantized values and tree recorded in ``<name>.expected.json``
(tests/test_golden.py checks this on every run). So they are written **once** and regenerated
only on purpose — a regeneration by a later te-serial is a new set of files, not a fix.

Every case is tagged with the format version it was frozen at (:data:`CASES`). Only the cases of
the current version (``te_serial.checkpoint.manifest.VERSION``) are ever generated or checked: a
newer writer no longer produces an older version's bytes (format 1.1 ends the manifest with a
``manifest_checksum`` and lays buffers out differently), so the older cases stay in this file
only as the record of how their files were made, and their files are never rewritten.

Everything is deterministic: the inputs come from a fixed integer hash of (seed, index) turned
into floats with exact IEEE arithmetic (no torch RNG, whose streams may change between torch
releases), names are fixed, and a directory checkpoint's random save id (which goes into its
shard names) is pinned to :data:`SAVE_ID` while it is written. A case with ``dcp_world`` is saved
by ``te_serial.dcp.save`` from that many spawned processes (gloo on CPU, :func:`dcp_save`), each
building the same full tensors and saving its ``DTensor`` part; the coordinator's save id is pinned
the same way. The manifest records the producer's versions (te-serial, torch, transformer_engine),
so byte-identity holds for one environment.

Expected record (``<name>.expected.json``): for a single file its size and xxh3_64; for a
directory (``"layout": "directory"``, from format 1.1) ``files``: name, size and xxh3_64 of the
manifest and of every shard, and ``shards``, the shard names in file-index order; the manifest's
format, version, producer and metadata, and (format 1.1) ``manifest_checksum`` and
``checksums`` (false when saved with ``checksums=False``); per tensor its prototype (shape,
dtype, requires_grad, quantizer fields, storage, scale_layout) and per buffer its key, shape,
dtype (te-serial name and safetensors code), the xxh3_64 of its bytes and, in a directory, the
shard that holds it (a chunked tensor's buffers: their region view and, per piece, key, box, shard
and xxh3_64); the xxh3_64 of ``t.dequantize(torch.float32)`` for quantized tensors, every NaN as
0x7FC00000 (:func:`digest_values`); and
the tree with every plain value in a typed JSON encoding: ``{"$tensor": flat name}``,
``{"$tuple": [...]}``, ``{"$dict": [[key, value], ...]}`` (key order and int keys kept),
``{"$float": float.hex()}``, ``{"$bytes": hex}``, ``{"$te_extra_state": <the decoded state in this
same encoding>}`` (msgpack ext type 3: a TE module's pickled ``_extra_state``, stored decoded);
ints, bools, None, str and lists as themselves. The digests are computed here from the tensors in
memory, independently of te-serial's reader and checksum code.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import pickle
import struct
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple
from unittest import mock

import msgpack
import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import te_serial as ts  # noqa: E402
from te_serial import errors as tse
from te_serial import formats as tsf  # noqa: E402
from te_serial.checkpoint import writer as _writer  # noqa: E402
from te_serial.checkpoint.manifest import HEADER_KEY, MANIFEST_NAME, VERSION  # noqa: E402
from te_serial.dtypes import _DTYPES, dtype_name, safetensors_code  # noqa: E402

GOLDEN_DIR = ROOT / "schema" / "golden"
EXPECTED_SCHEMA = "te-serial-golden-expected/1"
MASK32 = 0xFFFFFFFF
#: the save id written into a directory golden's shard names (random per save otherwise)
SAVE_ID = "0123abcd"
#: max_shard_size of ``dir_two_shards``: its NVFP4 tensor's rowwise buffers fill the first shard
DIR_SHARD_LIMIT = 8000


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


# --- format 1.1 cases ---------------------------------------------------------------------------

def case_dir_two_shards() -> dict:
    """A directory checkpoint in two shards (max_shard_size=DIR_SHARD_LIMIT): the NVFP4 tensor's
    rowwise buffers end the first shard, its columnwise buffers and both amaxes open the second."""
    return {
        "embed": {"weight": make_input((32, 64), 70, torch.bfloat16)},                  # 4096 B
        "layers": [{
            "weight": ts.NVFP4Quantizer()(make_input((64, 64), 71, torch.bfloat16, zero_tile=True,
                                                     outliers=True)),               # 2048+512 | 2048+512+4+4 B
            "proj": ts.MXFP8Quantizer(columnwise=False)(make_input((32, 64), 72, torch.bfloat16)),
            "bias": det_normal((64,), 73),
        }],
        "norm": {"weight": make_input((64,), 74, torch.bfloat16)},
        "step": 3,
    }


def case_tied_quantized() -> dict:
    """One quantized tensor object under two names (embedding and output head, a Parameter), a
    tied NVFP4 tensor at two list positions, an untied tensor of the same prototype, and a plain
    tied pair."""
    emb = param(ts.MXFP8Quantizer()(make_input((32, 64), 80, torch.bfloat16)))
    proj = ts.NVFP4Quantizer(columnwise=False)(make_input((16, 32), 81, torch.bfloat16))
    pos = det_normal((8, 16), 82)
    return {
        "embed": {"weight": emb},
        "layers": [{"proj": proj, "other": ts.MXFP8Quantizer()(make_input((32, 64), 83, torch.bfloat16))},
                   {"proj": proj}],
        "lm_head": {"weight": emb},
        "pos": {"weight": pos},
        "pos_out": {"weight": pos},
    }


def case_nvfp4_rht_columnwise() -> dict:
    """Columnwise-only NVFP4 with RHT (bf16 inputs, as TE requires): reading it needs the inverse
    Hadamard transform. ``rht`` has a post-RHT amax of 284 (and a zero 16x16 tile)."""
    Q = ts.NVFP4Quantizer
    kw = {"rowwise": False, "columnwise": True, "with_rht": True, "with_post_rht_amax": True}
    return {
        "rht": Q(**kw)(make_input((64, 64), 90, torch.bfloat16, scale=75.0, zero_tile=True)),
        "rht_no_sign_mask": Q(with_random_sign_mask=False, **kw)(make_input((32, 48), 91, torch.bfloat16)),
        "rht_3d": Q(**kw)(make_input((2, 16, 32), 92, torch.bfloat16, scale=7.0, outliers=True)),
    }


def case_grouped_moe() -> dict:
    """MoE experts packed in grouped tensors (format 1.3, TE's GroupedTensor): MXFP8 experts of one
    shape, rowwise NVFP4 experts with different row counts, columnwise current-scaling FP8 experts
    with different column counts, blockwise FP8 experts of different shapes, plain BF16 experts."""
    G = tsf.GroupedTensor.from_members
    mx, nv = ts.MXFP8Quantizer(), ts.NVFP4Quantizer(columnwise=False)
    cs, bw = ts.Float8CurrentScalingQuantizer(rowwise=False), ts.Float8BlockQuantizer(block_scaling_dim=2)
    return {"model": {"layers": [{"mlp": {"experts": {
        "linear_fc1": {"weight": G([mx(make_input((32, 64), 110 + i, zero_tile=i == 0, tiny_tile=i == 1,
                                                  outliers=i == 2)) for i in range(3)])},
        "linear_fc2": {"weight": G([nv(make_input((r, 32), 120 + i, outliers=True)) for i, r in enumerate((32, 16, 48))])},
    }}}, {"mlp": {"experts": {
        "linear_fc1": {"weight": G([cs(make_input((32, c), 130 + i)) for i, c in enumerate((48, 16))])},
        "linear_fc2": {"weight": G([bw(make_input(s, 140 + i, zero_tile=i == 0)) for i, s in enumerate(((40, 24), (8, 130)))])},
        "bias": G([make_input((16,), 150 + i) for i in range(4)]),
    }}}]}}


def case_grouped_transposed() -> dict:
    """gpt-oss-style expert stacks [experts, in, out] (format 1.4's ``transposed`` groups): each member
    is its expert's transpose, quantized as TE's [out, in] weight; MXFP8 and NVFP4 experts of very
    different magnitudes, one of them all zero."""
    from te_serial.formats.grouped import per_expert
    out = {}
    for name, q, shape in (("gate_up_proj", ts.MXFP8Quantizer(columnwise=False), (3, 32, 64)),
                           ("down_proj", ts.NVFP4Quantizer(columnwise=False), (3, 32, 16))):
        x = torch.stack([make_input(shape[1:], 160 + i, outliers=True) * 10.0 ** (2 * i - 2) for i in range(shape[0])])
        x[1].zero_()
        out[name] = per_expert(q, shape, transposed=True).quantize(x)
    return {"model": {"layers": [{"mlp": {"experts": out}}]}}


def case_mxfp4() -> dict:
    """MXFP4 (format 1.5, schema/README.md §7.5; no TE class): rowwise 2-D and 3-D, columnwise only,
    both usages; blocks at E8M0's ends (0: all zero and 2^-127-scaled, 254: ±inf), every E2M1 tie,
    -0.0; and gpt-oss-style expert stacks (a transposed group of MXFP4 members)."""
    from te_serial.formats.grouped import per_expert
    Q = ts.MXFP4Quantizer
    edges = make_input((32, 128), 210, torch.float32)
    edges[:, :32] = 0.0                                   # byte 0, codes 0
    edges[:, 32:64] *= 2.0 ** -126                        # byte 0 (2^-127), non-zero codes
    edges[0, 64], edges[1, 65] = float("inf"), float("-inf")  # byte 254 in rows 0 and 1
    edges[2, 96:104] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # the ties under 2^0
    edges[3, 96:98] = torch.tensor([6.0, -0.0])
    experts = torch.stack([make_input((64, 32), 211 + i, outliers=True) * 10.0 ** (2 * i - 2) for i in range(3)])
    experts[1].zero_()
    return {"layers": [{"weight": Q()(make_input((64, 96), 212, torch.bfloat16, outliers=True)),
                        "weight_3d": Q()(make_input((2, 32, 64), 213, torch.float16))}],
            "columnwise_only": Q(rowwise=False, columnwise=True)(make_input((64, 32), 214, torch.bfloat16)),
            "both": Q(columnwise=True)(make_input((32, 64), 215, torch.bfloat16, zero_tile=True, tiny_tile=True)),
            "edges": Q()(edges),
            "model": {"layers": [{"mlp": {"experts": {
                "gate_up_proj": per_expert(Q(), (3, 64, 32), transposed=True).quantize(experts)}}}]}}


def case_nvfp4_row_scaled() -> dict:
    """Row-scaled NVFP4 (format 1.3): ``_amax_rowwise`` holds one amax per row; rowwise only. An
    all-zero row (amax 0), a zero tile, a 2^-100 tile and outliers; 3-D fp32; with 4over6 (MSE, 256)."""
    Q = ts.NVFP4Quantizer
    x = make_input((32, 32), 160, torch.bfloat16, zero_tile=True, tiny_tile=True, outliers=True)
    x[20] = 0.0
    return {
        "layers": [{"act": Q(row_scaled_nvfp4=True, columnwise=False)(x)}],
        "proj": Q(row_scaled_nvfp4=True, columnwise=False)(make_input((2, 16, 32), 161, torch.float32, scale=7.0)),
        "four_over_six": Q(row_scaled_nvfp4=True, columnwise=False, nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                           nvfp4_4over6_err_mode="MSE")(make_input((16, 48), 162, torch.float16, outliers=True)),
    }


def case_nvfp4_4over6() -> dict:
    """4over6 NVFP4 (format 1.3): TE's 4over6 weight recipe (16x16 tiles, MAE, E4M3 bound 256), and
    1x16 / MSE / bound 448, rowwise-only and columnwise-only tensors."""
    Q = ts.NVFP4Quantizer
    four = {"nvfp4_use_4over6": True}
    return {
        "layers": [{"weight": Q(with_2d_quantization=True, nvfp4_e4m3_max=256, **four)(
            make_input((32, 32), 170, torch.bfloat16, zero_tile=True, tiny_tile=True, outliers=True))}],
        "mse_448": Q(nvfp4_4over6_err_mode="MSE", **four)(make_input((2, 16, 32), 171, torch.float32, scale=7.0)),
        "columnwise_only": Q(rowwise=False, with_2d_quantization=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MSE",
                             **four)(make_input((32, 16), 172, torch.float16)),
        "rowwise_only": Q(columnwise=False, nvfp4_e4m3_max=256, **four)(make_input((16, 32), 173, torch.bfloat16)),
    }


def case_mxfp8_e8m0_edges() -> dict:
    """MXFP8 scale bytes at the ends of E8M0 (schema/README.md §7.2): 0 (2^-127) for fp32 blocks whose
    amax / fp8_max is at most 2^-127 (non-zero codes, E4M3 and E5M2) and for all-zero blocks (zero
    codes), 254 for blocks holding +-inf (codes +-448, values +-inf), and 255 (NaN) in a stored scale.
    TE never computes 255 (its block amax ignores NaN, as te-serial's does), so those two tensors are
    built from buffers, as a checkpoint may hold them: a quantized tensor's bytes with one scale byte
    set to 255. Rowwise and columnwise-only."""
    Q = ts.MXFP8Quantizer
    x = make_input((32, 64), 200, torch.float32)
    x[:, :32] *= 2.0 ** -125      # amax / 448 <= 2^-132: E = 0 in both usages, codes x * 2^127
    x[:, 32:] = 0.0               # all zero: E = 0, codes 0
    x[0, 0], x[1, 1] = float("inf"), float("-inf")  # E = 254 (rows 0, 1; columns 0, 1), codes +-448
    y = make_input((32, 32), 201, torch.float32) * 2.0 ** -120  # E5M2: amax / 57344 < 2^-127
    out = {"zero_scale": Q()(x), "zero_scale_columnwise": Q(rowwise=False)(x),
           "zero_scale_e5m2": Q(E5M2, columnwise=False)(y)}
    for name, q, scale, cell in (("nan_scale", Q(columnwise=False), "_rowwise_scale_inv", (3, 0)),
                                 ("nan_scale_columnwise", Q(rowwise=False), "_columnwise_scale_inv", (0, 5))):
        t = q(make_input((32, 32), 202, torch.bfloat16))
        bufs = {n: b.clone() for n, b in t.buffers().items()}
        bufs[scale].view(torch.uint8)[cell] = 255
        out[name] = type(t)(tuple(t.shape), t.dtype, q, **bufs)
    return out


def case_dcp_two_ranks() -> dict:
    """What ``te_serial.dcp.save`` writes from 2 processes (format 1.2's chunked tensors, written by
    the 1.3 writer): the full tensors built here, each process saving its part (:data:`DCP_SHARDS`:
    a ``DTensor`` ``Shard(dim)`` of the block-aligned slice), the rest replicated. Transposed data on
    square and non-square tensors (per-tensor FP8 ``_transpose``, blockwise and NVFP4
    ``_columnwise_data``), scales stored transposed, a 3-D tensor, column shards, row-scaled NVFP4's
    per-row amax in row ranges, a grouped tensor (one piece per packed buffer), a plain tensor in
    two pieces and one stored whole."""
    F, MX, BW, NV = ts.Float8CurrentScalingQuantizer, ts.MXFP8Quantizer, ts.Float8BlockQuantizer, ts.NVFP4Quantizer
    nv_rows = NV(columnwise=False)
    return {"model": {
        "fp8": {"square": F()(make_input((32, 32), 180, zero_tile=True)),
                "tall": F()(make_input((48, 16), 181, outliers=True)),
                "delayed_3d": ts.Float8Quantizer(scale=0.5, amax=3.0, fp8_dtype=E5M2)(
                    make_input((2, 8, 16), 182, torch.float32)),
                "cols": F()(make_input((32, 32), 183))},
        "mxfp8": {"square": MX()(make_input((64, 64), 184, tiny_tile=True)),
                  "tall_columnwise": MX(rowwise=False)(make_input((64, 32), 185))},
        "blockwise": {"tall_2d": BW()(make_input((256, 16), 186, zero_tile=True)),
                      "rows_1x128": BW(block_scaling_dim=1, columnwise=False)(make_input((32, 128), 187))},
        "nvfp4": {"square": NV()(make_input((32, 32), 188, zero_tile=True)),
                  "tall": NV()(make_input((64, 32), 189, outliers=True)),
                  "row_scaled": NV(row_scaled_nvfp4=True, columnwise=False)(make_input((64, 32), 190, tiny_tile=True)),
                  "cols": NV()(make_input((32, 64), 191))},
        "experts": tsf.GroupedTensor.from_members([nv_rows(make_input((r, 32), 192 + i))
                                                   for i, r in enumerate((16, 32))]),
        "bias": det_normal((32,), 194),
        "norm": make_input((16,), 195)},
        "step": 3}


#: dcp_two_ranks: flat name → the dim each process holds a range of (``Shard(dim)``); other tensors are
#: replicated (every process holds them whole)
DCP_SHARDS = {"model.fp8.square": 0, "model.fp8.tall": 0, "model.fp8.delayed_3d": 0, "model.fp8.cols": 1,
              "model.mxfp8.square": 0, "model.mxfp8.tall_columnwise": 0, "model.blockwise.tall_2d": 0,
              "model.blockwise.rows_1x128": 0, "model.nvfp4.square": 0, "model.nvfp4.tall": 0,
              "model.nvfp4.row_scaled": 0, "model.nvfp4.cols": 1, "model.bias": 0}


def case_no_checksums() -> dict:
    """Saved with checksums=False: the manifest's tensors.checksums is nil."""
    return {
        "weight": ts.Float8BlockQuantizer(block_scaling_dim=1)(make_input((16, 128), 100, torch.bfloat16)),
        "bias": det_normal((16,), 101),
        "step": 7,
    }


class PickledExtraState:
    """Where the generator put a TE ``_extra_state`` pickle: the state as it must decode (recipe as
    plain data, enum members as ``{"__enum__", "name"}``), holding the very tensors pickled."""

    def __init__(self, payload: torch.Tensor, state: dict) -> None:
        self.payload = payload  # kept alive, so its id is never reused while registered
        self.state = state


#: id(payload tensor) → the state it must decode to (filled by the cases that pickle one)
_EXTRA_STATES: dict[int, PickledExtraState] = {}


def _te_recipe_module():
    """TE's real ``transformer_engine.common.recipe`` (through tests/te_shim.py on CPU)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import te_shim
    finally:
        sys.path.remove(str(ROOT / "tests"))
    if te_shim.install() is None:
        raise SystemExit("extra_state_enum needs the transformer-engine wheel (pip install -e '.[test]')")
    import transformer_engine.common.recipe as recipe
    return recipe


def _plain_recipe(obj: Any) -> dict:
    """The decoded form of a TE recipe object, built here from its instance dict."""
    import enum

    def conv(v):
        if isinstance(v, enum.Enum):
            return {"__enum__": type(v).__name__, "name": v.name}
        return v

    return {"__class__": type(obj).__name__, "fields": {k: conv(v) for k, v in vars(obj).items()}}


def te_pickled_extra_state(state: dict) -> torch.Tensor:
    """TE's ``get_extra_state`` bytes for ``state`` (``pickle.dumps`` into a uint8 tensor)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    decoded = dict(state, recipe=_plain_recipe(state["recipe"]))
    _EXTRA_STATES[id(payload)] = PickledExtraState(payload, decoded)
    return payload


def case_extra_state_enum() -> dict:
    """A TE module's state dict: a delayed-scaling ``_extra_state`` (TE's real pickle, with the enum
    ``fp8_format=Format.E4M3``) stored as msgpack ext type 3, and a stateless one (empty, kept plain)."""
    recipe = _te_recipe_module()
    rec = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=4,
                                amax_compute_algo="most_recent")
    assert isinstance(rec.fp8_format, recipe.Format)
    state = {
        "recipe": rec,
        "scale_fwd": det_normal((3,), 110).abs(),
        "amax_history_fwd": det_normal((4, 3), 111).abs(),
        "scale_bwd": det_normal((2,), 112).abs(),
        "amax_history_bwd": det_normal((4, 2), 113).abs(),
        "extra_fp8_variables": {"num_gemms": 3, "fp8_checkpoint": True, "fp8_max_fwd": 448.0,
                                "name": "fc1", "fp8_group_sizes": (1, 2), "gemm_ids": [0, 1, 2]},
    }
    x = make_input((32, 64), 114, torch.bfloat16)
    amax = float(x.float().abs().amax())
    return {
        "fc1.weight": ts.Float8Quantizer(scale=448.0 / amax, amax=amax)(x),
        "fc1.bias": make_input((32,), 115, torch.bfloat16),
        "fc1._extra_state": te_pickled_extra_state(state),
        "fc2.weight": make_input((16, 32), 116, torch.bfloat16),
        "fc2._extra_state": torch.empty(0, dtype=torch.uint8),  # a stateless recipe's
    }


class Case(NamedTuple):
    build: Callable[[], dict]
    description: str
    #: the format version the case was frozen at; only the current version's cases are generated
    version: tuple[int, int]
    #: a directory checkpoint (else one .safetensors file)
    directory: bool = False
    #: save_quantized keyword arguments
    save: dict = {}
    #: saved by ``te_serial.dcp.save`` from this many processes (gloo on CPU), each holding the parts
    #: ``shards`` (flat name → dim) gives it; 0: ``save_quantized``
    dcp_world: int = 0
    shards: dict = {}


# The ten (1, 0) cases wrote the files frozen at format 1.0. They stay here as the record of how
# those files were made, but are never generated again: the 1.1 writer cannot reproduce their bytes
# (the manifest now ends with its checksum, and buffers are laid out by item size), and the files
# must stay exactly as they are (tests/test_golden.py).
CASES: dict[str, Case] = {
    "fp8_delayed": Case(case_fp8_delayed, "per-tensor FP8, delayed scaling (scale/amax in the quantizer)", (1, 0)),
    "fp8_current_e4m3": Case(case_fp8_current_e4m3, "per-tensor FP8 current scaling, E4M3", (1, 0)),
    "fp8_current_e5m2": Case(case_fp8_current_e5m2, "per-tensor FP8 current scaling, E5M2 (flat dict: no tree)",
                             (1, 0)),
    "mxfp8_1x32": Case(case_mxfp8_1x32, "MXFP8, 1x32 blocks", (1, 0)),
    "mxfp8_2d": Case(case_mxfp8_2d, "MXFP8, 32x32 tiles (with_2d_quantization)", (1, 0)),
    "fp8_blockwise_1d": Case(case_fp8_blockwise_1d, "blockwise FP8, 1x128 blocks", (1, 0)),
    "fp8_blockwise_2d": Case(case_fp8_blockwise_2d, "blockwise FP8, 128x128 blocks (flat dict: no tree)", (1, 0)),
    "nvfp4_1d": Case(case_nvfp4_1d, "NVFP4, 1x16 blocks (+ RHT tensors)", (1, 0)),
    "nvfp4_2d": Case(case_nvfp4_2d, "NVFP4, 16x16 tiles (with_2d_quantization; flat dict: no tree)", (1, 0)),
    "mixed": Case(case_mixed, "plain tensors of every dtype, edge-case tensors, nested tree of plain values", (1, 0)),
    # format 1.1
    "dir_two_shards": Case(case_dir_two_shards, "directory checkpoint, two shards, an NVFP4 tensor's buffers "
                           f"in both (max_shard_size={DIR_SHARD_LIMIT})", (1, 1), directory=True,
                           save={"max_shard_size": DIR_SHARD_LIMIT}),
    "tied_quantized": Case(case_tied_quantized, "tied quantized tensors (MXFP8 parameter, NVFP4) and a tied "
                           "plain pair", (1, 1)),
    "nvfp4_rht_columnwise": Case(case_nvfp4_rht_columnwise, "columnwise-only NVFP4 with RHT (inverse Hadamard "
                                 "transform to read)", (1, 1)),
    "no_checksums": Case(case_no_checksums, "saved with checksums=False (tensors.checksums is nil)", (1, 1),
                         save={"checksums": False}),
    "extra_state_enum": Case(case_extra_state_enum, "TE delayed-scaling _extra_state (msgpack ext type 3) with "
                             "an enum-valued recipe field", (1, 1)),
    # format 1.3
    "nvfp4_row_scaled": Case(case_nvfp4_row_scaled, "row-scaled NVFP4 (one amax per row, rowwise only; with "
                             "4over6 too)", (1, 3)),
    "nvfp4_4over6": Case(case_nvfp4_4over6, "4over6 NVFP4: 16x16 tiles with E4M3 bound 256 (TE's recipe), 1x16 "
                         "MSE with 448, rowwise-only and columnwise-only", (1, 3)),
    "grouped_moe": Case(case_grouped_moe, "grouped (MoE) tensors: MXFP8, NVFP4, current-scaling FP8, blockwise FP8 "
                        "and plain BF16 experts, equal and different member shapes", (1, 3)),
    "mxfp8_e8m0_edges": Case(case_mxfp8_e8m0_edges, "MXFP8 with E8M0 scale bytes 0 (2^-127), 254 and 255 (NaN), "
                             "rowwise and columnwise", (1, 3)),
    # format 1.4
    "grouped_transposed": Case(case_grouped_transposed, "grouped tensors of [in, out] expert stacks (gpt-oss), each "
                               "member stored transposed: MXFP8 and NVFP4", (1, 4)),
    # format 1.5
    "mxfp4": Case(case_mxfp4, "MXFP4 (no TE class): rowwise, columnwise, both, E8M0 edge bytes 0 and 254, E2M1 "
                  "ties, and a transposed group of MXFP4 experts (gpt-oss)", (1, 5)),
    "dcp_two_ranks": Case(case_dcp_two_ranks, "te_serial.dcp.save from 2 processes: chunked tensors (format 1.2) of "
                          "every format, row and column shards, transposed buffers on square and non-square "
                          "tensors, a grouped tensor, row-scaled NVFP4", (1, 3), directory=True, dcp_world=2,
                          shards=DCP_SHARDS),
}


def current_cases() -> list[str]:
    """The cases this te-serial writes: those frozen at the current format version."""
    return [n for n, c in CASES.items() if c.version == VERSION]


def outputs(name: str, out_dir: Path) -> tuple[Path, Path]:
    """(checkpoint path, expected record path) of a case."""
    case = CASES[name]
    ckpt = out_dir / (name if case.directory else f"{name}.safetensors")
    return ckpt, out_dir / f"{name}.expected.json"


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


def expand_extra_states(obj: Any, found: list | None = None) -> Any:
    """``obj`` with every TE ``_extra_state`` pickle made by :func:`te_pickled_extra_state` replaced
    by its :class:`PickledExtraState` (what the checkpoint stores in its place: the decoded state,
    whose tensors are named under the payload's path)."""
    if isinstance(obj, torch.Tensor) and id(obj) in _EXTRA_STATES:
        extra = _EXTRA_STATES[id(obj)]
        assert extra.payload is obj
        if found is not None:
            found.append(extra)
        return extra
    if isinstance(obj, dict):
        return {k: expand_extra_states(v, found) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(expand_extra_states(v, found) for v in obj)
    if isinstance(obj, list):
        return [expand_extra_states(v, found) for v in obj]
    return obj


def encode_value(v: Any, path: tuple = ()) -> Any:
    """The typed JSON form of a tree; a tensor becomes its flat name (its path joined by dots)."""
    if isinstance(v, (torch.Tensor, tsf.QuantizedTensorStorage)):
        return {"$tensor": ".".join(map(str, path))}
    if isinstance(v, PickledExtraState):  # msgpack ext type 3
        return {"$te_extra_state": encode_value(v.state, path)}
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
    if isinstance(obj, (torch.Tensor, tsf.QuantizedTensorStorage)):
        out.setdefault(id(obj), ".".join(map(str, path)))
    elif isinstance(obj, PickledExtraState):
        out.update((i, n) for i, n in _flat_names(obj.state, path).items() if i not in out)
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
    if isinstance(obj, (torch.Tensor, tsf.QuantizedTensorStorage)):
        return [(".".join(map(str, path)), obj)]
    if isinstance(obj, PickledExtraState):
        return _all_tensors(obj.state, path)
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _all_tensors(v, path + (k,))]
    if isinstance(obj, (list, tuple)):
        return [x for j, v in enumerate(obj) for x in _all_tensors(v, path + (j,))]
    return []


def digest_values(t: torch.Tensor) -> str:
    """``dequantized_float32_xxh3_64``: XXH3-64 of fp32 values (little-endian, C order), every NaN
    written as 0x7FC00000 (a NaN's sign and payload are not part of the format; schema/README.md §11)."""
    bits = t.detach().to(torch.float32).contiguous().view(torch.int32)
    return digest(torch.where(torch.isnan(t.detach().float()), torch.full_like(bits, 0x7FC00000), bits))


#: schema/README.md §13: (rows, columns) of one block of each block-scale buffer, and whether the
#: scale is stored transposed; key (kind, block_scaling_dim or None, buffer)
SCALE_GRIDS = {
    ("mxfp8", None, "_rowwise_scale_inv"): (1, 32, False), ("mxfp8", None, "_columnwise_scale_inv"): (32, 1, False),
    ("fp8_blockwise", 1, "_rowwise_scale_inv"): (1, 128, True),
    ("fp8_blockwise", 1, "_columnwise_scale_inv"): (128, 1, False),
    ("fp8_blockwise", 2, "_rowwise_scale_inv"): (128, 128, False),
    ("fp8_blockwise", 2, "_columnwise_scale_inv"): (128, 128, True),
    ("nvfp4", None, "_rowwise_scale_inv"): (1, 16, False), ("nvfp4", None, "_columnwise_scale_inv"): (16, 1, True),
}


def region_view(shape, q: dict | None, bname: str, stored) -> list[int]:
    """The region view R of buffer ``bname`` (stored shape ``stored``) of a tensor of ``shape`` with
    quantizer fields ``q`` (None: plain), by schema/README.md §13's table alone."""
    if q is None or q["kind"] == "grouped":  # a plain tensor's S; a grouped tensor's packed 1-D buffer
        return list(stored)
    kind, m, k = q["kind"], math.prod(shape[:-1]), shape[-1]
    p = 2 if kind == "nvfp4" else 1
    if bname in ("_data", "_rowwise_data") or (kind == "mxfp8" and bname == "_columnwise_data"):
        return [m, k // p]
    if bname in ("_transpose", "_columnwise_data"):
        return [k, m // p]
    if bname == "_amax_rowwise" and q.get("row_scaled_nvfp4"):
        return [m]
    grid = SCALE_GRIDS.get((kind, q.get("block_scaling_dim"), bname))
    if grid is None:  # tensor-wide: per-tensor FP8 _scale_inv, NVFP4 tensor amax
        return list(stored)
    r, c, transposed = grid
    cells = [-(-m // r), -(-k // c)]
    return cells[::-1] if transposed else cells


def _region(buf: torch.Tensor, view: list[int]) -> torch.Tensor:
    """Buffer ``buf``'s region view: a reshape, or the top-left corner of a padded scale."""
    full = view if math.prod(view) == buf.numel() else list(buf.shape)
    return buf.reshape(full)[tuple(slice(0, v) for v in view)]


def _buffer_record(key: str, stored: torch.Tensor, pieces=None, view=None) -> dict:
    rec = {"key": key, "shape": list(stored.shape), "dtype": dtype_name(stored.dtype),
           "safetensors_dtype": safetensors_code(stored.dtype), "xxh3_64": digest(stored)}
    if pieces is not None:  # chunked: each piece's box of the region view, computed here
        region = _region(stored, view)
        rec["region"] = list(view)
        rec["pieces"] = []
        for f, k, offsets, sizes, checksum in pieces:
            box = region[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
            d = digest(box)
            assert d == f"xxh3_64:{checksum:016x}", (key, offsets, d)
            rec["pieces"].append({"key": k, "offsets": list(offsets), "sizes": list(sizes), "file": f, "xxh3_64": d})
    return rec


def tensor_record(name: str, t: Any, manifest_entry, pieces=None) -> dict:
    """What a reader must find for one tensor, computed from the tensor in memory. ``pieces``: a
    chunked tensor's (buffer, region view, dtype, pieces) from the manifest, as ``Manifest.pieces``."""
    first_key = {b: e.key for b, e in manifest_entry.buffers.items()}
    chunks = {b: (list(view), pcs) for b, view, _, pcs in pieces} if pieces is not None else {}
    if isinstance(t, tsf.QuantizedTensorStorage):
        q = t.quantizer
        values = q.value_dtypes()
        buffers = {}
        for bname, b in t.buffers().items():
            stored = b.view(values[bname])
            view, pcs = chunks.get(bname, (None, None))
            if view is not None:
                assert view == region_view(list(t.shape), q.to_dict(), bname, stored.shape), (name, bname, view)
            buffers[bname] = _buffer_record(first_key[bname], stored, pcs, view)
        return {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                "requires_grad": bool(getattr(t, "requires_grad", False)),
                "quantizer": q.to_dict(), "storage": type(t).__name__, "scale_layout": "compact",
                "buffers": buffers, "dequantized_float32_xxh3_64": digest_values(t.dequantize(torch.float32))}
    view, pcs = chunks.get("data", (None, None))
    if view is not None:
        assert view == list(t.shape), (name, view)
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "requires_grad": bool(t.requires_grad),
            "quantizer": None, "storage": None, "scale_layout": None,
            "buffers": {"data": _buffer_record(first_key["data"], t.detach(), pcs, view)}}


@contextlib.contextmanager
def fixed_save_id():
    """Pin the writer's per-save random id (it goes into shard names) to :data:`SAVE_ID`. Only
    the writer's own ``secrets`` is replaced: temporary file names stay random."""
    calls = []

    def token_hex(nbytes=None):
        calls.append(nbytes)
        return SAVE_ID

    with mock.patch.object(_writer, "secrets", types.SimpleNamespace(token_hex=token_hex)):
        yield calls
    assert calls == [4], f"the writer drew its save id {len(calls)} times, not once: {calls}"


def read_raw_manifest(path: Path) -> bytes:
    """The manifest's msgpack bytes, read without te-serial (schema/README.md §1)."""
    if path.is_dir():
        return (path / MANIFEST_NAME).read_bytes()
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return base64.b64decode(header["__metadata__"][HEADER_KEY], validate=True)


def manifest_checksum(raw: bytes) -> int:
    """A format 1.1 manifest's checksum, checked here: the last field is ``manifest_checksum``, a
    uint64 (0xcf + 8 bytes, big-endian) equal to XXH3-64 of every byte before those 8."""
    trailer = msgpack.packb("manifest_checksum") + b"\xcf"
    assert raw[-8 - len(trailer):-8] == trailer, "manifest does not end with its manifest_checksum"
    value = int.from_bytes(raw[-8:], "big")
    assert value == xxhash.xxh3_64_intdigest(raw[:-8]), "manifest_checksum does not match"
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    assert list(doc)[-1] == "manifest_checksum" and doc["manifest_checksum"] == value
    return value


def write_case(name: str, out_dir: Path) -> tuple[Path, Path]:
    case = CASES[name]
    if case.version != VERSION:
        raise ValueError(f"golden case {name!r} is frozen at format {case.version[0]}.{case.version[1]}; this "
                         f"te-serial writes {VERSION[0]}.{VERSION[1]} and never regenerates older cases")
    obj = case.build()
    extra_states: list[PickledExtraState] = []
    expanded = expand_extra_states(obj, extra_states)
    path, exp = outputs(name, out_dir)
    metadata = {"golden": name, "description": case.description}
    if case.dcp_world:
        dcp_save(name, path, metadata)
        with ts.open(path) as ckpt:
            manifest = ckpt.manifest
    else:
        with fixed_save_id() if case.directory else contextlib.nullcontext():
            manifest = ts.save_quantized(obj, path, metadata=metadata, **case.save)
    assert tuple(manifest.version) == case.version, (name, manifest.version)
    ids = _flat_names(expanded)
    tensors = {}
    for flat, t in _all_tensors(expanded):
        if flat in tensors:
            continue
        entry = manifest.tensors[flat]
        chunked = bool(manifest.chunks) and manifest.is_chunked(flat)
        tensors[flat] = tensor_record(flat, t, entry, manifest.pieces(flat) if chunked else None)
        first = ids[id(t)]  # a tied tensor uses the keys of its first name
        for bname, b in tensors[flat]["buffers"].items():
            assert b["key"] == (first if bname == "data" else f"{first}.{bname}"), (flat, bname, b["key"])
            if case.directory and not chunked:
                b["file"] = entry.buffers[bname].file
    assert list(tensors) == list(manifest.tensors), "tensor order differs from the manifest's"
    raw = read_raw_manifest(path)
    record = {"schema": EXPECTED_SCHEMA, "name": name, "description": case.description}
    if case.directory:
        shards = list(manifest.files)
        assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST_NAME, *shards]), \
            f"{path} holds other files than its manifest and shards"
        assert all(s.startswith(f"model-{SAVE_ID}-") for s in shards), shards
        files = []
        for f in [MANIFEST_NAME, *shards]:
            data = (path / f).read_bytes()
            files.append({"name": f, "bytes": len(data), "xxh3_64": digest_bytes(data)})
            if f != MANIFEST_NAME:
                assert len(data) == manifest.files[f], (f, len(data), manifest.files[f])
        record.update({"file": path.name, "layout": "directory", "files": files, "shards": shards})
    else:
        data = path.read_bytes()
        record.update({"file": path.name, "layout": "file", "file_bytes": len(data),
                       "file_xxh3_64": digest_bytes(data)})
    record.update({
        "format": "te-serial",
        "version": list(manifest.version),
        "producer": manifest.producer,
        "metadata": metadata,
        "manifest_checksum": f"xxh3_64:{manifest_checksum(raw):016x}",
        "checksums": case.save.get("checksums", True),
        "tensors": tensors,
        "tree": encode_value(expanded),
    })
    exp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _self_check(path, record, extra_states)
    CASE_CHECKS.get(name, lambda *a: None)(path, record, manifest)
    return path, exp


# --- te_serial.dcp.save from several processes ----------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_part(full: Any, dim: int, world: int, rank: int) -> Any:
    """``rank``'s part of ``full`` sharded on ``dim`` (``Shard(dim)``): a quantized tensor's block-aligned
    slice (``slice_quantized``, which keeps the parent's tensor-wide scale / amax), a plain tensor's range."""
    from torch.distributed.tensor import Shard
    from te_serial.formats.slicing import slice_quantized
    shape = tuple(full.shape)
    size, off = Shard.local_shard_size_and_offset(shape[dim], world, rank)
    local_shape = tuple(size if d == dim else n for d, n in enumerate(shape))
    if not isinstance(full, tsf.QuantizedTensorStorage):
        return full.narrow(dim, off, size).clone()
    if dim == 0:
        inner = math.prod(shape[1:-1])
        part = slice_quantized(full, rows=(off * inner, (off + size) * inner))
    else:
        assert dim == len(shape) - 1, dim
        part = slice_quantized(full, cols=(off, off + size))
    specs = full.quantizer.describe_buffers(local_shape)
    return type(full)(local_shape, full.dtype, full.quantizer,
                      **{n: b.reshape(specs[n].shape) for n, b in part.buffers().items()})


def _sharded(obj: Any, shards: dict, world: int, rank: int, mesh, path: tuple = ()) -> Any:
    """``obj`` with every tensor named in ``shards`` replaced by a DTensor of this rank's part."""
    from torch.distributed.tensor import DTensor, Shard
    if isinstance(obj, dict):
        return {k: _sharded(v, shards, world, rank, mesh, path + (k,)) for k, v in obj.items()}
    name = ".".join(map(str, path))
    if name not in shards:
        return obj
    dim = shards[name]
    return DTensor.from_local(_local_part(obj, dim, world, rank), mesh, [Shard(dim)], run_check=False,
                              shape=obj.shape, stride=torch.empty(obj.shape, device="meta").stride())


def _dcp_rank(rank: int, world: int, port: int, name: str, path: str, metadata: dict, errors: str) -> None:
    """One process of a DCP golden: builds the case's full tensors, saves its part of them."""
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import te_serial.dcp as tdcp
        import te_serial.dcp.storage as dcp_storage
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (world,))
        case = CASES[name]
        state = _sharded(case.build(), case.shards, world, rank, mesh)
        # the coordinator draws the save id (it goes into every rank's shard names): pinned to SAVE_ID
        with mock.patch.object(dcp_storage, "secrets", types.SimpleNamespace(token_hex=lambda nbytes=None: SAVE_ID)):
            tdcp.save(state, path, metadata=metadata)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        import traceback
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def dcp_save(name: str, path: Path, metadata: dict) -> None:
    """Save case ``name`` with ``te_serial.dcp.save`` from ``dcp_world`` processes (gloo on CPU)."""
    import torch.multiprocessing as mp
    world = CASES[name].dcp_world
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as errors:
        procs = [ctx.Process(target=_dcp_rank, args=(r, world, port, name, str(path), metadata, errors))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(300)
        failed = [(r, proc.exitcode) for r, proc in enumerate(procs) if proc.exitcode != 0]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if failed:
            reports = "\n".join(p.read_text() for p in sorted(Path(errors).iterdir()))
            raise RuntimeError(f"DCP save of {name} failed on ranks {failed}:\n{reports}")


def _check_dcp_two_ranks(path: Path, record: dict, manifest) -> None:
    """Every quantized tensor is chunked; each sharded tensor has a piece from each process (in its
    own shard file) in every buffer that is not tensor-wide; the grouped tensor one piece per
    buffer; the replicated plain tensor is stored whole."""
    shards = record["shards"]
    assert len(shards) == 2, shards
    for n, t in record["tensors"].items():
        pieces = {b: w.get("pieces") for b, w in t["buffers"].items()}
        if t["quantizer"] is not None:
            assert all(p is not None for p in pieces.values()), n
        if n in DCP_SHARDS:
            spread = [b for b, p in pieces.items() if len(p) == 2 and {pc["file"] for pc in p} == set(shards)]
            assert spread and all(len(p) == 1 and p[0]["sizes"] == [1] for b, p in pieces.items() if b not in spread), n
    assert all(len(w["pieces"]) == 1 for w in record["tensors"]["model.experts"]["buffers"].values())
    assert len(record["tensors"]["model.nvfp4.row_scaled"]["buffers"]["_amax_rowwise"]["pieces"]) == 2
    assert "pieces" not in record["tensors"]["model.norm"]["buffers"]["data"]


def _check_mxfp8_e8m0_edges(path: Path, record: dict, manifest) -> None:
    """The scale bytes the case is for are there: 0, 254 and 255 in both usages."""
    loaded = ts.load_quantized(path)
    found = {}
    for n, t in loaded.items():
        for b in ("_rowwise_scale_inv", "_columnwise_scale_inv"):
            s = getattr(t, b, None)
            if s is not None:
                found.setdefault(b, set()).update(s.view(torch.uint8).unique().tolist())
    for b in found:
        assert {0, 255} <= found[b], (b, found[b])
    assert {254} <= found["_rowwise_scale_inv"] & found["_columnwise_scale_inv"]
    for n in ("nan_scale", "nan_scale_columnwise"):
        assert int(torch.isnan(loaded[n].dequantize(torch.float32)).sum()) == 32, n
    assert int(torch.isinf(loaded["zero_scale"].dequantize(torch.float32)).sum()) == 2


def _check_dir_two_shards(path: Path, record: dict, manifest) -> None:
    """Two shards, each within max_shard_size, and one quantized tensor with buffers in both."""
    shards = record["shards"]
    assert len(shards) == 2, shards
    for shard in shards:
        held = sum(math.prod(b["shape"]) * getattr(torch, b["dtype"]).itemsize
                   for n, t in record["tensors"].items() if n not in _aliases(record)
                   for b in t["buffers"].values() if b["file"] == shard)
        assert held <= DIR_SHARD_LIMIT, (shard, held)
    split = [n for n, t in record["tensors"].items()
             if t["quantizer"] is not None and {b["file"] for b in t["buffers"].values()} == set(shards)]
    assert split == ["layers.0.weight"], split


def _aliases(record: dict) -> set[str]:
    return {n for n, t in record["tensors"].items()
            if any(b["key"] != (n if bn == "data" else f"{n}.{bn}") for bn, b in t["buffers"].items())}


def _check_tied_quantized(path: Path, record: dict, manifest) -> None:
    assert manifest.aliases, "nothing was tied"
    assert _aliases(record) == {"layers.1.proj", "lm_head.weight", "pos_out.weight"}, _aliases(record)
    loaded = ts.load_quantized(path)
    assert loaded["lm_head"]["weight"] is loaded["embed"]["weight"]
    assert loaded["layers"][1]["proj"] is loaded["layers"][0]["proj"]
    assert loaded["pos_out"]["weight"] is loaded["pos"]["weight"]
    assert loaded["layers"][0]["other"] is not loaded["embed"]["weight"]


def _check_no_checksums(path: Path, record: dict, manifest) -> None:
    doc = msgpack.unpackb(read_raw_manifest(path), raw=False, strict_map_key=False)
    assert doc["tensors"]["checksums"] is None


CASE_CHECKS = {"dir_two_shards": _check_dir_two_shards, "tied_quantized": _check_tied_quantized,
               "no_checksums": _check_no_checksums, "dcp_two_ranks": _check_dcp_two_ranks,
               "mxfp8_e8m0_edges": _check_mxfp8_e8m0_edges}


def _self_check(path: Path, record: dict, extra_states: list) -> None:
    """The checkpoint reads back (through te-serial) as the record says."""
    if record["checksums"]:  # every stored entry: a whole buffer, or each piece of a chunked one
        assert ts.verify(path) == sum(len({b["key"] for b in t["buffers"].values() if "pieces" not in b})
                                      + sum(len(b.get("pieces", ())) for b in t["buffers"].values())
                                      for t in record["tensors"].values())
    else:
        try:
            ts.verify(path)
        except tse.ChecksumError as e:
            assert "without checksums" in str(e), e
        else:
            raise AssertionError("verify passed on a checkpoint saved without checksums")
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
            assert digest_values(t.dequantize(torch.float32)) == want["dequantized_float32_xxh3_64"], n
    # te-serial decodes each TE pickle to the state built here (recipe fields, enum members, tensors)
    from te_serial.te.extra_state import decode_te_extra_state
    for want in extra_states:
        got = decode_te_extra_state(want.payload)
        assert list(got) == list(want.state)
        for k, v in want.state.items():
            if isinstance(v, torch.Tensor):
                assert digest(got[k]) == digest(v) and got[k].dtype == v.dtype, k
            else:
                assert encode_value(got[k]) == encode_value(v), (k, got[k], v)


# --- driver ------------------------------------------------------------------------------------

def generate(out_dir: Path, *, force: bool = False, only: list[str] | None = None) -> list[Path]:
    """Write the current format version's cases (or ``only`` those) into ``out_dir``. Refuses to
    overwrite an existing golden file unless ``force``; a case of an older version is never
    written (with ``only``, naming one is an error)."""
    names = current_cases()
    if only:
        unknown = [n for n in only if n not in CASES]
        old = [n for n in only if n in CASES and n not in names]
        if unknown or old:
            raise ValueError(f"unknown golden case(s) {unknown}" if unknown else
                             f"golden case(s) {old} are frozen at an older format version and never regenerated")
        names = [n for n in names if n in only]
    existing = [str(p) for n in names for p in outputs(n, out_dir) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{out_dir} already holds golden files ({', '.join(existing[:3])}"
                              f"{', ...' if len(existing) > 3 else ''}); they are the v1 contract and are "
                              "not regenerated without --force")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name in names:
        files.extend(write_case(name, out_dir))
    return files


def _files_under(root: Path) -> list[str]:
    """Every file below ``root``, as relative paths (a directory golden's shards included)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


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
    """Generate the current version's cases twice into temp dirs; compare the two with each other
    and with ``golden``. Older versions' files are not regenerated (tests/test_golden.py checks
    that they are unchanged)."""
    problems = 0
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        for d in (d1, d2):
            # one process per generation, so per-process state (hash seeds, hash-map orders) differs
            # as between real reruns
            subprocess.run([sys.executable, __file__, "--out", d], check=True, stdout=subprocess.DEVNULL)
        names = _files_under(Path(d1))
        if names != _files_under(Path(d2)):
            problems += 1
            print(f"NOT DETERMINISTIC: the two generations wrote different files "
                  f"({sorted(set(names) ^ set(_files_under(Path(d2))))})")
        for n in names:
            a, b = (Path(d1) / n).read_bytes(), (Path(d2) / n).read_bytes() if (Path(d2) / n).exists() else None
            if a != b:
                problems += 1
                print(f"NOT DETERMINISTIC {n}: {explain_difference(a, b or b'', n)}")
            g = golden / n
            if not g.exists():
                print(f"missing in {golden}: {n}")
                problems += 1
            elif g.read_bytes() != a:
                print(f"differs from {g}: {explain_difference(g.read_bytes(), a, n)}")
                problems += 1
        for name in current_cases():  # and nothing else sits in a directory golden
            if CASES[name].directory and (golden / name).is_dir():
                extra = set(_files_under(golden / name)) - {str(Path(n).relative_to(name)) for n in names
                                                             if n.startswith(name + "/")}
                if extra:
                    print(f"{golden / name} holds files the generator does not write: {sorted(extra)}")
                    problems += 1
    version = f"{VERSION[0]}.{VERSION[1]}"
    frozen = sorted({f"{c.version[0]}.{c.version[1]}" for c in CASES.values() if c.version != VERSION})
    print(f"check: format {version}, {len(current_cases())} cases ({', '.join(current_cases())}): "
          + ("OK, byte-identical" if not problems else f"{problems} problem(s)")
          + (f"; {len(CASES) - len(current_cases())} cases frozen at {', '.join(frozen)} not regenerated"
             if frozen else ""))
    return 1 if problems else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR)
    ap.add_argument("--force", action="store_true",
                    help="overwrite existing golden files of the current format version")
    ap.add_argument("--only", action="append", metavar="NAME", help="just this case (repeatable)")
    ap.add_argument("--check", action="store_true", help="regenerate twice in temp dirs and compare")
    args = ap.parse_args(argv)
    if args.check:
        return check(args.out)
    try:
        files = generate(args.out, force=args.force, only=args.only)
    except (FileExistsError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    total = 0
    for f in files:
        size = sum(p.stat().st_size for p in f.rglob("*")) if f.is_dir() else f.stat().st_size
        total += size
        print(f"{size:>8}  {f.relative_to(args.out.parent) if f.is_relative_to(args.out.parent) else f}")
    print(f"{total:>8}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
