"""Writing checkpoints: :class:`CheckpointWriter` (the one writer) and ``save_quantized`` over it.

The files are planned from the prototypes before any byte is written (:class:`~.shards.ShardSet`):
every buffer's shard, offset and header entry follow from its prototype, so each tensor is
streamed straight to its place and no more than one tensor's bytes are held beyond the caller's
own (a device tensor's CPU copy, or a non-contiguous tensor's contiguous copy).

Atomicity: every file is written under a temporary name and fsync'd. A directory's shards carry a
per-save id in their names, so a save never overwrites the shards the current manifest points
to; the manifest's rename is the commit point. After it, files of te-serial's own naming that the
new manifest does not name (the previous save's shards, and what killed saves left behind) are
removed. A single ``.safetensors`` file is renamed over the old one in one step.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Mapping

import torch

from .._version import __version__
from ..errors import CheckpointError, UnsupportedValueError
from ..formats.tensors import QuantizedTensorStorage
from ..proto import TensorProto, to_tensor_proto
from ..recipes import RECIPES, recipe_quantizer
from ..te.interop import from_te, is_te_tensor
from .fileops import TMP_PREFIX, atomic_write, clean_directory, fsync_path, writing
from .header import SHARD_METADATA
from .shards import ShardSet
from .manifest import (HEADER_KEY, MANIFEST_NAME, PLAIN_BUFFER, SELF_FILE, VERSION, BufferEntry, Manifest,
                       TensorEntry, buffer_key, expected_buffers)
from .tree import TensorRef, flatten_tree

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: shard names of te-serial checkpoint directories (the 8 hex digits are the save's id)
SHARD_NAME = re.compile(r"model-[0-9a-f]{8}-\d{5}-of-\d{5}\.safetensors")


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` / ``500MiB`` / an int (decimal units, 1 GB = 10^9 bytes, as Hugging Face)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m:
            raise CheckpointError(f"cannot read size {size!r} (use e.g. '5GB', '500MiB' or bytes)",
                                  field="max_shard_size")
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if value <= 0:
        raise CheckpointError(f"size must be positive, got {size!r}", field="max_shard_size")
    return value


def producer() -> dict[str, Any]:
    """The manifest's record of what wrote it."""
    try:
        from importlib.metadata import version
        te_version = version("transformer-engine")
    except Exception:  # noqa: BLE001 - TE is optional
        te_version = None
    return {"te_serial": __version__, "torch": torch.__version__.split("+")[0],
            "transformer_engine": te_version}


def stored_buffers(name: str, t: Any) -> tuple[TensorProto, dict[str, torch.Tensor]]:
    """(prototype, {buffer: tensor viewed as its stored dtype}) of a plain, te-serial or TE tensor."""
    if is_te_tensor(t):  # TE's own classes: converted on the way in, same bytes; experimental ones refused
        t = from_te(t, name=name)
    proto = to_tensor_proto(t)
    proto = TensorProto(proto.shape, proto.dtype, proto.quantizer, proto.requires_grad)
    if isinstance(t, QuantizedTensorStorage):
        q = proto.quantizer
        buffers = t.buffers()
        q.check_buffers(proto.shape, buffers, where=f"tensor {name!r}")
        values = q.value_dtypes()
        return proto, {n: b.detach().view(values[n]) for n, b in buffers.items()}
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {name!r} has layout {t.layout}; only dense tensors are saved")
    return proto, {PLAIN_BUFFER: t.detach()}


def _identity(buffers: Mapping[str, torch.Tensor]) -> tuple | None:
    """Equal identities hold the same bytes at the same place (tied weights); None if there is
    no storage to compare (empty tensors are never taken as tied)."""
    ident = []
    for t in buffers.values():
        if t.numel() == 0:
            return None
        ident.append((t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                      t.stride(), t.dtype))
    return tuple(ident)


