"""PyTorch distributed checkpoint (DCP) over te-serial's I/O core, without pickle.

Thin wrappers over ``torch.distributed.checkpoint``: :func:`save`, :func:`async_save` and
:func:`load` pass te-serial's :class:`SavePlanner` / :class:`LoadPlanner` and
:class:`StorageWriter` / :class:`StorageReader` to ``dcp.save`` / ``dcp.async_save`` /
``dcp.load``; users who call DCP themselves can pass those pieces directly.

How a sharded state dict is stored (a te-serial checkpoint, format 1.2, schema/README.md §13):

* Every rank writes its own safetensors shard(s) through the one writer's file layer
  (:class:`~te_serial.checkpoint.shards.ShardSet`), named ``model-<save id>-<i>-of-<n>.safetensors``
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

import os
import warnings
from typing import Any, Mapping

import torch.distributed as dist
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint.manifest import Manifest
from ..checkpoint.reader import Checkpoint
from ..checkpoint.tree import flatten_tree
from ..checkpoint.writer import CheckpointWriter
from ..errors import CheckpointError, TeSerialError
from .planner import LoadPlanner, SavePlanner
from .storage import StorageReader, StorageWriter

__all__ = ["save", "async_save", "load", "consolidate", "SavePlanner", "LoadPlanner", "StorageWriter",
           "StorageReader"]


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
            planner = LoadPlanner(allow_partial_load=allow_partial_load)
            _dcp.load(state_dict, storage_reader=reader, planner=planner,
                      process_group=process_group, no_dist=_no_dist(process_group))
        planner.finish_extra_states(state_dict)
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
