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
* ModelOpt (``hf_quant_config.json`` or ``quant_method: "modelopt"``): NVFP4, MXFP8, FP8 and
  FP8_PB_WO weights; compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp8-quantized`` — see
  :mod:`te_serial.conversion.layouts` for their tensors. NVFP4 weights come back with the source's
  codes and block scales and a tensor amax whose layout-convention global scale is the stored
  one; with te-serial's export sidecar (``te_serial_export.json``) the exact amax and quantizer.
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
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import (CheckpointError, CheckpointFileError, ConversionError, FormatError, ManifestError, ShapeError,
                      UnknownLayoutError, UnsupportedOperationError)
from ..proto import TensorProto, to_tensor_proto
from ..checkpoint.fileops import TMP_PREFIX
from ..checkpoint.files import SafetensorsFile, release_pages
from ..checkpoint.manifest import HEADER_KEY, MANIFEST_NAME
from ..checkpoint.reader import Checkpoint
from ..checkpoint.writer import SHARD_NAME
from ..formats import STORAGE_REGISTRY
from ..formats.tensors import QuantizedTensorStorage
from .layouts import FAMILIES as LAYOUT_FAMILIES
from .layouts.common import SIDECAR_NAME, read_sidecar
from .layouts.compressed_tensors import ct_schemes
from .layouts.modelopt import HF_QUANT_CONFIG, read_hf_quant_config
from .targets import describe_dtype, describe_quantizer, usage_label

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: every layout name ``detect_layout`` gives: te-serial, plain safetensors, and each serving layout's
#: (one per weight scheme it offers, and its name for a checkpoint mixing them)
LAYOUTS = ("te-serial", "safetensors", *dict.fromkeys(
    n for lay in LAYOUT_FAMILIES.values()
    for n in (*map(lay.layout_name, lay.offers), *lay.read_only.values(), lay.source_name) if n))