class CheckpointWriter:
    """The one checkpoint writer: the layout planned from prototypes, tensors streamed to their place.

    ``protos``: flat name → :class:`TensorProto` of every tensor, in checkpoint order.
    ``aliases``: tied name → the name whose buffers it shares (written once). ``tree``: the
    state dict's structure (None: a flat dict of the tensors). ``path`` ending in
    ``.safetensors`` → one file whose header carries the manifest; otherwise a directory of
    shards, each at most ``max_shard_size`` (decimal units) unless one buffer alone is larger.

    :meth:`write` each tensor (any order; its quantizer may differ from the planned one only in
    fields that leave its buffers' shapes and dtypes alone, e.g. a delayed-scaling scale found
    from the data); :meth:`close` commits. As a context manager, leaving the block normally
    commits and an exception aborts (temporary files removed, the previous checkpoint untouched).
    """

    def __init__(self, path: str | os.PathLike, protos: Mapping[str, TensorProto], *,
                 aliases: Mapping[str, str] | None = None, tree: Any = None,
                 max_shard_size: int | str = "5GB", metadata: Mapping[str, str] | None = None,
                 checksums: bool = True) -> None:
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        bad = [k for k, v in self.metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise UnsupportedValueError(f"metadata must map str to str; bad keys {bad[:5]}", field="metadata")
        self.protos = dict(protos)
        self.aliases = dict(aliases or {})
        for a, b in self.aliases.items():
            if a not in self.protos or b not in self.protos or b in self.aliases:
                raise CheckpointError(f"alias {a!r} → {b!r} must tie two planned tensors, the second not an alias")
        self.tree = tree
        self.checksums = checksums
        self.single = self.path.suffix == ".safetensors"
        self.manifest: Manifest | None = None
        self._entries: dict[str, TensorEntry] = {}
        self._members: dict[str, tuple[int, TensorProto]] = {}   # a grouped tensor written in parts: (members done, its proto)
        self._closed = False
        layout = [(buffer_key(name, b), shape, dtype) for name, proto in self.protos.items()
                  if name not in self.aliases for b, (shape, dtype) in expected_buffers(proto).items()]
        limit = parse_size(max_shard_size)
        if self.single:
            if self.path.is_dir():
                raise CheckpointError("checkpoint path ends in .safetensors but is a directory", file=str(self.path))
            self.root = self.path.parent
            with writing(self.root):
                self.root.mkdir(parents=True, exist_ok=True)
            self._files = ShardSet(self.root, layout, limit=limit, shard_name=None, single=self.path,
                                   reserve=self._header_reserve())
        else:
            if self.path.exists() and not self.path.is_dir():
                raise CheckpointError("checkpoint path exists and is not a directory", file=str(self.path))
            self.root = self.path
            with writing(self.root):
                self.root.mkdir(parents=True, exist_ok=True)
            save_id = secrets.token_hex(4)
            self._files = ShardSet(self.root, layout, limit=limit, metadata=SHARD_METADATA,
                                   shard_name=lambda i, n: f"model-{save_id}-{i + 1:05d}-of-{n:05d}.safetensors")

    def _header_reserve(self) -> int:
        """Room for a single file's manifest: its size with the widest checksums."""
        widest = 2 ** 64 - 1 if self.checksums else None
        entries = {name: TensorEntry(p, {b: BufferEntry(SELF_FILE, buffer_key(name, b), s, d, widest)
                                         for b, (s, d) in expected_buffers(p).items()})
                   for name, p in self.protos.items()}
        manifest = self._manifest(entries, {})
        return len(base64.b64encode(manifest.to_bytes())) + len(HEADER_KEY) + 64

    def _manifest(self, entries: Mapping[str, TensorEntry], files: Mapping[str, int]) -> Manifest:
        tree = self.tree
        if isinstance(tree, dict) and list(tree) == list(self.protos) and all(
                isinstance(v, TensorRef) and v.name == k for k, v in tree.items()):
            tree = None  # a flat dict of tensors under their own names: the manifest's default
        return Manifest.from_entries(entries, files, tree=tree, aliases=self.aliases,
                                     metadata=self.metadata, producer=producer())

    def write(self, name: str, tensor: Any) -> None:
        """Stream one planned tensor (plain, te-serial quantized, or TE's) to its place."""
        planned = self._planned(name)
        proto, buffers = stored_buffers(name, tensor)
        if expected_buffers(proto) != expected_buffers(planned):
            raise UnsupportedValueError(f"tensor {name!r} does not match its planned prototype "
                                        f"({proto} vs {planned})")
        entries = {}
        for b, t in buffers.items():
            key = buffer_key(name, b)
            digest = self._files.write(key, t.cpu() if t.device.type != "cpu" else t,
                                       with_checksum=self.checksums)
            entries[b] = BufferEntry(self._file_of(key), key, tuple(t.shape), t.dtype, digest)
        self._entries[name] = TensorEntry(proto, entries)

    add = write

    def write_members(self, name: str, part: Any) -> None:
        """Stream the next experts of the planned grouped tensor ``name``: ``part``, a grouped tensor of
        its members ``k`` .. ``k + n - 1`` after the ``k`` written before (a stack too large to hold
        at once, written a range of experts at a time). The tensor is written with its last member."""
        planned = self._planned(name)
        group = planned.quantizer
        proto, buffers = stored_buffers(name, part)
        start, first = self._members.get(name, (0, None))
        count = proto.quantizer.num_tensors if proto.quantizer is not None and proto.quantizer.is_container else 0
        if group is None or not group.is_container or not count or start + count > group.num_tensors:
            raise UnsupportedValueError(f"tensor {name!r}: expected members {start}.. of its planned {planned}, "
                                        f"got {proto}")
        span, where = group.member_span(start, start + count)
        whole = TensorProto(planned.shape, proto.dtype, proto.quantizer.of_whole(planned.shape), proto.requires_grad)
        if expected_buffers(proto) != expected_buffers(TensorProto(span.group_shape, planned.dtype, span)) \
                or expected_buffers(whole) != expected_buffers(planned):
            raise UnsupportedValueError(f"members {start}..{start + count - 1} of tensor {name!r} do not match its "
                                        f"planned prototype ({proto} vs {planned})")
        if first is not None and whole != first:
            raise UnsupportedValueError(f"members {start}..{start + count - 1} of tensor {name!r} are {proto}, "
                                        f"the members before them {first}: a tensor's members share one format")
        digests = {b: self._files.write_part(buffer_key(name, b), t.cpu() if t.device.type != "cpu" else t,
                                             where[b][0] * t.element_size(), with_checksum=self.checksums)
                   for b, t in buffers.items()}
        if start + count < group.num_tensors:
            self._members[name] = (start + count, whole)
            return
        self._members.pop(name, None)
        self._entries[name] = TensorEntry(whole, {b: BufferEntry(self._file_of(buffer_key(name, b)), buffer_key(name, b),
                                                                 shape, dtype, digests[b])
                                                  for b, (shape, dtype) in expected_buffers(whole).items()})

    def _planned(self, name: str) -> TensorProto:
        """Tensor ``name``'s planned prototype, where it may be written now."""
        if self._closed:
            raise CheckpointError("checkpoint writer is closed", file=str(self.path), tensor=name)
        planned = self.protos.get(name)
        if planned is None or name in self.aliases:
            raise UnsupportedValueError(f"tensor {name!r} is not in the writer's plan"
                                        + (" (it is tied to another)" if name in self.aliases else ""))
        if name in self._entries:
            raise UnsupportedValueError(f"tensor {name!r} written twice")
        return planned

    def _file_of(self, key: str) -> str:
        """The manifest's name of the file holding buffer ``key``."""
        return SELF_FILE if self.single else self._files.names[self._files.file_of[key]]

    def close(self) -> Manifest:
        """Finish every file, then commit: shards renamed into place, the manifest last."""
        if self._closed:
            raise CheckpointError("checkpoint writer already closed", file=str(self.path))
        self._closed = True
        try:
            missing = [n for n in self.protos if n not in self._entries and n not in self.aliases]
            if missing:
                raise CheckpointError(f"{len(missing)} planned tensors were never written, e.g. {missing[0]!r}",
                                      file=str(self.path), tensor=missing[0])
            entries = {n: self._entries[self.aliases.get(n, n)] for n in self.protos}
            if self.single:
                manifest = self._manifest(entries, {})
                self._files.finish({HEADER_KEY: base64.b64encode(manifest.to_bytes()).decode("ascii")})
                self._files.commit()  # the commit: one rename over the old file
            else:
                sizes = self._files.finish()
                manifest = self._manifest(entries, sizes)
                self._files.commit()  # still invisible: no manifest names them yet
                atomic_write(self.root / MANIFEST_NAME, manifest.to_bytes())  # the commit
        except BaseException:
            self._files.abort()
            raise
        fsync_path(self.root, directory=True)
        if self.single:
            clean_directory(self.root, set(), re.compile(re.escape(f"{TMP_PREFIX}") + r"[0-9a-f]{8}-"
                                                         + re.escape(self.path.name) + r"(\.grow)?"),
                            leftovers=False)
        else:
            clean_directory(self.root, {MANIFEST_NAME, *manifest.files}, SHARD_NAME)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop everything this writer wrote; the previous checkpoint stays as it was."""
        self._closed = True
        self._files.abort()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_quantized(obj: Any, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                   metadata: Mapping[str, str] | None = None, checksums: bool = True) -> Manifest:
    """Save a state dict (or ``nn.Module``) of plain and quantized tensors, without pickle.

    ``path`` ending in ``.safetensors`` → one file whose header carries the manifest; otherwise
    a directory of shards (each ≤ ``max_shard_size`` unless one buffer alone is larger) plus
    ``te_serial.msgpack``. Plain Python values in the state dict go into the manifest; tied
    tensors are stored once. Returns the manifest written.

    A model with a Hugging Face config (``model.config.to_dict()``) has it recorded as JSON text
    under the manifest metadata key ``hf_config`` (plain data, never pickle) and, in a directory,
    also written as ``config.json`` beside the manifest, so ``te_serial.convert`` of the checkpoint
    to ``bf16`` or a serving layout writes a complete Hugging Face directory. When the model holds
    te-serial quantized tensors, that config carries ``quantization_config`` (``quant_method``
    ``te_serial``: :func:`quantization_config`) and the directory also gets the weight index
    :data:`HF_INDEX_NAME`, through which ``from_pretrained`` reads it once ``te_serial.hf`` is imported.
    """
    tree, tensors = flatten_tree(obj)
    protos: dict[str, TensorProto] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for name, t in tensors.items():
        proto, buffers = stored_buffers(name, t)
        protos[name] = proto
        ident = _identity(buffers)
        if ident is not None:
            tied = first.setdefault((proto, ident), name)
            if tied != name:
                aliases[name] = tied
    config = _hf_config(obj, protos)
    if config is not None and not (metadata and HF_CONFIG_KEY in metadata):
        metadata = {**(metadata or {}), HF_CONFIG_KEY: config}
    with CheckpointWriter(path, protos, aliases=aliases, tree=tree, max_shard_size=max_shard_size,
                          metadata=metadata, checksums=checksums) as writer:
        for name, t in tensors.items():
            if name not in aliases:
                writer.write(name, t)
    if config is not None and not writer.single:  # after the commit: config.json as HF directories hold it
        write_hf_files(writer.root, writer.manifest, json.loads(config))
    return writer.manifest


#: manifest metadata key holding a saved model's Hugging Face config (JSON text)
HF_CONFIG_KEY = "hf_config"
#: ``quantization_config["quant_method"]`` of a model holding te-serial quantized tensors (``te_serial.hf``)
QUANT_METHOD = "te_serial"
#: the weight index (Hugging Face's sharded-index JSON) of a directory holding te-serial quantized
#: tensors. Not ``model.safetensors.index.json``: transformers without te-serial's quantizer then
#: finds no weights and says so, instead of loading the buffers as unexpected keys and random weights
HF_INDEX_NAME = "te_serial.safetensors.index.json"
#: ``config.json``'s ``transformers_weights`` in such a directory: it names no weight file, so
#: transformers without te-serial refuses it and quotes it (``te_serial.hf`` points it to
#: :data:`HF_INDEX_NAME` while loading)
HF_INSTALL_HINT = "te-serial checkpoint: pip install 'te-serial[hf]' and import te_serial.hf before from_pretrained"


def _recipe_of(q: Any, uniform_usages: bool, cache: dict) -> str | dict:
    """A module's entry in ``quantization_config["modules"]``: the recipe name that makes quantizer
    ``q`` (a grouped weight: its members; with its usages, where all modules share them), else the
    quantizer's own fields."""
    key = (q, uniform_usages)
    if key not in cache:
        m = q.member_format()  # a grouped (MoE) weight: its experts' recipe
        names = [n for n in RECIPES if recipe_quantizer(n, rowwise=m.rowwise, columnwise=m.columnwise) == m]
        cache[key] = names[0] if names and uniform_usages else q.to_dict()
    return cache[key]


def quantization_config(protos: Mapping[str, TensorProto]) -> dict | None:
    """``config.json``'s ``quantization_config`` for a model whose tensors have these prototypes (None
    when none is quantized): ``quant_method`` ``te_serial``, the ``format_version`` written, per
    quantized module (a tensor's name less ``.weight``) its ``recipe`` name — or its quantizer's fields
    where no recipe makes it or the modules' usages differ — and ``recipe`` / ``usages`` where every
    module shares them. The manifest's prototypes stay the authority; this says what the directory holds."""
    quantized = {n: p.quantizer for n, p in protos.items() if p.quantizer is not None}
    if not quantized:
        return None
    usages = {tuple(u for u in ("rowwise", "columnwise") if getattr(q, u)) for q in quantized.values()}
    cache: dict = {}
    modules = {(n[: -len(".weight")] if n.endswith(".weight") else n): _recipe_of(q, len(usages) == 1, cache)
               for n, q in quantized.items()}
    recipes = {json.dumps(v, sort_keys=True) for v in modules.values()}
    recipe = next(iter(modules.values())) if len(recipes) == 1 else None
    return {"quant_method": QUANT_METHOD, "format_version": f"{VERSION[0]}.{VERSION[1]}",
            "recipe": recipe if isinstance(recipe, str) else None, "exclude": None,
            "usages": list(next(iter(usages))) if len(usages) == 1 else None, "fused": None, "modules": modules}


def _hf_index(manifest: Manifest) -> bytes:
    """:data:`HF_INDEX_NAME`: every stored key → its shard, as Hugging Face's sharded index lists them."""
    weight_map = {key: file for file, rows in manifest.buffers_by_file().items() for _, _, key, _, _ in rows}
    index = {"metadata": {"total_size": manifest.nbytes(), "format": "te-serial"},
             "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def _hf_config(obj: Any, protos: Mapping[str, TensorProto] | None = None) -> str | None:
    """The JSON text of ``obj.config`` for a model that has a Hugging Face-style config, else None;
    its ``quantization_config`` is the one :func:`quantization_config` gives ``protos`` (a te-serial
    one the model's config carried, e.g. from ``from_pretrained``, is replaced or dropped)."""
    config = getattr(obj, "config", None) if isinstance(obj, torch.nn.Module) else None
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    if callable(getattr(config, "to_json_string", None)):
        data = json.loads(config.to_json_string(use_diff=False))
    else:
        data = json.loads(json.dumps(config.to_dict(), default=str))
    if not data.get("architectures"):
        data["architectures"] = [type(obj).__name__]
    return json.dumps(hf_config_for(data, protos or {}), sort_keys=True)


def hf_config_for(data: Mapping[str, Any], protos: Mapping[str, TensorProto]) -> dict:
    """A Hugging Face config (a dict) for a te-serial directory holding tensors of these prototypes:
    any te-serial marks it carried replaced by the ``quantization_config`` (:func:`quantization_config`)
    and install hint the tensors call for, none where no tensor is quantized."""
    data = without_te_serial_config(dict(data))
    qc = quantization_config(protos)
    if qc is not None:
        data.update(quantization_config=qc, transformers_weights=HF_INSTALL_HINT)
    return data


def write_hf_files(root: Path, manifest: Manifest, config: Mapping[str, Any]) -> list[str]:
    """``config.json`` of a te-serial checkpoint directory (committed), and the weight index
    :data:`HF_INDEX_NAME` where the config names te-serial's method; the names written."""
    atomic_write(root / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    if (config.get("quantization_config") or {}).get("quant_method") != QUANT_METHOD:
        return ["config.json"]
    atomic_write(root / HF_INDEX_NAME, _hf_index(manifest))
    return ["config.json", HF_INDEX_NAME]


def without_te_serial_config(data: dict) -> dict:
    """A Hugging Face config (a dict) less what marks a te-serial directory: its ``quantization_config``
    and the install hint (or ``te_serial.hf``'s pointer) in ``transformers_weights``."""
    data = dict(data)
    if (data.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD:
        del data["quantization_config"]
    if data.get("transformers_weights") in (HF_INSTALL_HINT, HF_INDEX_NAME):
        del data["transformers_weights"]
    return data
