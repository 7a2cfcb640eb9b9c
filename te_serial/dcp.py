"""PyTorch distributed checkpoint (DCP) over te-serial's I/O core, without pickle.

Thin wrappers over ``torch.distributed.checkpoint``: :func:`save`, :func:`async_save` and
:func:`load` pass te-serial's :class:`SavePlanner` / :class:`LoadPlanner` and
:class:`StorageWriter` / :class:`StorageReader` to ``dcp.save`` / ``dcp.async_save`` /
``dcp.load``; users who call DCP themselves can pass those pieces directly.

How a sharded state dict is stored (a te-serial checkpoint, format 1.2, schema/README.md §13):

* Every rank writes its own safetensors shard(s) through the one writer's file layer
  (:class:`~te_serial.checkpoint.files.ShardSet`), named ``model-<save id>-<i>-of-<n>.safetensors``
  with one save id the coordinator picks. The coordinator writes ``te_serial.msgpack``, the
  manifest, whose rename commits the checkpoint (as for single-process saves). DCP's own
  pickled ``.metadata`` is never written: the manifest holds DCP's global metadata (shapes,
  chunks, which file and key holds each chunk) in plain msgpack, and :class:`StorageReader`
  rebuilds DCP's ``Metadata`` from it.
* A quantized tensor — a te-serial quantized tensor, or a ``DTensor`` whose local tensor is one
  (as FSDP2 holds a ``Shard(0)`` shard) — is saved as its inner buffers: DCP sees one tensor per
  buffer, named ``<tensor>.<buffer>`` and shaped as the buffer's *region view* (the format's
  rule: data as [M, K / pack], scales as their valid block grid, tensor-wide scalars whole), and
  each rank's shard is placed in it by the format's slicing rule
  (:func:`te_serial.formats.slicing.buffer_regions`). Local scale padding is never saved.
  Shards must hold whole blocks of the format (128 rows blockwise, 32 MXFP8, 16 NVFP4).
  Tensor-wide scalars (per-tensor FP8 ``_scale_inv``, NVFP4 amax) are written once and must
  be equal on every rank.
* Plain tensors and plain ``DTensor`` s are chunked as DCP chunks them.
* Plain values (numbers, strings, bools, None, bytes, lists / tuples / dicts of them) are kept in
  the manifest's tree, as ``save_quantized`` keeps them; anything else is refused with
  :class:`~te_serial.UnsupportedValueError` naming its path (DCP would pickle it).

Loading reads only the bytes each rank needs, on any world size: the prototypes allocate what is
missing (meta tensors), scale padding is zeroed, and DCP fills the buffers in place.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import secrets
import struct
import warnings
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as _dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import _create_write_items, create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.futures import Future

from .checkpoint.files import ShardSet, atomic_write, clean_directory, fsync_path
from .checkpoint.manifest import MANIFEST_NAME, BufferEntry, Manifest, TensorEntry, buffer_key, chunk_key, \
    expected_buffers
from .checkpoint.reader import Checkpoint
from .checkpoint.tree import TEExtraState, TensorRef, flatten_tree
from .checkpoint.writer import SHARD_NAME, CheckpointWriter, parse_size, producer
from .errors import CheckpointError, ManifestError, ShapeError, TeSerialError, UnsupportedValueError
from .formats.base import QuantizedTensorStorage, flatten_2d
from .formats.slicing import box_to_range, buffer_regions, region_views, storage_view
from .proto import TensorProto

__all__ = ["save", "async_save", "load", "consolidate", "SavePlanner", "LoadPlanner", "StorageWriter",
           "StorageReader"]

_KEY = "te_serial"


# --- the local view of one state-dict tensor ---------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_quantized(t: Any) -> bool:
    return isinstance(t, QuantizedTensorStorage)


class _Local(NamedTuple):
    """One state-dict tensor on this rank: the global prototype and where the local part sits."""

    name: str
    proto: TensorProto                          # global shape, nominal dtype, quantizer
    local: Any                                  # the local tensor (quantized storage or plain)
    box: tuple[tuple[int, ...], tuple[int, ...]] | None  # local chunk (offsets, sizes); None: whole
    dtensor: DTensor | None


def _local_view(name: str, value: Any, *, loading: bool = False) -> _Local:
    """Prototype and local chunk of a plain / quantized tensor or DTensor (quantized local)."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if any(p.is_partial() for p in value.placements):
            raise UnsupportedValueError(f"tensor {name!r} is a DTensor with Partial placements "
                                        f"{value.placements}; reduce it before saving")
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        box = (tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
        q = local.quantizer if _is_quantized(local) else None
        proto = TensorProto(tuple(value.shape), value.dtype, q, bool(value.requires_grad))
        if q is not None and tuple(local.shape) != box[1]:
            raise ShapeError(f"tensor {name!r} on rank {_rank()}: the local quantized tensor is "
                             f"{list(local.shape)} but its DTensor placement gives a shard of {list(box[1])}")
        return _Local(name, proto, local, box, value)
    if _is_quantized(value):
        if value.device.type == "meta" and not loading:
            raise UnsupportedValueError(f"tensor {name!r} is on the meta device and holds no data")
        return _Local(name, TensorProto(tuple(value.shape), value.dtype, value.quantizer,
                                        bool(getattr(value, "requires_grad", False))), value, None, None)
    from .te.interop import from_te, is_te_tensor
    if is_te_tensor(value):
        value = from_te(value, name=name)
        return _Local(name, TensorProto(tuple(value.shape), value.dtype, value.quantizer, False), value, None, None)
    if not isinstance(value, torch.Tensor):
        raise UnsupportedValueError(f"value at {name!r} is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {name!r} has layout {value.layout}; only dense tensors are saved")
    if value.device.type == "meta" and not loading:
        raise UnsupportedValueError(f"tensor {name!r} is on the meta device and holds no data")
    return _Local(name, TensorProto(tuple(value.shape), value.dtype, None, bool(value.requires_grad)),
                  value, None, None)


def _quantized_range(loc: _Local) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The local shard's (rows, cols) in the global 2-D view, checked against the format's blocks;
    None for an empty shard."""
    q, shape = loc.proto.quantizer, loc.proto.shape
    m, k = flatten_2d(shape)
    if loc.box is None:
        return (0, m), (0, k)
    offsets, sizes = loc.box
    if 0 in sizes:
        return None
    rc = box_to_range(shape, offsets, sizes)
    if rc is None:
        raise ShapeError(f"tensor {loc.name!r} on rank {_rank()}: its shard at offsets {list(offsets)} with sizes "
                         f"{list(sizes)} is not one range of rows × columns of the tensor's 2-D view; shard "
                         "quantized tensors along dim 0 (FSDP2's Shard(0))")
    (r0, r1), (c0, c1) = rc
    ra, ca = q.slice_alignment()
    for what, (a, b), n, block in (("rows", (r0, r1), m, ra), ("columns", (c0, c1), k, ca)):
        if a % block or (b % block and b != n):
            raise ShapeError(
                f"tensor {loc.name!r} on rank {_rank()}: its shard holds {what} [{a}, {b}) of {n}, which is not "
                f"aligned to the {q.layout_name()} block of {block} {what}; shard so that every rank holds whole "
                f"blocks (a multiple of {block} {what}, the last rank the rest)")
    return rc


def _buffer_pieces(loc: _Local, *, loading: bool = False) -> dict[str, tuple[tuple, tuple, torch.Tensor]]:
    """buffer → (global box offsets, sizes, the local data of that box in the stored dtype) of a
    quantized tensor's local shard. An empty shard saves nothing and loads only the tensor-wide
    buffers (its scale_inv / amax)."""
    rc = _quantized_range(loc)
    q, local = loc.proto.quantizer, loc.local
    lshape = tuple(local.shape)
    views, specs, values = region_views(q, lshape), q.describe_buffers(lshape), q.value_dtypes()
    if rc is None:
        if not loading:
            return {}
        wide = _tensor_wide(q)
        return {b: ((0,) * len(views[b]), views[b], buf.view(values[b])) for b, buf in local.buffers().items()
                if b in wide}
    boxes = buffer_regions(q, loc.proto.shape, *rc)
    out = {}
    for b, buf in local.buffers().items():
        view = views[b]
        region = buf.reshape(storage_view(specs[b].shape, view))[tuple(slice(0, v) for v in view)]
        offsets, sizes = boxes[b]
        if tuple(region.shape) != tuple(sizes):  # unreachable for aligned shards
            raise ShapeError(f"tensor {loc.name!r}: buffer {b} region {list(region.shape)} != {list(sizes)}")
        out[b] = (offsets, sizes, region.view(values[b]))
    return out


def _tensor_wide(q) -> set[str]:
    """Buffers with one value for the whole tensor: scales without a block grid, amaxes (not a
    per-row amax, which is sharded with the rows)."""
    out = set()
    for u in q.usages_on():
        lay = q.usage_layout(u)
        if lay.grid is None:
            out.add(lay.scale)
        if lay.amax is not None and not lay.amax_rows:
            out.add(lay.amax)
    return out


def _float32(hexbytes: str) -> str:
    raw = bytes.fromhex(hexbytes)
    return repr(struct.unpack("<f", raw)[0]) if len(raw) == 4 else raw.hex()


def _proto_dict(p: TensorProto) -> dict:
    return {"shape": list(p.shape), "dtype": str(p.dtype), "requires_grad": p.requires_grad,
            "quantizer": p.quantizer.to_dict() if p.quantizer is not None else None}


def _describe(p: TensorProto) -> str:
    q = p.quantizer
    return f"{'plain' if q is None else q.layout_name()} {list(p.shape)} {str(p.dtype).replace('torch.', '')}"


# --- saving --------------------------------------------------------------------------------------------

class SavePlanner(DefaultSavePlanner):
    """DCP save planner for te-serial: quantized tensors (and DTensors of them) become their
    buffers' pieces; plain values stay in the manifest's tree (never pickled)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        tree, tensors = flatten_tree(state_dict)
        self.tree = tree
        self.is_coordinator = is_coordinator
        self.state_dict = {}
        self._pieces: dict[MetadataIndex, torch.Tensor] = {}
        self._items: list[WriteItem] = []
        self._protos: dict[str, TensorProto] = {}
        self._scalars: dict[str, str] = {}
        for name, value in tensors.items():
            loc = _local_view(name, value)
            self._protos[name] = loc.proto
            q = loc.proto.quantizer
            if q is None:
                self.state_dict[name] = value
                for item in _create_write_items(name, value):
                    if item.tensor_data is not None and 0 in item.tensor_data.chunk.sizes:
                        continue  # an empty shard holds no bytes
                    self._items.append(item)
                continue
            views = region_views(q, loc.proto.shape)
            wide = _tensor_wide(q)
            global_empty = math.prod(loc.proto.shape) == 0
            for b, (offsets, sizes, data) in _buffer_pieces(loc).items():
                fqn = buffer_key(name, b)
                index = MetadataIndex(fqn, offsets)
                if b in wide:
                    self._scalars[fqn] = bytes(data.contiguous().view(torch.uint8).numpy()).hex()
                elif 0 in sizes and not global_empty:
                    continue
                self._pieces[index] = data
                self._items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                properties=TensorProperties(dtype=data.dtype),
                                                size=torch.Size(views[b]))))

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items, planner_data={_KEY: {
            "rank": _rank(), "protos": {n: _proto_dict(p) for n, p in self._protos.items()},
            "scalars": self._scalars}})
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        infos = [(p.planner_data or {}).get(_KEY) if isinstance(p.planner_data, dict) else None for p in all_plans]
        if any(i is None for i in infos):
            raise CheckpointError("every rank must use te_serial.dcp.SavePlanner")
        mine = infos[0]["protos"]
        for info in infos[1:]:
            if info["protos"] != mine:
                names = sorted(set(mine) ^ set(info["protos"]))
                if names:
                    raise CheckpointError(f"ranks 0 and {info['rank']} save different tensors, e.g. {names[:5]}")
                bad = next(n for n in mine if mine[n] != info["protos"][n])
                raise CheckpointError(f"tensor {bad!r} differs between ranks 0 and {info['rank']}: "
                                      f"{mine[bad]} vs {info['protos'][bad]}", tensor=bad)
        seen: dict[str, dict[int, str]] = {}
        for info in infos:
            for fqn, value in info["scalars"].items():
                seen.setdefault(fqn, {})[info["rank"]] = value
        for fqn, by_rank in seen.items():
            if len(set(by_rank.values())) > 1:
                name, b = fqn.rsplit(".", 1)
                values = ", ".join(f"rank {r}: {_float32(v)}" for r, v in sorted(by_rank.items()))
                raise CheckpointError(
                    f"tensor {name!r}: the tensor-wide buffer {b} differs between ranks ({values}); "
                    "a per-tensor-scaled format (FP8 per-tensor scale_inv, NVFP4 tensor amax) must be quantized "
                    "with the same scale / amax on every shard", tensor=name, field=b)
        plans = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        global_plan, metadata = super().create_global_plan(plans)
        metadata.planner_data = {_KEY: {"protos": dict(self._protos), "tree": self.tree}}
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem):
        data = self._pieces.get(write_item.index)
        if data is not None:
            return data
        if write_item.type == WriteItemType.BYTE_IO:  # never planned by this planner
            raise UnsupportedValueError(f"{write_item.index.fqn!r} would be pickled; te-serial stores no pickle")
        return find_state_dict_object(self.state_dict, write_item.index)


