"""Importers: open a checkpoint of any layout te-serial reads and hand out its tensors one by one.

Layouts (auto-detected by :func:`detect_layout`):

* ``te-serial`` — a te-serial checkpoint (directory with ``te_serial.msgpack``, or a single
  ``.safetensors`` file carrying the manifest), any recipe.
* ``safetensors`` — plain Hugging Face safetensors: one file, or shards listed by
  ``model.safetensors.index.json``.
* ``deepseek_fp8`` — DeepSeek-V3 block FP8: ``<m>.weight`` in F8_E4M3 plus ``<m>.weight_scale_inv``
  (F32, one value per 128×128 block, ``[ceil(M/128), ceil(K/128)]``; value = fp8 × scale_inv).
  ``config.json`` says ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``.
* ``compressed_tensors_fp8`` — compressed-tensors ``float-quantized`` FP8: ``<m>.weight`` in
  F8_E4M3 plus ``<m>.weight_scale`` (the weight's original float dtype, usually BF16; shape
  ``[1]`` for strategy ``tensor``, ``[out, 1]`` for ``channel``; value = fp8 × scale), no zero
  point (symmetric). Activation and KV-cache scales (``input_scale``, ``k_scale`` …) are not
  weights: they are dropped, and the report says so.

Every tensor comes out as a te-serial tensor, plain or quantized, holding exactly the source's
values: a DeepSeek weight is a rowwise ``Float8BlockwiseQTensor`` (128×128, the scales as
stored), a compressed-tensors per-tensor weight a rowwise ``Float8Tensor``, a per-channel one a
rowwise 1×128 blockwise tensor whose blocks in a row share the channel's scale (both dequantize
to fp8 × scale in fp32, the exact product). Anything else that looks quantized is refused with an
:class:`UnknownLayoutError` naming what was found.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from .. import numerics as nx
from ..errors import CheckpointError, CheckpointFileError, UnknownLayoutError
from ..formats import Float8BlockQuantizer, Float8CurrentScalingQuantizer
from ..proto import TensorProto
from ..checkpoint.files import TMP_PREFIX, SafetensorsFile
from ..checkpoint.manifest import HEADER_KEY, MANIFEST_NAME
from ..checkpoint.reader import Checkpoint
from .targets import describe_dtype, describe_quantizer, usage_label

__all__ = ["SourceTensor", "Source", "open_source", "detect_layout", "INDEX_NAME", "LAYOUTS"]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
LAYOUTS = ("te-serial", "safetensors", "deepseek_fp8", "compressed_tensors_fp8")

E4M3 = torch.float8_e4m3fn
_FP8_CODES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)

#: key suffixes of layouts te-serial does not read: suffix → (what it is, the sibling suffix that
#: must also be there for the key to count, so an ordinary tensor of that name is not refused)
_FOREIGN_SUFFIXES = {
    ".qweight": ("GPTQ/AWQ packed int weights", None), ".qzeros": ("GPTQ/AWQ zero points", ".qweight"),
    ".scales": ("GPTQ/AWQ group scales", ".qweight"), ".g_idx": ("GPTQ act-order indices", ".qweight"),
    ".weight_packed": ("compressed-tensors pack-quantized (int4/fp4) weights", None),
    ".weight_global_scale": ("compressed-tensors NVFP4 global scales", None),
    ".weight_g_idx": ("compressed-tensors act-order indices", None),
    ".weight_shape": ("compressed-tensors packed-weight shapes", None),
    ".weight_shape_original": ("compressed-tensors padded block weights", None),
    ".SCB": ("bitsandbytes int8", None), ".weight_format": ("bitsandbytes int8", None),
    ".absmax": ("bitsandbytes 4-bit", None), ".quant_map": ("bitsandbytes 4-bit", None),
    ".nested_absmax": ("bitsandbytes 4-bit", None), "_blocks": ("MXFP4 (gpt-oss) blocks", "_scales"),
}
#: compressed-tensors activation / KV-cache parameters: not weights, dropped on conversion
_CT_ACTIVATION_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point",
                           ".k_scale", ".v_scale", ".q_scale", ".input_global_scale")
#: files never copied along with a model directory
_NOT_AUX_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5",
                     ".gguf", ".npz", ".msgpack")


@dataclasses.dataclass
class SourceTensor:
    """One tensor of a source, data-free: its te-serial prototype and where its bytes are."""

    name: str
    proto: TensorProto         # plain, or the quantized te-serial representation of the source
    fmt: str                   # how the source stores it: "bf16", "mxfp8", "deepseek_fp8", …
    usages: str                # "-" for plain, "row", "col", "row+col"
    nbytes: int                # bytes in the source files
    keys: dict[str, Any]       # loader-specific: what to read
    alias_of: str | None = None
    uniform_rows: bool = False  # a blockwise 1×128 tensor whose row blocks share one scale (CT channel)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.proto.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.proto.dtype

    @property
    def quantizer(self):
        return self.proto.quantizer


class Source:
    """A checkpoint opened for conversion: ``tensors`` (data-free), ``load(name)``, ``close()``."""

    layout: str = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: dict[str, SourceTensor] = {}
        self.config: dict | None = None
        self.aux_files: list[Path] = []
        self.dropped: dict[str, tuple[str, int]] = {}   # name → (reason, bytes)
        self.tree: Any = None
        self.metadata: dict[str, str] = {}
        self._files: dict[str, SafetensorsFile] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.alias_of is None)

    def file(self, name: str) -> SafetensorsFile:
        return self._files[name]

    def load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- te-serial ------------------------------------------------------------------------------------

class TeSerialSource(Source):
    """A te-serial checkpoint, read through the one reader (:class:`~te_serial.Checkpoint`): whatever
    ``load_quantized`` refuses, conversion refuses too. Buffers are read into fresh memory."""

    layout = "te-serial"

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        super().__init__(path)
        self.ckpt = Checkpoint(path)
        self.manifest = manifest = self.ckpt.manifest
        self.verify = verify and manifest.checksums is not None
        self.tree = manifest.tree
        self.metadata = dict(manifest.metadata)
        names = manifest.names
        aliases = {names[i]: names[j] for i, j in manifest.aliases.items()}
        for name in manifest.tensors:
            entry = manifest.tensors[name]
            q = entry.proto.quantizer
            fmt = describe_quantizer(q) if q is not None else describe_dtype(entry.proto.dtype)
            self.tensors[name] = SourceTensor(name, entry.proto, fmt, usage_label(q), entry.nbytes,
                                              {"entry": entry}, alias_of=aliases.get(name))
        if path.is_dir():
            self.aux_files = _aux_files(path, exclude={MANIFEST_NAME, *manifest.files})
            if (path / CONFIG_NAME).is_file():  # a model directory converted to te-serial keeps its config
                self.config = _read_json(path / CONFIG_NAME)

    def load(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name, verify=self.verify, mmap=False)

    def close(self) -> None:
        self.ckpt.close()


# --- safetensors-based layouts (plain, DeepSeek, compressed-tensors) ---------------------------

class SafetensorsSource(Source):
    """Plain HF safetensors, DeepSeek-V3 block FP8 and compressed-tensors FP8 (one file or shards)."""

    def __init__(self, path: Path, files: list[Path], key_files: dict[str, Path] | None,
                 config: dict | None, config_path: Path | None, *, dtype: torch.dtype) -> None:
        super().__init__(path)
        self.config = config
        self.dtype = dtype
        for p in files:  # a model directory may be a hub cache, whose files are symlinks
            self._files[str(p)] = SafetensorsFile(p, follow_symlinks=True)
        # key → file, in the order the index (or the single file) lists them
        where: dict[str, str] = {}
        if key_files is None:
            for fname, f in self._files.items():
                for k in f.keys():
                    if k in where:
                        raise CheckpointFileError(f"tensor {k!r} is in two files", file=fname, tensor=k)
                    where[k] = fname
        else:
            for k, p in key_files.items():
                f = self._files[str(p)]
                if k not in f:
                    raise CheckpointFileError(f"{INDEX_NAME} puts the tensor in this file but it is not there",
                                              file=str(p), tensor=k)
                where[k] = str(p)
        self._where = where
        qc = (config or {}).get("quantization_config") if isinstance(config, dict) else None
        self.quant_config = qc if isinstance(qc, dict) else None
        self.layout = self._classify(config_path)
        if path.is_dir():
            self.aux_files = _aux_files(path, exclude={INDEX_NAME, *(p.name for p in files)})

    # -- classification ------------------------------------------------------------------------
    def _info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        e = self._files[self._where[key]].entries[key]
        return e.dtype, e.shape, e.nbytes

    def _fail(self, message: str, key: str | None = None) -> None:
        file = self._where.get(key, str(self.path)) if key else str(self.path)
        raise UnknownLayoutError(message, file=file, tensor=key)

    def _classify(self, config_path: Path | None) -> str:
        qc = self.quant_config
        method = qc.get("quant_method") if qc else None
        expect = None
        ue8m0 = False
        ct_strategies: set[str] | None = None
        cfg_file = str(config_path) if config_path else str(self.path)
        if method is not None:
            if method == "fp8":
                block = qc.get("weight_block_size")
                if block is None or list(block) != [128, 128] or qc.get("fmt", "e4m3") != "e4m3":
                    raise UnknownLayoutError(
                        f"quantization_config quant_method 'fp8' with fmt={qc.get('fmt')!r}, weight_block_size="
                        f"{block!r}: te-serial reads block FP8 only as DeepSeek-V3 writes it (e4m3, [128, 128])",
                        file=cfg_file, field="quantization_config")
                ue8m0 = qc.get("scale_fmt") == "ue8m0"
                expect = "deepseek_fp8"
            elif method == "compressed-tensors":
                ct_strategies = _ct_weight_strategies(qc, cfg_file)
                expect = "compressed_tensors_fp8"
            else:
                raise UnknownLayoutError(
                    f"quantization_config quant_method {method!r} is not a layout te-serial reads (it reads "
                    "plain safetensors, DeepSeek-V3 block FP8 (quant_method 'fp8') and compressed-tensors "
                    "float-quantized FP8)", file=cfg_file, field="quantization_config")
        keys = list(self._where)
        keyset = set(keys)
        for k in keys:
            for suffix, (what, sibling) in _FOREIGN_SUFFIXES.items():
                if k.endswith(suffix) and (sibling is None or k[: -len(suffix)] + sibling in keyset):
                    self._fail(f"tensor looks like {what}, a layout te-serial does not read", k)
        consumed: set[str] = set()
        ds_pairs: dict[str, str] = {}
        ct_pairs: dict[str, str] = {}
        for k in keys:
            if k.endswith("_scale_inv"):
                base = k[: -len("_scale_inv")]
                if base not in keyset:
                    self._fail("scale tensor has no weight next to it (expected "
                               f"{base!r}, DeepSeek-V3 naming)", k)
                ds_pairs[base] = k
            elif k.endswith("weight_scale"):
                base = k[: -len("_scale")]
                if base not in keyset:
                    self._fail(f"scale tensor has no weight next to it (expected {base!r}, "
                               "compressed-tensors naming)", k)
                ct_pairs[base] = k
        if ds_pairs and ct_pairs:
            self._fail("checkpoint mixes DeepSeek-style weight_scale_inv and compressed-tensors weight_scale "
                       "tensors", next(iter(ds_pairs.values())))
        layout = "deepseek_fp8" if ds_pairs else "compressed_tensors_fp8" if ct_pairs else "safetensors"
        if expect is not None and layout not in (expect, "safetensors"):
            self._fail(f"config.json says {expect} but the tensors are laid out as {layout}")
        for k in keys:
            if k in ds_pairs:
                self._add_deepseek(k, ds_pairs[k], ue8m0)
                consumed.update((k, ds_pairs[k]))
            elif k in ct_pairs:
                self._add_ct(k, ct_pairs[k], ct_strategies)
                consumed.update((k, ct_pairs[k]))
                zp = k + "_zero_point"
                if zp in keyset:
                    consumed.add(zp)
                    self.tensors[k].keys["zero_point"] = zp
        for k in keys:
            if k in consumed or k in self.tensors:
                continue
            dtype, shape, nbytes = self._info(k)
            if k.endswith("_scale_inv") or k.endswith("weight_scale"):
                continue  # consumed with their weight above
            if layout == "compressed_tensors_fp8" and k.endswith(_CT_ACTIVATION_SUFFIXES + ("weight_zero_point",)):
                if k.endswith("weight_zero_point"):
                    self._fail("zero point without a quantized weight", k)
                self.dropped[k] = ("compressed-tensors activation/KV-cache parameter, not a weight", nbytes)
                continue
            if dtype in _FP8_CODES:
                self._fail(f"{describe_dtype(dtype)} tensor without a scale next to it ({k}_scale_inv or "
                           f"{k}_scale): not a layout te-serial reads", k)
            self.tensors[k] = SourceTensor(k, TensorProto(shape, dtype), describe_dtype(dtype), "-", nbytes,
                                           {"data": k})
        # keep the source's order
        order = {k: i for i, k in enumerate(keys)}
        self.tensors = dict(sorted(self.tensors.items(), key=lambda kv: order[kv[0]]))
        return layout

    def _add_deepseek(self, wkey: str, skey: str, pow2: bool) -> None:
        wdtype, wshape, wbytes = self._info(wkey)
        sdtype, sshape, sbytes = self._info(skey)
        if wdtype != E4M3 or len(wshape) != 2:
            self._fail(f"DeepSeek block FP8 weights are 2-D F8_E4M3, got {describe_dtype(wdtype)}{list(wshape)}", wkey)
        m, k = wshape
        want = (nx.ceil_div(m, 128), nx.ceil_div(k, 128))
        if sdtype not in (torch.float32, torch.float8_e8m0fnu) or sshape != want:
            self._fail(f"weight_scale_inv should be F32{list(want)} for a weight of shape {list(wshape)} "
                       f"(one scale per 128x128 block), got {describe_dtype(sdtype)}{list(sshape)}", skey)
        q = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=2,
                                 force_pow_2_scales=pow2 or sdtype == torch.float8_e8m0fnu)
        self.tensors[wkey] = SourceTensor(wkey, TensorProto(wshape, self.dtype, q), "deepseek_fp8", "row",
                                          wbytes + sbytes, {"weight": wkey, "scale": skey, "kind": "deepseek"})

    def _add_ct(self, wkey: str, skey: str, strategies: set[str] | None) -> None:
        wdtype, wshape, wbytes = self._info(wkey)
        sdtype, sshape, sbytes = self._info(skey)
        if wdtype != E4M3 or len(wshape) != 2:
            self._fail(f"compressed-tensors FP8 weights are 2-D F8_E4M3, got {describe_dtype(wdtype)}{list(wshape)}",
                       wkey)
        if sdtype not in (torch.float32, torch.bfloat16, torch.float16):
            self._fail(f"weight_scale must be a float tensor, got {describe_dtype(sdtype)}", skey)
        m, k = wshape
        numel = math.prod(sshape)
        if numel == 1 and len(sshape) <= 2:
            strategy = "tensor"
        elif sshape in ((m, 1), (m,)):
            strategy = "channel"
        else:
            self._fail(f"weight_scale {list(sshape)} for a weight {list(wshape)} is neither per-tensor [1] nor "
                       "per-channel [out, 1] (group and block strategies are not read)", skey)
        if strategies is not None and strategy not in strategies:
            self._fail(f"weight_scale shape {list(sshape)} means strategy {strategy!r}, but config.json's "
                       f"config_groups declare {sorted(strategies)}", skey)
        if strategy == "tensor":
            q = Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=False)
            fmt = "ct_fp8_tensor"
        else:
            q = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=1,
                                     force_pow_2_scales=False)
            fmt = "ct_fp8_channel"
        self.tensors[wkey] = SourceTensor(wkey, TensorProto(wshape, self.dtype, q), fmt, "row", wbytes + sbytes,
                                          {"weight": wkey, "scale": skey, "kind": strategy},
                                          uniform_rows=strategy == "channel")

    # -- loading -------------------------------------------------------------------------------
    def _read(self, key: str) -> torch.Tensor:
        return self._files[self._where[key]].read(key)

    def load(self, name: str) -> torch.Tensor:
        st = self.tensors[name]
        if st.quantizer is None:
            return self._read(st.keys["data"])
        q = st.quantizer
        m, k = st.shape
        data = self._read(st.keys["weight"]).view(torch.uint8)
        scale = self._read(st.keys["scale"])
        scale = (nx.e8m0_dequant_scale(scale.view(torch.uint8)) if scale.dtype == torch.float8_e8m0fnu
                 else scale.float())  # bf16/fp16 → fp32 is exact
        zp = st.keys.get("zero_point")
        if zp is not None and bool((self._read(zp).float() != 0).any()):
            self._fail("nonzero weight_zero_point: asymmetric FP8 is not a layout te-serial reads", zp)
        specs = q.describe_buffers(st.shape)
        kind = st.keys["kind"]
        if kind == "deepseek":
            s = torch.zeros(specs["_rowwise_scale_inv"].shape, dtype=torch.float32)
            s[: scale.shape[0], : scale.shape[1]] = scale
            buffers = {"_rowwise_data": data, "_rowwise_scale_inv": s}
        elif kind == "tensor":
            buffers = {"_data": data, "_scale_inv": scale.reshape(1).clone()}
        else:  # channel: every 1×128 block of row m takes the channel's scale
            s = torch.zeros(specs["_rowwise_scale_inv"].shape, dtype=torch.float32)
            s[:, :m] = scale.reshape(1, m)
            buffers = {"_rowwise_data": data, "_rowwise_scale_inv": s}
        return st.proto.assemble(buffers)


def _ct_weight_strategies(qc: dict, cfg_file: str) -> set[str]:
    """The weight strategies a compressed-tensors config declares, refusing what is not FP8."""
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnknownLayoutError("compressed-tensors config has no config_groups", file=cfg_file,
                                 field="quantization_config.config_groups")
    strategies = set()
    for gname, group in groups.items():
        gfmt = (group or {}).get("format") or fmt
        if gfmt != "float-quantized":
            raise UnknownLayoutError(f"compressed-tensors format {gfmt!r} (group {gname!r}) is not read; te-serial "
                                     "reads 'float-quantized' FP8", file=cfg_file,
                                     field=f"quantization_config.config_groups.{gname}")
        w = (group or {}).get("weights")
        if not w:
            continue
        where = f"quantization_config.config_groups.{gname}.weights"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnknownLayoutError(f"weights are {w.get('type')!r} with {w.get('num_bits')!r} bits; te-serial "
                                     "reads 8-bit float (FP8 E4M3)", file=cfg_file, field=where)
        if w.get("symmetric") is False:
            raise UnknownLayoutError("asymmetric weights (zero points) are not read", file=cfg_file, field=where)
        if w.get("dynamic") is True:
            raise UnknownLayoutError("dynamic weight quantization stores no weight scales", file=cfg_file,
                                     field=where)
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise UnknownLayoutError(f"weight strategy {strategy!r} is not read (te-serial reads 'tensor' and "
                                     "'channel')", file=cfg_file, field=where)
        strategies.add(strategy)
    return strategies


# --- detection ------------------------------------------------------------------------------------

def _aux_files(root: Path, exclude: set[str]) -> list[Path]:
    """Files of a model directory worth copying next to converted weights (config, tokenizer…)."""
    out = []
    for p in sorted(root.iterdir()):
        name = p.name
        if (not p.is_file() or name in exclude or name.startswith(".") or name.startswith(TMP_PREFIX)
                or name.endswith(_NOT_AUX_SUFFIXES) or name.endswith(".index.json")):
            continue
        out.append(p)
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"unreadable JSON: {e}", file=str(path)) from None
    if not isinstance(data, dict):
        raise CheckpointFileError("expected a JSON object", file=str(path))
    return data


def _has_manifest(path: Path) -> bool:
    try:
        with SafetensorsFile(path, follow_symlinks=True) as f:
            return HEADER_KEY in f.metadata
    except CheckpointError:
        return False


def _locate(path: Path) -> tuple[str, list[Path], dict[str, Path] | None, Path | None]:
    """(kind, files, key → file from the index or None, config.json or None)."""
    if not path.exists():
        raise CheckpointFileError("no such file or directory", file=str(path))
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _from_index(path)
        if path.suffix != ".safetensors":
            if path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
                raise UnknownLayoutError("pickle-based checkpoints are not read (te-serial never unpickles); "
                                         "save them as safetensors first", file=str(path))
            raise UnknownLayoutError("not a checkpoint te-serial reads (expected a .safetensors file, a "
                                     f"{INDEX_NAME}, or a directory)", file=str(path))
        if _has_manifest(path):
            return "te-serial", [path], None, None
        cfg = path.parent / CONFIG_NAME
        return "safetensors", [path], None, cfg if cfg.is_file() else None
    if (path / MANIFEST_NAME).exists():
        return "te-serial", [], None, None
    if (path / INDEX_NAME).is_file():
        return _from_index(path / INDEX_NAME)
    shards = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))
    cfg = path / CONFIG_NAME
    cfg = cfg if cfg.is_file() else None
    if len(shards) == 1:
        if _has_manifest(shards[0]):
            return "te-serial", shards, None, None
        return "safetensors", shards, None, cfg
    if len(shards) > 1:
        if (path / "model.safetensors").is_file():
            return "safetensors", [path / "model.safetensors"], None, cfg
        raise UnknownLayoutError(f"{len(shards)} safetensors files but no {INDEX_NAME} saying which tensors they "
                                 "hold", file=str(path))
    pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise UnknownLayoutError(f"only pickle-based weights ({', '.join(sorted(pickles)[:3])}); te-serial never "
                                 "unpickles: save them as safetensors first", file=str(path))
    raise UnknownLayoutError("no checkpoint here (no te_serial.msgpack, no *.safetensors)", file=str(path))


def _from_index(index: Path):
    data = _read_json(index)
    wm = data.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointFileError("index has no weight_map of tensor name → file name", file=str(index))
    root = index.parent
    files: dict[str, Path] = {}
    key_files = {}
    for k, fname in wm.items():
        if "/" in fname or "\\" in fname or fname.startswith(".") or not fname:
            raise CheckpointFileError(f"file name {fname!r} leaves the checkpoint directory", file=str(index),
                                      tensor=k)
        p = files.setdefault(fname, root / fname)
        if not p.is_file():
            raise CheckpointFileError("shard listed in the index is missing", file=str(p), tensor=k)
        key_files[k] = p
    cfg = root / CONFIG_NAME
    return "safetensors", list(files.values()), key_files, cfg if cfg.is_file() else None


def detect_layout(path: str | os.PathLike) -> str:
    """The layout of the checkpoint at ``path`` (one of :data:`LAYOUTS`); refuses what it cannot read."""
    with open_source(path) as src:
        return src.layout


def open_source(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> Source:
    """Open a checkpoint of any layout te-serial reads (see the module docstring).

    ``dtype`` is the nominal dtype given to imported quantized tensors (DeepSeek, compressed-tensors);
    ``verify`` checks te-serial buffers against their checksums as they are read.
    """
    path = Path(path)
    kind, files, key_files, cfg = _locate(path)
    if kind == "te-serial":
        return TeSerialSource(files[0] if files else path, verify=verify)
    config = _read_json(cfg) if cfg is not None else None
    return SafetensorsSource(path, files, key_files, config, cfg, dtype=dtype)
