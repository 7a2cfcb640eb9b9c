"""te-serial's DCP storage: each rank's shards through the one writer's file layer, the manifest as
the commit, and a reader that rebuilds DCP's metadata from the manifest (no pickle)."""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from pathlib import Path
from typing import Mapping, NamedTuple

import torch
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..checkpoint.fileops import atomic_write, clean_directory, fsync_path, writing
from ..checkpoint.header import SHARD_METADATA
from ..checkpoint.shards import ShardSet
from ..checkpoint.manifest import MANIFEST_NAME, BufferEntry, Manifest, TensorEntry, buffer_key, chunk_key, \
    expected_buffers
from ..checkpoint.reader import Checkpoint
from ..checkpoint.tree import TensorRef
from ..checkpoint.writer import SHARD_NAME, parse_size, producer
from ..errors import CheckpointError, ManifestError, UnsupportedValueError
from ..proto import TensorProto
from .local import PLANNER_KEY


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
        with writing(self.path):
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
        files = ShardSet(self.path, self._layout(plan, sd["keys"]), limit=self.limit, metadata=SHARD_METADATA,
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
        info = metadata.planner_data.get(PLANNER_KEY) if isinstance(metadata.planner_data, dict) else None
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
        self._metadata = Metadata(sd_md, planner_data={PLANNER_KEY: {"protos": ckpt.protos, "tree": ckpt.manifest.tree}},
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