class _Stored(NamedTuple):
    """A WriteResult's storage_data: where the piece went."""

    file: str
    key: str
    checksum: int | None
    file_size: int


def _drop_cached_shards(root: Path) -> None:
    """Let the kernel drop the page cache of the shards already in ``root`` (the checkpoint this
    save replaces, fsync'd: its bytes stay on disk and readable; the commit deletes them). Saving
    over a checkpoint otherwise writes while its pages still fill the cache, and the new pages
    wait for reclaim (DCP's own writer truncates its files in place instead, giving up atomicity)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for p in root.iterdir():
        if not SHARD_NAME.fullmatch(p.name):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class StorageWriter(_dcp.StorageWriter):
    """Writes a te-serial checkpoint directory: each rank its own shards (through the one file
    layer), the coordinator the manifest, whose rename commits. Refuses DCP's pickled values."""

    def __init__(self, path: str | os.PathLike, *, max_shard_size: int | str = "5GB", checksums: bool = True,
                 metadata: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.limit = parse_size(max_shard_size)
        self.checksums = checksums
        self.metadata = dict(metadata or {})
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError("checkpoint path exists and is not a directory", file=str(self.path))
        self.path.mkdir(parents=True, exist_ok=True)
        _drop_cached_shards(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        pickled = [i.index.fqn for i in plan.items if i.type == WriteItemType.BYTE_IO]
        if pickled:
            raise UnsupportedValueError(
                f"{len(pickled)} state-dict values would be pickled by DCP ({pickled[:5]}); te-serial stores no "
                "pickle: save with te_serial.dcp.save (its SavePlanner keeps plain values in the manifest)")
        return plan

    def _layout(self, plan: SavePlan, keys: list[str]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(k, tuple(i.tensor_data.chunk.sizes), i.tensor_data.properties.dtype) for i, k in zip(plan.items, keys)]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = secrets.token_hex(4)
        out, counts, total = [], [], 0
        for plan in plans:
            keys = [i.index.fqn if i.type == WriteItemType.TENSOR else f"{i.index.fqn}@{i.index.index}"
                    for i in plan.items]
            n = len(ShardSet(self.path, self._layout(plan, keys), limit=self.limit,
                             shard_name=lambda i, n: "planned").files) if plan.items else 0
            counts.append((keys, total, n))
            total += n
        for plan, (keys, first, _) in zip(plans, counts):
            out.append(dataclasses.replace(plan, storage_data={"save_id": save_id, "keys": keys, "first": first,
                                                               "total": total}))
        return out

    def write_data(self, plan: SavePlan, planner) -> Future:
        fut: Future = Future()
        if not plan.items:
            fut.set_result([])
            return fut
        sd = plan.storage_data
        first, total, save_id = sd["first"], sd["total"], sd["save_id"]
        files = ShardSet(self.path, self._layout(plan, sd["keys"]), limit=self.limit, metadata={"format": "pt"},
                         shard_name=lambda i, n: f"model-{save_id}-{first + i + 1:05d}-of-{total:05d}.safetensors")
        results = []
        # in file order, so each file is written front to back
        order = sorted(zip(plan.items, sd["keys"]),
                       key=lambda ik: (files.file_of[ik[1]], files.files[files.file_of[ik[1]]].offsets[ik[1]][2]))
        try:
            for item, key in order:
                t = planner.resolve_data(item)
                if not isinstance(t, torch.Tensor):
                    raise UnsupportedValueError(f"{item.index.fqn!r} is not a tensor; te-serial stores no pickle")
                t = t.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                digest = files.write(key, t, with_checksum=self.checksums)
                results.append((item, key, digest, files.names[files.file_of[key]]))
            sizes = files.finish()
            files.commit()  # final names, still unreferenced until the manifest names them
        except BaseException:
            files.abort()
            raise
        fut.set_result([WriteResult(index=item.index, size_in_bytes=math.prod(item.tensor_data.chunk.sizes)
                                    * item.tensor_data.properties.dtype.itemsize,
                                    storage_data=_Stored(fname, key, digest, sizes[fname]))
                        for item, key, digest, fname in results])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        written: dict[tuple[str, tuple[int, ...]], _Stored] = {}
        files: dict[str, int] = {}
        for rank_results in results:
            for r in rank_results:
                written[(r.index.fqn, tuple(r.index.offset))] = r.storage_data
                files[r.storage_data.file] = r.storage_data.file_size
        files = dict(sorted(files.items()))
        info = metadata.planner_data.get(_KEY) if isinstance(metadata.planner_data, dict) else None
        if info is not None:
            protos, tree = info["protos"], info["tree"]
        else:  # DCP's own planner: plain tensors under their flat names
            protos = {fqn: TensorProto(tuple(md.size), md.properties.dtype)
                      for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
            tree = None
        entries: dict[str, TensorEntry] = {}
        chunks: dict[str, list] = {}
        for name, proto in protos.items():
            layout = list(expected_buffers(proto).items())
            per_buffer = []
            for b, (shape, dtype) in layout:
                fqn = buffer_key(name, b)
                md = metadata.state_dict_metadata.get(fqn)
                pieces = []
                for j, c in enumerate(md.chunks if md is not None else []):
                    st = written.get((fqn, tuple(c.offsets)))
                    if st is None:
                        raise CheckpointError("a planned piece was never written", tensor=name, field=b)
                    if st.key == fqn and proto.quantizer is None and len(md.chunks) == 1:
                        entries[name] = TensorEntry(proto, {b: BufferEntry(st.file, st.key, shape, dtype, st.checksum)})
                        break
                    if st.key != chunk_key(name, b, j):
                        raise CheckpointError(f"piece {j} was stored under {st.key!r}", tensor=name, field=b)
                    pieces.append((tuple(c.offsets), tuple(c.sizes), st.file, st.checksum))
                if name in entries:
                    break
                per_buffer.append(pieces)
            if name not in entries:
                entries[name] = TensorEntry(proto, {})
                chunks[name] = per_buffer
        if isinstance(tree, dict) and list(tree) == list(protos) and all(
                isinstance(v, TensorRef) and v.name == k for k, v in tree.items()):
            tree = None
        manifest = Manifest.from_entries(entries, files, tree=tree, metadata=self.metadata, producer=producer(),
                                         chunks=chunks)
        atomic_write(self.path / MANIFEST_NAME, manifest.to_bytes())  # the commit
        fsync_path(self.path, directory=True)
        clean_directory(self.path, {MANIFEST_NAME, *files}, SHARD_NAME)
        self.manifest = manifest

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self):
        return None


# --- loading -------------------------------------------------------------------------------------------

def _walk(obj: Any, path: tuple, tensors: list, values: list, in_tuple: bool = False) -> None:
    """Tensor leaves (with their paths) and plain-value leaves of a state dict, in te-serial's naming."""
    if isinstance(obj, (torch.Tensor, QuantizedTensorStorage)):
        tensors.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, path + (k,), tensors, values, in_tuple)
    elif isinstance(obj, (list, tuple)) and _has_tensor(obj):
        for i, v in enumerate(obj):
            _walk(v, path + (i,), tensors, values, in_tuple or isinstance(obj, tuple))
    elif path and not in_tuple:
        values.append(path)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, QuantizedTensorStorage)):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