#: te-serial checkpoint metadata key holding the activation amax of each layer (JSON), kept so a
#: later export can still write static activation scales
ACT_AMAX_KEY = "te_serial.activation_amax"

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
        #: module name → amax of its input activations (TE delayed-scaling history, a layout's static
        #: activation scales, or the te-serial checkpoint's record of either)
        self.activation_amax: dict[str, float] = {}
        #: tensor name → how the te-serial values of an imported two-level weight relate to the
        #: source layout reader's values (filled as the tensor is loaded)
        self.import_checks: dict[str, Any] = {}
        self.notes: dict[str, str] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.alias_of is None)

    def file(self, name: str) -> SafetensorsFile:
        return self._files[name]

    def load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """The plain tensor ``name`` copied into ``out`` (contiguous, of its shape and dtype): read straight
        into it where the source can, so no mapping of its pages is made or kept."""
        t = self.load(name)
        out.copy_(t)
        release_pages(t)

    def file_keys(self, name: str) -> list[str]:
        """The keys in the source's files that hold tensor ``name``'s bytes (what a loader reading
        the files by key, as transformers does, must leave to te-serial)."""
        raise UnsupportedOperationError(f"a {self.layout or type(self).__name__} source does not name its files' "
                                        "keys", tensor=name)

    def stream(self, name: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The tensor for a byte relayout, and the check to run once its bytes are written (None:
        it was checked as it was read)."""
        return self.load(name), None

    def stream_members(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Experts ``start`` .. ``stop - 1`` of the grouped tensor ``name``, as a grouped tensor of their
        own (of a plain 3-D stack: those entries of its first dim), and the check to run once their
        bytes are written (as :meth:`stream`)."""
        t = self.load(name)
        return (t.member_range(start, stop) if isinstance(t, QuantizedTensorStorage) else t[start:stop]), None

    def load_members(self, name: str, start: int, stop: int) -> torch.Tensor:
        """:meth:`stream_members`, checked now."""
        t, check = self.stream_members(name, start, stop)
        if check is not None:
            check()
        return t

    def piece_of(self, name: str) -> str | None:
        """The stored tensor that ``name`` is one piece of (an expert of a stack, or its gate or up), or
        None: :meth:`stream_pieces` reads such pieces together."""
        return None

    def stream_pieces(self, names: Sequence[str]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        """The tensors ``names``, pieces of one stored tensor (:meth:`piece_of`) in order: its bytes
        read once for all of them, not once per piece; and the check to run once they are written
        (as :meth:`stream`)."""
        if len(names) == 1:
            t, check = self.stream(names[0])
            return [t], check
        return [self.load(n) for n in names], None

    def stream_joined(self, names: Sequence[str]) -> tuple[torch.Tensor, Callable[[], None] | None] | None:
        """The pieces ``names`` stacked by rows as one quantized tensor, exactly, read at once, and the
        check to run once written (as :meth:`stream`), where they are, in order, every row of a range of
        a stored stack's experts; else None (read them with :meth:`stream_pieces`)."""
        return None

    def load_pieces(self, names: Sequence[str]) -> list[torch.Tensor]:
        """:meth:`stream_pieces`, checked now."""
        pieces, check = self.stream_pieces(names)
        if check is not None:
            check()
        return pieces

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
    ``load_quantized`` refuses, conversion refuses too. Each buffer is a mapping of its own pages,
    unmapped once freed; a byte relayout checks its checksums once written, the rest as it is read."""

    layout = "te-serial"

    def __init__(self, path: Path, *, verify: bool = True, ckpt: Checkpoint | None = None) -> None:
        super().__init__(path)
        self.ckpt = ckpt if ckpt is not None else Checkpoint(path)
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
        if self.config is None and "hf_config" in self.metadata:  # save_quantized(model) records it
            try:
                config = json.loads(self.metadata["hf_config"])
            except ValueError as e:
                raise CheckpointFileError(f"metadata hf_config is not JSON: {e}", file=str(path),
                                          field="hf_config") from None
            self.config = config if isinstance(config, dict) else None
        #: the tensors of TE modules' decoded ``_extra_state`` (scales, amax histories): module state,
        #: not weights — a serving export leaves them out and takes activation scales from them
        self.extra_state_tensors = {n for n in self.tensors if any(c.endswith("_extra_state") for c in n.split(".")[:-1])}
        self.activation_amax = self._activation_amax()

    def load(self, name: str) -> torch.Tensor:
        t, check = self.ckpt.stream(name, verify=self.verify)
        if check is not None:
            check()
        return t

    def file_keys(self, name: str) -> list[str]:
        m = self.manifest
        if m.is_chunked(name):
            return [piece[1] for *_, pieces in m.pieces(name) for piece in pieces]
        return [loc[2] for loc in m.locations(name)]

    def stream(self, name: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        return self.ckpt.stream(name, verify=self.verify)

    def stream_members(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        return self.ckpt.stream(name, verify=self.verify, members=(start, stop))   # those experts' bytes only

    def _activation_amax(self) -> dict[str, float]:
        """module → input amax: from TE delayed-scaling state (``<m>._extra_state``'s
        ``amax_history_fwd``, column 0 = the GEMM input of a one-GEMM module, reduced as its
        recipe's ``amax_compute_algo`` says), then the checkpoint's own record (metadata)."""
        from ..checkpoint.tree import TEExtraState, TensorRef
        out: dict[str, float] = {}
        stack = [((), self.tree)]
        while stack:
            path, node = stack.pop()
            if isinstance(node, dict):
                stack.extend((path + (str(k),), v) for k, v in node.items())
            elif isinstance(node, TEExtraState) and isinstance(node.state, dict):
                ref = node.state.get("amax_history_fwd")
                if not isinstance(ref, TensorRef) or ref.name not in self.tensors:
                    continue
                hist = self.ckpt.get(ref.name, verify=self.verify, mmap=False).float()
                if hist.dim() != 2 or hist.shape[1] != 3 or hist.shape[0] == 0:
                    continue  # one GEMM (input, weight, output) only: LayerNormMLP's two are not mapped
                recipe = node.state.get("recipe") or {}
                algo = (recipe.get("fields") or {}).get("amax_compute_algo", "max") if isinstance(recipe, dict) else "max"
                amax = float(hist[0, 0] if algo == "most_recent" else hist[:, 0].max())
                key = ".".join(path)
                module = key[: -len("_extra_state")].rstrip(".")
                if amax > 0 and math.isfinite(amax):
                    out[module] = amax
        try:
            recorded = json.loads(self.metadata.get(ACT_AMAX_KEY, "{}"))
        except ValueError:
            recorded = {}
        if isinstance(recorded, dict):
            for k, v in recorded.items():
                try:
                    out.setdefault(str(k), float.fromhex(v) if isinstance(v, str) else float(v))
                except (TypeError, ValueError):
                    continue
        return out

    def close(self) -> None:
        self.ckpt.close()


# --- safetensors-based layouts (plain, DeepSeek, compressed-tensors) ---------------------------

class SafetensorsSource(Source):
    """Plain HF safetensors and the serving layouts (ModelOpt, compressed-tensors, DeepSeek-V3
    block FP8), one file or shards. Which layout it is comes from ``config.json``'s
    ``quantization_config`` or ``hf_quant_config.json`` (else from the tensor names); the layout's
    module (:mod:`te_serial.conversion.layouts`) claims its tensors."""

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
        self.config_file = str(config_path) if config_path else str(path)
        root = path if path.is_dir() else path.parent
        hfq_path = root / HF_QUANT_CONFIG
        self.hf_quant_config = read_hf_quant_config(hfq_path) if hfq_path.is_file() else None
        if self.hf_quant_config is not None:
            self.config_file = str(hfq_path)
        self.sidecar, self._sidecar_acts = read_sidecar(root / SIDECAR_NAME) if (root / SIDECAR_NAME).is_file() \
            else ({}, {})
        self.consumed: set[str] = set()
        self.modelopt_algo: str | None = None
        self.modelopt_layers: dict | None = None   # MIXED_PRECISION: layer → its quant_algo entry
        self.ct_schemes: set[str] | None = None
        self.ue8m0 = False
        self.layout = self._classify()
        for k, v in self._sidecar_acts.items():  # amax te-serial exported where the layout holds no scale
            self.activation_amax.setdefault(k, v)
        if path.is_dir():
            # the layout's own config files are written anew by an export, never carried into another layout
            self.aux_files = _aux_files(path, exclude={INDEX_NAME, SIDECAR_NAME, HF_QUANT_CONFIG,
                                                       *(p.name for p in files)})

    # -- classification ------------------------------------------------------------------------
    # --- the protocol the layouts read a source through ------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor key in the source's files, in file order."""
        return list(self._where)

    def has(self, key: str) -> bool:
        """Is ``key`` a tensor in the source's files?"""
        return key in self._where

    def file_of(self, key: str) -> str:
        """The path of the file holding ``key``."""
        return self._where[key]

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        """(dtype, shape, bytes) of ``key`` from its file's header, nothing read."""
        e = self._files[self._where[key]].entries[key]
        return e.dtype, e.shape, e.nbytes

    def fail(self, message: str, key: str | None = None) -> None:
        """Raise the layout error for ``key``, naming it and its file."""
        file = self._where.get(key, str(self.path)) if key else str(self.path)
        raise UnknownLayoutError(message, file=file, tensor=key)

    def add_quantized(self, name: str, shape: tuple[int, ...], keys: dict, nbytes: int, layout, *,
                      consumed: list | None = None, uniform_rows: bool = False) -> None:
        """Called by a layout's ``claim``: ``name`` is a quantized weight held by ``keys``."""
        scheme = keys["scheme"]
        q = layout.quantizer_for(self, name, scheme)
        try:
            q.check_shape(tuple(shape))
        except ShapeError as e:
            self.fail(f"{layout.layout_name(scheme)} weight of shape {list(shape)}: te-serial's {q.layout_name()} "
                       f"cannot hold it ({e})", keys["weight"])
        keys = {**keys, "layout": layout}
        self.tensors[name] = SourceTensor(name, TensorProto(tuple(shape), self.dtype, q),
                                          layout.tensor_format(scheme), "row", nbytes, keys,
                                          uniform_rows=uniform_rows)
        self.consumed.update(k for k in (consumed or [keys.get("weight"), keys.get("scale"), keys.get("glob")]) if k)

    def add_activation(self, module: str, key: str, layout, scheme: str) -> None:
        """A static activation scale: recorded as the layer's activation amax (re-exports write it
        again), reported as dropped (it is not a weight). The amax recorded is one whose scale, by
        the layout's ``act_scale``, is the stored bits (te-serial's own exported amax where it still
        gives them), so a re-export writes the same bits."""
        value = self.read(key).float().reshape(-1)
        if value.numel() == 1 and math.isfinite(float(value)) and float(value) > 0:
            def gives(amax: float) -> bool:
                return torch.equal(layout.act_scale(scheme, amax).reshape(()).view(torch.int32),
                                   value.reshape(()).view(torch.int32))
            known = self._sidecar_acts.get(module)
            amax = known if known is not None and gives(known) else layout.act_amax(scheme, float(value))
            self.activation_amax.setdefault(module, amax)
        self.drop(key, "activation scale, not a weight (kept as the layer's activation amax for re-export)")

    def drop(self, key: str, reason: str) -> None:
        self.consumed.add(key)
        self.dropped[key] = (reason, self.info(key)[2])

    def _family(self) -> str | None:
        qc, hfq = self.quant_config, self.hf_quant_config
        method = qc.get("quant_method") if qc else None
        if hfq is not None or method == "modelopt":
            body = (hfq or {}).get("quantization") if hfq is not None else qc
            algo = body.get("quant_algo") if isinstance(body, dict) else None
            self.modelopt_algo = algo.upper() if isinstance(algo, str) else ""  # ModelOpt writes fp8_pb_wo lowercase
            layers = body.get("quantized_layers") if isinstance(body, dict) and self.modelopt_algo == "MIXED_PRECISION" \
                else None
            self.modelopt_layers = layers if isinstance(layers, dict) else None
            return "modelopt"
        if method in ("fp8", "mxfp8"):
            block = qc.get("weight_block_size")
            want = [1, 32] if method == "mxfp8" else [128, 128]
            if block is None and method == "mxfp8":
                block = want   # SGLang fixes MXFP8's block; the field is metadata there
            if block is None or list(block) != want or qc.get("fmt", "e4m3") != "e4m3":
                raise UnknownLayoutError(
                    f"quantization_config quant_method {method!r} with fmt={qc.get('fmt')!r}, weight_block_size="
                    f"{block!r}: te-serial reads block FP8 as DeepSeek-V3 writes it ('fp8': e4m3, [128, 128]) and "
                    "MXFP8 as SGLang does ('mxfp8': e4m3, [1, 32])",
                    file=self.config_file, field="quantization_config")
            self.ue8m0 = qc.get("scale_fmt") == "ue8m0"
            return "deepseek"
        if method == "compressed-tensors":
            self.ct_schemes = ct_schemes(qc, self.config_file)
            return "ct"
        if method == "mxfp4":  # gpt-oss (transformers' Mxfp4Config)
            return "gpt_oss"
        if method is not None:
            raise UnknownLayoutError(
                f"quantization_config quant_method {method!r} is not a layout te-serial reads (it reads plain "
                "safetensors, ModelOpt ('modelopt': NVFP4, MXFP4, MXFP8, FP8, FP8_PB_WO), compressed-tensors (FP8, "
                "NVFP4, MXFP4, MXFP8), DeepSeek-V3 block FP8 and V4 FP4 experts ('fp8') and gpt-oss MXFP4 ('mxfp4'))",
                file=self.config_file, field="quantization_config")
        return None

    def _classify(self) -> str:
        keys = list(self._where)
        keyset = set(keys)
        family = self._family()
        ds = [k for k in keys if k.endswith("_scale_inv")]
        scaled = [k for k in keys if k.endswith(".weight_scale")]
        if family is None:  # no config: the names say it
            if ds and scaled:
                self.fail("checkpoint mixes DeepSeek-style weight_scale_inv and compressed-tensors weight_scale "
                           "tensors", ds[0])
            if any(k.endswith("_blocks") and k[: -len("_blocks")] + "_scales" in keyset for k in keys):
                family = "gpt_oss"
            elif any(k.endswith(".weight_scale_2") for k in keys):
                family, self.modelopt_algo = "modelopt", None
            elif scaled:
                family = "ct"
            elif ds or any(k.endswith(".scale") and self.info(k)[0] == torch.float8_e8m0fnu for k in keys):
                family = "deepseek"   # DeepSeek-V3's weight_scale_inv, V4's E8M0 <m>.scale
        elif family == "deepseek" and scaled:
            self.fail("config.json says deepseek_fp8 but the tensors are laid out as compressed-tensors / ModelOpt "
                       "(weight_scale)")
        elif family in ("ct", "modelopt") and ds:
            self.fail(f"config.json says {family} but the tensors are laid out as deepseek_fp8 (weight_scale_inv)")
        consumes = {"ct": (".weight_packed", ".weight_global_scale"), "gpt_oss": ("_blocks",)}.get(family, ())
        for k in keys:
            for suffix, (what, sibling) in _FOREIGN_SUFFIXES.items():
                if suffix in consumes:
                    continue
                if k.endswith(suffix) and (sibling is None or k[: -len(suffix)] + sibling in keyset):
                    self.fail(f"tensor looks like {what}, a layout te-serial does not read", k)
        layout = LAYOUT_FAMILIES.get(family) if family else None
        if layout is not None:
            layout.claim(self)
            for k in keys:
                if k in self.consumed:
                    continue
                if family == "modelopt" and k.endswith(".input_scale"):  # KV-cache scales are kept
                    self.drop(k, "ModelOpt activation scale, not a weight")
        for k in keys:
            if k in self.consumed or k in self.tensors:
                continue
            dtype, shape, nbytes = self.info(k)
            if dtype in _FP8_CODES:
                self.fail(f"{describe_dtype(dtype)} tensor without a scale next to it ({k}_scale_inv or "
                           f"{k}_scale): not a layout te-serial reads", k)
            self.tensors[k] = SourceTensor(k, TensorProto(shape, dtype), describe_dtype(dtype), "-", nbytes,
                                           {"data": k})
        order = {k: i for i, k in enumerate(keys)}
        self.tensors = dict(sorted(self.tensors.items(), key=lambda kv: order.get(kv[1].keys.get("weight", kv[0]),
                                                                                   order.get(kv[0], 0))))
        quantized = {st.keys["scheme"] for st in self.tensors.values() if st.quantizer is not None}
        if layout is None or not quantized:
            return "safetensors"
        names = {layout.layout_name(s) for s in quantized}
        return names.pop() if len(names) == 1 else layout.source_name

    # -- loading -------------------------------------------------------------------------------
    def read(self, key: str) -> torch.Tensor:
        """A buffer as a mapping of its own pages (no copy; unmapped once freed)."""
        return self._files[self._where[key]].mapped(key, own=True)

    def load(self, name: str) -> torch.Tensor:
        st = self.tensors[name]
        if st.quantizer is None:
            return self.read(st.keys["data"])
        return st.keys["layout"].load(self, st)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        st = self.tensors[name]
        if st.quantizer is not None or out.shape != st.shape or out.dtype != st.dtype or not out.is_contiguous():
            return super().read_into(name, out)
        key = st.keys["data"]
        self._files[self._where[key]].read_box(key, st.shape, (0,) * len(st.shape), st.shape, out=out)  # one pread

    def stream_members(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        st = self.tensors[name]
        if st.quantizer is None or not st.quantizer.is_container:
            return super().stream_members(name, start, stop)
        return st.keys["layout"].load_members(self, st, start, stop), None

    def file_keys(self, name: str) -> list[str]:
        return [k for k in self.tensors[name].keys.values() if isinstance(k, str) and self.has(k)]


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
    """True for a single-file te-serial checkpoint. A file whose keys are te-serial buffer keys but
    whose manifest is gone is refused as load_quantized refuses it (it is no plain safetensors)."""
    try:
        with SafetensorsFile(path, follow_symlinks=True) as f:
            if HEADER_KEY in f.metadata:
                return True
            keys = f.keys()
    except CheckpointError:
        return False
    # TE's underscored attribute names only: grouped buffers' bare names (amax, scale_inv…) are common words
    buffers = {b for cls in STORAGE_REGISTRY.values() for b in cls.BUFFERS if b.startswith("_")}
    if any(k.rsplit(".", 1)[-1] in buffers for k in keys if "." in k):
        raise ManifestError("safetensors file has no te-serial manifest in its header, but its keys are a "
                            "te-serial checkpoint's buffers (the manifest is lost)", file=str(path))
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
    if any(SHARD_NAME.fullmatch(p.name) for p in shards):  # te-serial's shards, its manifest lost
        raise ManifestError(f"no {MANIFEST_NAME} in checkpoint directory", file=str(path))
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


# --- a model in memory --------------------------------------------------------------------------

class ModuleSource(Source):
    """An ``nn.Module``'s (or a state dict's) tensors as a source: te-serial quantized parameters
    as they are, plain ones as they are; tensors shared by several names are aliases of the first."""

    layout = "model"

    def __init__(self, model: "torch.nn.Module | Mapping[str, torch.Tensor]") -> None:
        super().__init__(Path("<model>"))
        state = model.state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else dict(model)
        cfg = getattr(model, "config", None)
        self.config = cfg.to_dict() if callable(getattr(cfg, "to_dict", None)) else None
        if self.config is not None and not self.config.get("architectures"):  # a model built from its config
            self.config["architectures"] = [type(model).__name__]
        self._state: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ConversionError(f"state entry is a {type(t).__name__}, not a tensor", tensor=name)
            proto = to_tensor_proto(t)
            q = proto.quantizer
            fmt = describe_quantizer(q) if q is not None else describe_dtype(proto.dtype)
            self._state[name] = t.detach() if not isinstance(t, QuantizedTensorStorage) else t
            self.tensors[name] = SourceTensor(name, proto, fmt, usage_label(q), proto.nbytes, {},
                                              alias_of=first.get(id(t)))
            first.setdefault(id(t), name)

    def load(self, name: str) -> torch.Tensor:
        t = self._state[name]
        return t.detach() if isinstance(t, QuantizedTensorStorage) and isinstance(t, torch.Tensor) else t


# --- grouped (MoE) weights: split into experts, or experts merged ---------------------------------

class GroupedView(Source):
    """``source`` with its grouped (MoE) weights split into per-expert tensors under Hugging Face's
    names (``mode="split"``), or its per-expert tensors merged into grouped ones (``"merge"``),
    exactly; every other tensor passes through. A split reads one expert's bytes per ``load``, a range
    of experts' per ``load_pieces``.
    The naming rule and the packing are the grouped format's (``te_serial.formats.grouped``)."""

    def __init__(self, inner: Source, mode: str, keep: frozenset[str] = frozenset()) -> None:
        from .transforms import plan_grouped
        self.__dict__.update(inner.__dict__)  # config, files, notes, activation amax… are the source's
        self.inner, self.layout = inner, inner.layout
        self.tensors = {}
        self._plan = plan_grouped(mode, {n: st.proto for n, st in inner.tensors.items()}, keep)
        for out, (srcs, merged) in self._plan.items():
            if srcs == [(out, None)]:
                self.tensors[out] = inner.tensors[out]
                continue
            proto = self._merged_proto(out, [n for n, _ in srcs]) if merged else self._member_proto(*srcs[0])
            q = proto.quantizer
            fmt = describe_quantizer(q) if q is not None else describe_dtype(proto.dtype)
            self.tensors[out] = SourceTensor(out, proto, fmt, usage_label(q), proto.nbytes,
                                             {"grouped": srcs, "merged": merged})

    def __getattr__(self, name: str) -> Any:  # the inner source's own protocol (info, file_of, read…)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _member_proto(self, name: str, i: int) -> TensorProto:
        p = self.inner.tensors[name].proto
        q = p.quantizer
        if q.member is None:
            return TensorProto(q.member_shapes[i], q.dtype)
        return TensorProto(q.member_shapes[i], p.dtype, q.member)

    def _merged_proto(self, out: str, names: list[str]) -> TensorProto:
        from ..formats.grouped import GroupedQuantizer
        protos = [self.inner.tensors[n].proto for n in names]
        first = protos[0]
        if any(p.quantizer != first.quantizer or p.dtype != first.dtype for p in protos):
            raise ConversionError(f"cannot merge {names[0]} … {names[-1]} into {out}: the experts differ in "
                                  "format or dtype", tensor=out)
        try:
            q = (GroupedQuantizer(member=first.quantizer, member_shapes=[p.shape for p in protos])
                 if first.quantizer is not None else
                 GroupedQuantizer(dtype=first.dtype, member_shapes=[p.shape for p in protos]))
        except (FormatError, ShapeError) as e:
            raise ConversionError(f"cannot merge {names[0]} … {names[-1]} into {out}: {e}", tensor=out) from None
        return TensorProto(q.group_shape, first.dtype, q)

    def _load_part(self, name: str, member: int | None) -> torch.Tensor:
        if member is None:
            return self.inner.load(name)
        return self.inner.load_members(name, member, member + 1).members()[0]

    def load(self, name: str) -> torch.Tensor:
        from .transforms import build_grouped
        keys = self.tensors[name].keys
        if "grouped" not in keys:
            return self.inner.load(name)
        return build_grouped(keys["grouped"], keys["merged"], self._load_part)

    def stream(self, name: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        if "grouped" not in self.tensors[name].keys:
            return self.inner.stream(name)
        if self._member_of(name) is None:
            return self.load(name), None
        [t], check = self.stream_pieces([name])
        return t, check

    def _member_of(self, name: str) -> tuple[str, int] | None:
        keys = self.tensors[name].keys
        if "grouped" not in keys or keys["merged"] or keys["grouped"][0][1] is None:
            return None
        return keys["grouped"][0]

    def piece_of(self, name: str) -> str | None:
        if "grouped" not in self.tensors[name].keys:
            return self.inner.piece_of(name)
        member = self._member_of(name)
        return member[0] if member is not None else None

    def stream_pieces(self, names: Sequence[str]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        if all("grouped" not in self.tensors[n].keys for n in names):
            return self.inner.stream_pieces(names)   # pieces the inner source splits (3-D experts)
        members = [self._member_of(n) for n in names]
        if any(m is None for m in members) or len({m[0] for m in members}) != 1:
            return [self.load(n) for n in names], None
        lo, hi = min(i for _, i in members), max(i for _, i in members) + 1
        stack, check = self.inner.stream_members(members[0][0], lo, hi)
        stack = stack.members()
        return [stack[i - lo] for _, i in members], check

    def stream_joined(self, names: Sequence[str]) -> tuple[torch.Tensor, Callable[[], None] | None] | None:
        if all("grouped" not in self.tensors[n].keys for n in names):
            return self.inner.stream_joined(names)
        members = [self._member_of(n) for n in names]
        if any(m is None for m in members) or len({m[0] for m in members}) != 1 \
                or [i for _, i in members] != list(range(members[0][1], members[0][1] + len(members))):
            return None
        return _joined_members(self.inner, members[0][0], members[0][1], members[0][1] + len(members))

    def close(self) -> None:
        self.inner.close()


# --- per-expert checkpoint tensors as transformers 5's 3-D expert parameters ------------------------

class FusedExpertsView(Source):
    """``source`` with the per-expert tensors of a MoE checkpoint (``experts.<i>.gate_proj.weight``…,
    Mixtral's ``w1``/``w3``/``w2``) seen as the 3-D expert parameters a transformers 5 model holds
    (``experts.gate_up_proj``, ``experts.down_proj``): plain experts stacked, quantized ones packed
    exactly into a grouped tensor whose members are each expert's gate rows then up rows (the
    format's ``join_rows``: refused, naming the block rule, where it is not exact). ``wanted``: the
    model's names; what :func:`te_serial.moe.plan_fused` maps is replaced, the rest passes through
    (``changes``: whether anything was)."""

    def __init__(self, inner: Source, wanted) -> None:
        from ..moe import plan_fused
        self.__dict__.update(inner.__dict__)  # config, files, notes, activation amax… are the source's
        self.inner, self.layout = inner, inner.layout
        fused, renamed = plan_fused(inner.tensors, wanted)
        self.changes = bool(fused or renamed)
        consumed = {n for f in fused for parts in f.parts for n in parts} | set(renamed.values())
        self.tensors = {n: st for n, st in inner.tensors.items() if n not in consumed}
        self._renamed = renamed
        for new, old in renamed.items():
            self.tensors[new] = dataclasses.replace(inner.tensors[old], name=new)
        for f in fused:
            proto = self._fused_proto(f)
            q = proto.quantizer
            fmt = describe_quantizer(q.member) if q is not None else describe_dtype(proto.dtype)
            self.tensors[f.name] = SourceTensor(f.name, proto, fmt, usage_label(q), proto.nbytes,
                                                {"experts": f.parts})

    def __getattr__(self, name: str) -> Any:  # the inner source's own protocol (info, file_of, read…)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _fused_proto(self, f) -> TensorProto:
        from ..formats.grouped import GroupedQuantizer
        from ..formats.slicing import check_row_join
        first = self.inner.tensors[f.parts[0][0]].proto
        protos = [[self.inner.tensors[n].proto for n in parts] for parts in f.parts]
        where = f"{f.parts[0][0]} … {f.parts[-1][-1]}"
        if any(p.quantizer != first.quantizer or p.dtype != first.dtype or len(p.shape) != 2
               for ps in protos for p in ps):
            raise ConversionError(f"cannot stack {where} into {f.name}: the experts differ in format, dtype or "
                                  "rank", tensor=f.name)
        shapes = {(sum(p.shape[0] for p in ps), ps[0].shape[1]) for ps in protos}
        if len(shapes) != 1 or any(p.shape[1] != ps[0].shape[1] for ps in protos for p in ps):
            raise ConversionError(f"cannot stack {where} into {f.name}: the experts' shapes differ", tensor=f.name)
        (shape,) = shapes
        q = first.quantizer
        if q is None:
            return TensorProto((len(protos), *shape), first.dtype)
        try:
            check_row_join(q, [p.shape[0] for p in protos[0]])
        except FormatError as e:
            raise ConversionError(f"cannot stack {where} into {f.name} exactly: {e}; load the checkpoint into a "
                                  "model that keeps gate and up apart, or convert it from high precision",
                                  tensor=f.name) from None
        try:
            g = GroupedQuantizer(member=q, member_shapes=[shape] * len(protos))
        except (FormatError, ShapeError) as e:
            raise ConversionError(f"cannot stack {where} into {f.name}: {e}", tensor=f.name) from None
        return TensorProto(g.group_shape, first.dtype, g)

    def load(self, name: str) -> torch.Tensor:
        from ..formats.grouped import GroupedTensor
        from ..formats.slicing import join_rows
        st = self.tensors[name]
        if name in self._renamed:
            return self.inner.load(self._renamed[name])
        if "experts" not in st.keys:
            return self.inner.load(name)
        g = st.quantizer
        if g is None:  # plain experts: each read once, straight into its rows of the stack
            out = torch.empty(st.shape, dtype=st.dtype)
            for i, parts in enumerate(st.keys["experts"]):
                r = 0
                for n in parts:
                    rows = self.inner.tensors[n].shape[0]
                    self.inner.read_into(n, out[i, r:r + rows])
                    r += rows
            return out
        members = []
        for parts in st.keys["experts"]:
            loaded = [self.inner.load(n) for n in parts]
            try:
                _, bufs = join_rows(g.member, [(t.logical_shape, t.buffers()) for t in loaded])
            except (FormatError, ShapeError) as e:
                raise ConversionError(f"cannot stack {' and '.join(parts)} into {name} exactly: {e}",
                                      tensor=name) from None
            members.append(bufs)
        return GroupedTensor(g.group_shape, st.dtype, g, **g.merge_buffers(members))

    def stream(self, name: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        st = self.tensors[name]
        if name in self._renamed or "experts" in st.keys:
            return self.load(name), None
        return self.inner.stream(name)

    def file_keys(self, name: str) -> list[str]:
        if name in self._renamed:
            return self.inner.file_keys(self._renamed[name])
        parts = self.tensors[name].keys.get("experts")
        if parts is None:
            return self.inner.file_keys(name)
        return [k for names in parts for n in names for k in self.inner.file_keys(n)]

    def close(self) -> None:
        self.inner.close()


class PerExpertView(Source):
    """``source`` with transformers 5's 3-D expert parameters (``experts.gate_up_proj``,
    ``experts.down_proj``; plain or grouped) written under the per-expert names its architecture's
    checkpoints and engines use (:func:`te_serial.moe.plan_split_fused`: Qwen's ``gate_proj`` /
    ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe...w1`` / ``w3`` / ``w2``, its router
    renamed with it). A quantized expert's gate and up are its rows' halves (``slice_quantized``:
    exact, each keeping what holds the whole expert, e.g. NVFP4's one tensor amax: the global scale
    gate and up share, as engines need). ``load`` reads one expert's bytes; ``load_pieces`` a range of
    experts' bytes in one read, for the export that writes them one by one."""

    def __init__(self, inner: Source) -> None:
        from ..fusion import architecture_of
        from ..moe import checkpoint_name, fused_name, plan_split_fused
        from ..precision import is_expert_weight
        self.__dict__.update(inner.__dict__)
        self.inner, self.layout = inner, inner.layout
        arch = architecture_of(inner.config)
        self._parts = plan_split_fused({n: st.shape for n, st in inner.tensors.items()}, arch)
        #: 3-D experts this architecture's checkpoints keep whole (gpt-oss), left so by the grouped split
        self.kept_whole = frozenset(n for n, st in inner.tensors.items()
                                    if is_expert_weight(n, st.shape) and fused_name(n))
        split = {p.source for p in self._parts.values()}
        self._renamed: dict[str, str] = {}
        self.tensors = {}
        parts_of: dict[str, list] = {}
        for out, part in self._parts.items():
            parts_of.setdefault(part.source, []).append((out, part))
        for name, st in inner.tensors.items():
            if name in split:
                made: dict[tuple | None, SourceTensor] = {}   # one prototype per row range, for every expert
                for out, part in parts_of[name]:
                    like = made.get(part.rows)
                    self.tensors[out] = made[part.rows] = self._part_tensor(out, st, part) if like is None else \
                        dataclasses.replace(like, name=out, keys={"expert_part": part})
                continue
            new = checkpoint_name(name, arch)
            if new in self.tensors or (new != name and new in inner.tensors):
                raise ConversionError(f"writing experts under their checkpoint names gives {new!r} twice", tensor=new)
            if new != name:
                self._renamed[new] = name
            self.tensors[new] = dataclasses.replace(st, name=new) if new != name else st

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _part_tensor(self, out: str, st: SourceTensor, part) -> SourceTensor:
        g = st.quantizer
        rows = part.rows or (0, st.shape[1])
        shape = (rows[1] - rows[0], st.shape[2])
        if g is None:
            proto = TensorProto(shape, st.dtype)
        else:
            q = g.member_format()
            align = q.slice_alignment()[0]
            if rows[0] % align:
                raise ConversionError(f"cannot write {out} exactly: the gate of {st.name} ends at row {rows[0]}, "
                                      f"not on {q.layout_name()}'s row blocks of {align}; keep the expert whole "
                                      "(convert to a te-serial recipe) or convert from high precision", tensor=out)
            proto = TensorProto(shape, st.dtype, q)
        fmt = describe_quantizer(proto.quantizer) if proto.quantizer is not None else describe_dtype(proto.dtype)
        return SourceTensor(out, proto, fmt, usage_label(proto.quantizer), proto.nbytes, {"expert_part": part})

    def load(self, name: str) -> torch.Tensor:
        part = self.tensors[name].keys.get("expert_part") if name in self.tensors else None
        if part is None:
            return self.inner.load(self._renamed.get(name, name))
        return self.load_pieces([name])[0]   # that expert's bytes only

    def stream(self, name: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        st = self.tensors[name]
        if "expert_part" in st.keys:
            [t], check = self.stream_pieces([name])
            return t, check
        return self.inner.stream(self._renamed.get(name, name))

    def piece_of(self, name: str) -> str | None:
        part = self.tensors[name].keys.get("expert_part")
        return part.source if part is not None else None

    def stream_pieces(self, names: Sequence[str]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        from ..formats.slicing import slice_quantized
        parts = [self.tensors[n].keys.get("expert_part") for n in names]
        if any(p is None for p in parts) or len({p.source for p in parts}) != 1:
            return super().stream_pieces(names)
        source = parts[0].source
        lo, hi = min(p.expert for p in parts), max(p.expert for p in parts) + 1
        stack, check = self.inner.stream_members(source, lo, hi)
        if self.inner.tensors[source].quantizer is None:
            return [stack[p.expert - lo][p.rows[0]:p.rows[1]] if p.rows else stack[p.expert - lo]
                    for p in parts], check
        members = stack.members()
        return [slice_quantized(members[p.expert - lo], rows=p.rows) if p.rows else members[p.expert - lo]
                for p in parts], check

    def stream_joined(self, names: Sequence[str]) -> tuple[torch.Tensor, Callable[[], None] | None] | None:
        parts = [self.tensors[n].keys.get("expert_part") for n in names]
        if any(p is None for p in parts) or len({p.source for p in parts}) != 1:
            return None
        source = parts[0].source
        rows = self.inner.tensors[source].shape[1]
        expert, at = parts[0].expert, 0
        for p in parts:   # every row of experts lo .. hi - 1, in order
            r0, r1 = p.rows or (0, rows)
            if p.expert != expert or r0 != at:
                return None
            expert, at = (expert + 1, 0) if r1 == rows else (expert, r1)
        if at:
            return None
        return _joined_members(self.inner, source, parts[0].expert, expert)

    def close(self) -> None:
        self.inner.close()


def _joined_members(source: Source, name: str, start: int, stop: int
                    ) -> tuple[torch.Tensor, Callable[[], None] | None] | None:
    """Experts ``start`` .. ``stop - 1`` of the quantized stack ``name``, their rows joined into one
    tensor (None where its format does not join them exactly), and their check (as :meth:`Source.stream`)."""
    if source.tensors[name].quantizer is None:
        return None
    stack, check = source.stream_members(name, start, stop)
    try:
        return stack.rows_joined(), check
    except (FormatError, ShapeError):
        return None


def split_experts(source: Source) -> Source:
    """``source`` with every expert weight under its own per-expert name, as engines read them: 3-D
    transformers 5 experts (:class:`PerExpertView`) and TE grouped weights (:class:`GroupedView`)."""
    experts = PerExpertView(source)
    return GroupedView(experts, "split", experts.kept_whole)
