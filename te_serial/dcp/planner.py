"""te-serial's DCP planners: a quantized tensor planned as its inner buffers (region views placed by
the format's slicing rule), plain values kept for the manifest's tree, and loads that allocate
what is missing from the prototypes."""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import _create_write_items, create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import find_state_dict_object

from ..checkpoint.manifest import buffer_key
from ..checkpoint.tree import TEExtraState, extra_state_refs, flatten_tree, rebuild_tree
from ..errors import CheckpointError, UnsupportedValueError
from ..formats.slicing import region_views
from ..proto import TensorProto
from .local import (MISSING, PLANNER_KEY, LocalTensor, allocate_local, buffer_pieces, current_rank, describe_proto,
                    float32_hex, local_view, path_name, plain_value, proto_dict, set_at_path, tensor_wide_buffers,
                    tree_value, walk_tree, zero_padding)


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
            loc = local_view(name, value)
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
            wide = tensor_wide_buffers(q)
            global_empty = math.prod(loc.proto.shape) == 0
            for b, (offsets, sizes, data) in buffer_pieces(loc).items():
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
        self.plan = SavePlan(self._items, planner_data={PLANNER_KEY: {
            "rank": current_rank(), "protos": {n: proto_dict(p) for n, p in self._protos.items()},
            "scalars": self._scalars}})
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        infos = [(p.planner_data or {}).get(PLANNER_KEY) if isinstance(p.planner_data, dict) else None for p in all_plans]
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
                values = ", ".join(f"rank {r}: {float32_hex(v)}" for r, v in sorted(by_rank.items()))
                raise CheckpointError(
                    f"tensor {name!r}: the tensor-wide buffer {b} differs between ranks ({values}); "
                    "a per-tensor-scaled format (FP8 per-tensor scale_inv, NVFP4 tensor amax) must be quantized "
                    "with the same scale / amax on every shard", tensor=name, field=b)
        plans = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        global_plan, metadata = super().create_global_plan(plans)
        metadata.planner_data = {PLANNER_KEY: {"protos": dict(self._protos), "tree": self.tree}}
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem):
        data = self._pieces.get(write_item.index)
        if data is not None:
            return data
        if write_item.type == WriteItemType.BYTE_IO:  # never planned by this planner
            raise UnsupportedValueError(f"{write_item.index.fqn!r} would be pickled; te-serial stores no pickle")
        return find_state_dict_object(self.state_dict, write_item.index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP load planner for te-serial checkpoints: quantized destinations (plain or DTensor) are
    filled buffer by buffer through the format's slicing rule; meta destinations are allocated
    from their prototypes; plain values come from the manifest. Needs :class:`StorageReader`."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=allow_partial_load)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        info = metadata.planner_data.get(PLANNER_KEY) if metadata is not None and isinstance(metadata.planner_data, dict) \
            else None
        if info is None:
            raise CheckpointError("te_serial.dcp.LoadPlanner needs metadata from te_serial.dcp.StorageReader")
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator
        protos: dict[str, TensorProto] = info["protos"]
        tensors: list = []
        values: list = []
        walk_tree(state_dict, (), tensors, values)
        self._dest: dict[str, list[torch.Tensor]] = {}
        self._items: list[ReadItem] = []
        missing = []
        tree = info["tree"]
        self._extra: list[tuple[tuple, TEExtraState, dict[str, torch.Tensor]]] = []
        for path, value in tensors:
            name = path_name(path)
            saved = protos.get(name)
            if saved is None:
                found = tree_value(tree, path) if tree is not None else MISSING
                if type(found) is TEExtraState:  # stored decoded: its tensors now, TE's bytes after
                    self._plan_extra_state(path, found, protos)
                    continue
                missing.append(name)
                continue
            loc = local_view(name, value, loading=True)
            if loc.local.device.type == "meta":
                value = allocate_local(loc)
                set_at_path(state_dict, path, value)
                loc = local_view(name, value, loading=True)
            if (loc.proto.shape, loc.proto.quantizer) != (saved.shape, saved.quantizer):
                raise CheckpointError(f"the checkpoint holds {describe_proto(saved)}, the state dict {describe_proto(loc.proto)}",
                                      tensor=name)
            if loc.proto.quantizer is None:
                self._plan_plain(name, value)
            else:
                self._plan_quantized(loc)
        if missing and not self.allow_partial_load:
            raise CheckpointError(f"{len(missing)} state-dict tensors are not in the checkpoint, e.g. {missing[:5]}")
        for path in values:
            found = tree_value(tree, path) if tree is not None else MISSING
            if found is MISSING:
                if not self.allow_partial_load:
                    raise CheckpointError(f"value {path_name(path)!r} of the state dict is not in the checkpoint",
                                          tensor=path_name(path))
                continue
            set_at_path(state_dict, path, plain_value(found, path_name(path)))

    def _plan_extra_state(self, path: tuple, node: TEExtraState, protos: dict[str, TensorProto]) -> None:
        """A TE module's ``_extra_state``: read the tensors its decoded state refers to (scales,
        amax histories) into fresh CPU tensors; :meth:`finish_extra_states` makes TE's bytes."""
        loaded = {}
        for ref in sorted(extra_state_refs(node)):
            proto = protos.get(ref)
            if proto is None or proto.quantizer is not None:
                raise CheckpointError("TE extra state refers to a tensor the checkpoint does not hold as plain",
                                      tensor=ref)
            loaded[ref] = torch.empty(proto.shape, dtype=proto.dtype)
            self._plan_plain(ref, loaded[ref])
        self._extra.append((path, node, loaded))

    def finish_extra_states(self, state_dict: dict) -> None:
        """After the reads: each planned ``_extra_state`` entry of ``state_dict`` (the caller's:
        DCP plans on a copy of its top level) becomes TE's own bytes, as ``load_quantized`` gives
        them, encoded from the state read, never unpickled. ``te_serial.dcp.load`` calls this."""
        for path, node, loaded in self._extra:
            set_at_path(state_dict, path, rebuild_tree(node, loaded))
        self._extra = []

    def _metadata(self, fqn: str, name: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"buffer {fqn!r} is not in the checkpoint", tensor=name)
        return md

    def _plan_plain(self, name: str, value: Any) -> None:
        md = self._metadata(name, name)
        if hasattr(value, "__create_chunk_list__"):
            chunks = value.__create_chunk_list__()
            dests = [value.to_local()] * len(chunks)
        else:
            chunks = [ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size())]
            dests = [value]
        self._dest[name] = [d.detach() for d in dests]
        self._items += create_read_items_for_chunk_list(name, md, chunks)

    def _plan_quantized(self, loc: LocalTensor) -> None:
        zero_padding(loc.local)
        values = loc.proto.quantizer.value_dtypes()
        for b, (offsets, sizes, data) in buffer_pieces(loc, loading=True).items():
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