def _set_at(root: Any, path: tuple, value: Any) -> None:
    obj = root
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


_MISSING = object()


def _tree_value(tree: Any, path: tuple) -> Any:
    node = tree
    for k in path:
        if isinstance(node, dict):
            if k in node:
                node = node[k]
            elif isinstance(k, str) and k.isdigit() and int(k) in node:
                node = node[int(k)]
            else:
                return _MISSING
        elif isinstance(node, (list, tuple)) and isinstance(k, int) and 0 <= k < len(node):
            node = node[k]
        else:
            return _MISSING
    return node


def _plain(value: Any, where: str) -> Any:
    if isinstance(value, (TensorRef, TEExtraState)):
        raise CheckpointError(f"the checkpoint holds a tensor at {where!r}, the state dict a plain value",
                              tensor=where)
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, where) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _allocate(loc: _Local) -> Any:
    """An empty tensor for a meta destination: the prototype's buffers (``alloc_tensors``) on CPU."""
    local = loc.local
    if _is_quantized(local):
        new = local._rebuild(local.quantizer.alloc_tensors(tuple(local.shape), device="cpu"))
    else:
        new = torch.empty(local.shape, dtype=local.dtype, device="cpu")
    if loc.dtensor is not None:
        return DTensor.from_local(new, loc.dtensor.device_mesh, loc.dtensor.placements, run_check=False,
                                  shape=loc.dtensor.shape, stride=loc.dtensor.stride())
    return new


def _zero_padding(t: QuantizedTensorStorage) -> None:
    for name, (r, c) in t.quantizer.valid_regions(tuple(t.shape)).items():
        s = getattr(t, name)
        s[r:] = 0
        s[:, c:] = 0


class LoadPlanner(DefaultLoadPlanner):
    """DCP load planner for te-serial checkpoints: quantized destinations (plain or DTensor) are
    filled buffer by buffer through the format's slicing rule; meta destinations are allocated
    from their prototypes; plain values come from the manifest. Needs :class:`StorageReader`."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=allow_partial_load)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        info = metadata.planner_data.get(_KEY) if metadata is not None and isinstance(metadata.planner_data, dict) \
            else None
        if info is None:
            raise CheckpointError("te_serial.dcp.LoadPlanner needs metadata from te_serial.dcp.StorageReader")
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator
        protos: dict[str, TensorProto] = info["protos"]
        tensors: list = []
        values: list = []
        _walk(state_dict, (), tensors, values)
        self._dest: dict[str, list[torch.Tensor]] = {}
        self._items: list[ReadItem] = []
        missing = []
        for path, value in tensors:
            name = _name(path)
            saved = protos.get(name)
            if saved is None:
                missing.append(name)
                continue
            loc = _local_view(name, value, loading=True)
            if loc.local.device.type == "meta":
                value = _allocate(loc)
                _set_at(state_dict, path, value)
                loc = _local_view(name, value, loading=True)
            if (loc.proto.shape, loc.proto.quantizer) != (saved.shape, saved.quantizer):
                raise CheckpointError(f"the checkpoint holds {_describe(saved)}, the state dict {_describe(loc.proto)}",
                                      tensor=name)
            if loc.proto.quantizer is None:
                self._plan_plain(name, value, loc)
            else:
                self._plan_quantized(loc)
        if missing and not self.allow_partial_load:
            raise CheckpointError(f"{len(missing)} state-dict tensors are not in the checkpoint, e.g. {missing[:5]}")
        tree = info["tree"]
        for path in values:
            found = _tree_value(tree, path) if tree is not None else _MISSING
            if found is _MISSING:
                if not self.allow_partial_load:
                    raise CheckpointError(f"value {_name(path)!r} of the state dict is not in the checkpoint",
                                          tensor=_name(path))
                continue
            _set_at(state_dict, path, _plain(found, _name(path)))

    def _metadata(self, fqn: str, name: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"buffer {fqn!r} is not in the checkpoint", tensor=name)
        return md

    def _plan_plain(self, name: str, value: Any, loc: _Local) -> None:
        md = self._metadata(name, name)
        if hasattr(value, "__create_chunk_list__"):
            chunks = value.__create_chunk_list__()
            dests = [value.to_local()] * len(chunks)
        else:
            chunks = [ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size())]
            dests = [value]
        self._dest[name] = [d.detach() for d in dests]
        self._items += create_read_items_for_chunk_list(name, md, chunks)

    def _plan_quantized(self, loc: _Local) -> None:
        _zero_padding(loc.local)
        values = loc.proto.quantizer.value_dtypes()
        for b, (offsets, sizes, data) in _buffer_pieces(loc, loading=True).items():
            fqn = buffer_key(loc.name, b)
            md = self._metadata(fqn, loc.name)
            self._dest[fqn] = [data.view(values[b])]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            self._items += create_read_items_for_chunk_list(fqn, md, [chunk])

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsupportedValueError(f"{read_item.dest_index.fqn!r} would be unpickled; te-serial reads no pickle")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dests = self._dest[read_item.dest_index.fqn]
        dest = dests[read_item.dest_index.index or 0] if len(dests) > 1 else dests[0]
        return narrow_tensor_by_index(dest, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _runs(view, offsets, sizes) -> int:
    """How many contiguous byte runs the box ``offsets`` / ``sizes`` of a C-order ``view`` is."""
    k = len(view) - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == view[k]:
        k -= 1
    return math.prod(sizes[:k]) if k > 0 else 1


class StorageReader(_dcp.StorageReader):
    """Reads any te-serial checkpoint (sharded or single-process) for DCP: DCP's ``Metadata`` is
    rebuilt from the msgpack manifest, and each read item reads just its bytes. A checkpoint
    written by DCP's own ``FileSystemWriter`` (pickled ``.metadata``) is refused unread."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self._ckpt: Checkpoint | None = None
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != self.path:
            self.path = Path(checkpoint_id)
            self.close()

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
        self._ckpt, self._metadata = None, None

    def _open(self) -> Checkpoint:
        if self._ckpt is None:
            p = self.path
            if p.is_dir() and not (p / MANIFEST_NAME).exists() and (p / ".metadata").exists():
                raise ManifestError(
                    "this is a checkpoint of torch.distributed.checkpoint's FileSystemWriter: its .metadata is a "
                    "pickle, which te-serial never reads (unpickling can run code). Load it with "
                    "torch.distributed.checkpoint.FileSystemReader only if you trust it, then save it again with "
                    "te_serial.dcp.save", file=str(p / ".metadata"))
            self._ckpt = Checkpoint(p)
        return self._ckpt

    def read_metadata(self) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        ckpt = self._open()
        sd_md: dict[str, TensorStorageMetadata] = {}
        refs: dict[MetadataIndex, tuple] = {}
        for name in ckpt.keys():
            for buf in ckpt.pieces(name):
                fqn = buffer_key(name, buf.name)
                chunks = []
                for pc in buf.pieces:
                    chunks.append(ChunkStorageMetadata(torch.Size(pc.offsets), torch.Size(pc.sizes)))
                    refs[MetadataIndex(fqn, pc.offsets)] = (name, buf, pc)
                sd_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=buf.dtype), torch.Size(buf.view), chunks)
        self._metadata = Metadata(sd_md, planner_data={_KEY: {"protos": ckpt.protos, "tree": ckpt.manifest.tree}},
                                  storage_data=refs)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner) -> Future:
        ckpt = self._open()
        items = sorted(plan.items, key=lambda i: (self.storage_data[i.storage_index][2].file,
                                                  self.storage_data[i.storage_index][2].key))
        for item in items:
            name, buf, pc = self.storage_data[item.storage_index]
            dest = planner.resolve_tensor(item)
            f = ckpt._file(pc.file)
            within, lengths = tuple(item.storage_offsets), tuple(item.lengths)
            if _runs(pc.array, within, lengths) > 1:  # many short runs: copy from the file's mmap
                src = f.mapped(pc.key).reshape(pc.array)
                for d, (o, n) in enumerate(zip(within, lengths)):
                    src = src.narrow(d, o, n)
                dest.copy_(src)
            elif dest.dtype == buf.dtype and dest.is_contiguous():  # one run: read into place
                f.read_box(pc.key, pc.array, within, lengths, out=dest)
            else:  # a strided destination, or a plain tensor of another dtype (converted, as DCP does)
                dest.copy_(f.read_box(pc.key, pc.array, within, lengths))
            planner.commit_tensor(item, dest)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        p = Path(checkpoint_id)
        return (p / MANIFEST_NAME).is_file() or p.suffix == ".safetensors"


# --- the wrappers --------------------------------------------------------------------------------------

def _foreign(e: Exception, what: str) -> CheckpointError:
    """A failure outside te-serial (a collective that lost a peer, DCP itself) as a CheckpointError."""
    return CheckpointError(f"distributed checkpoint {what} failed: {type(e).__name__}: {e}")


def _unwrap(e: CheckpointException) -> BaseException:
    """The te-serial error a rank raised (lowest rank first), or a CheckpointError naming them."""
    for rank in sorted(e.failures):
        exc = e.failures[rank][0]
        if isinstance(exc, TeSerialError):
            return exc
    rank = min(e.failures)
    exc = e.failures[rank][0]
    return CheckpointError(f"distributed checkpoint failed on rank(s) {sorted(e.failures)}: "
                           f"rank {rank}: {type(exc).__name__}: {exc}")


def _no_dist(process_group) -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group=None,
         max_shard_size: int | str = "5GB", checksums: bool = True,
         metadata: Mapping[str, str] | None = None) -> Manifest | None:
    """``torch.distributed.checkpoint.save`` into a te-serial checkpoint directory (every rank calls
    it). Returns the manifest on the coordinator (None elsewhere)."""
    writer = StorageWriter(path, max_shard_size=max_shard_size, checksums=checksums, metadata=metadata)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp.save(state_dict, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                      no_dist=_no_dist(process_group))
    except CheckpointException as e:
        raise _unwrap(e) from e
    except TeSerialError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a collective whose peer died
        raise _foreign(e, "save") from e
    return writer.manifest


def async_save(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group=None,
               max_shard_size: int | str = "5GB", checksums: bool = True,
               metadata: Mapping[str, str] | None = None, **kwargs):
    """``torch.distributed.checkpoint.async_save`` into a te-serial checkpoint; returns DCP's
    future. The state dict is checked first (so a value te-serial cannot store is refused here),
    then staged by DCP's stager, which copies quantized tensors' real bytes."""
    from torch.distributed.checkpoint.stateful import Stateful
    # refuse what cannot be stored before anything is staged
    flatten_tree({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()})
    writer = StorageWriter(path, max_shard_size=max_shard_size, checksums=checksums, metadata=metadata)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _dcp.async_save(state_dict, storage_writer=writer, planner=SavePlanner(),
                               process_group=process_group, no_dist=_no_dist(process_group), **kwargs)


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None,
         allow_partial_load: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` from any te-serial checkpoint, in place: every rank
    reads just the chunks its tensors hold, on any world size."""
    reader = StorageReader(path)
    reader.read_metadata()  # refuse a bad or foreign checkpoint here, with te-serial's error
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp.load(state_dict, storage_reader=reader, planner=LoadPlanner(allow_partial_load=allow_partial_load),
                      process_group=process_group, no_dist=_no_dist(process_group))
    except CheckpointException as e:
        raise _unwrap(e) from e
    except TeSerialError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _foreign(e, "load") from e
    finally:
        reader.close()


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                checksums: bool = True) -> Manifest:
    """A sharded checkpoint as a single-process one (whole tensors), streamed one tensor at a time:
    each is assembled from its chunks in fresh memory, written, and dropped."""
    with Checkpoint(src) as ckpt:
        m = ckpt.manifest
        aliases = {m.names[i]: m.names[j] for i, j in m.aliases.items()}
        with CheckpointWriter(dst, ckpt.protos, aliases=aliases, tree=m.tree, max_shard_size=max_shard_size,
                              metadata=ckpt.metadata, checksums=checksums) as writer:
            for name in ckpt.keys():
                if name not in aliases:
                    writer.write(name, ckpt.get(name, mmap=False))
    return writer.manifest
