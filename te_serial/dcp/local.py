"""What the DCP planners and storage share: the local view of one state-dict tensor (a te-serial
quantized tensor, a DTensor of one, or a plain tensor), its buffers' pieces, and the walk over
a state dict's tree of plain values."""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..checkpoint.tree import TEExtraState, TensorRef
from ..errors import CheckpointError, ShapeError, UnsupportedValueError
from ..formats.tensors import QuantizedTensorStorage
from ..formats.protocol import flatten_2d
from ..formats.slicing import box_to_range, buffer_regions, region_views, storage_view
from ..proto import TensorProto


PLANNER_KEY = "te_serial"


# --- the local view of one state-dict tensor ---------------------------------------------------------

def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_quantized(t: Any) -> bool:
    return isinstance(t, QuantizedTensorStorage)


class LocalTensor(NamedTuple):
    """One state-dict tensor on this rank: the global prototype and where the local part sits."""

    name: str
    proto: TensorProto                          # global shape, nominal dtype, quantizer
    local: Any                                  # the local tensor (quantized storage or plain)
    box: tuple[tuple[int, ...], tuple[int, ...]] | None  # local chunk (offsets, sizes); None: whole
    dtensor: DTensor | None


def local_view(name: str, value: Any, *, loading: bool = False) -> LocalTensor:
    """Prototype and local chunk of a plain / quantized tensor or DTensor (quantized local)."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if any(p.is_partial() for p in value.placements):
            raise UnsupportedValueError(f"tensor {name!r} is a DTensor with Partial placements "
                                        f"{value.placements}; reduce it before saving")
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        box = (tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
        q = local.quantizer.of_whole(value.shape) if _is_quantized(local) else None
        proto = TensorProto(tuple(value.shape), value.dtype, q, bool(value.requires_grad))
        if q is not None and tuple(local.shape) != box[1]:
            raise ShapeError(f"tensor {name!r} on rank {current_rank()}: the local quantized tensor is "
                             f"{list(local.shape)} but its DTensor placement gives a shard of {list(box[1])}")
        return LocalTensor(name, proto, local, box, value)
    if _is_quantized(value):
        if value.device.type == "meta" and not loading:
            raise UnsupportedValueError(f"tensor {name!r} is on the meta device and holds no data")
        return LocalTensor(name, TensorProto(tuple(value.shape), value.dtype, value.quantizer,
                                        bool(getattr(value, "requires_grad", False))), value, None, None)
    from ..te.interop import from_te, is_te_tensor
    if is_te_tensor(value):
        value = from_te(value, name=name)
        return LocalTensor(name, TensorProto(tuple(value.shape), value.dtype, value.quantizer, False), value, None, None)
    if not isinstance(value, torch.Tensor):
        raise UnsupportedValueError(f"value at {name!r} is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {name!r} has layout {value.layout}; only dense tensors are saved")
    if value.device.type == "meta" and not loading:
        raise UnsupportedValueError(f"tensor {name!r} is on the meta device and holds no data")
    return LocalTensor(name, TensorProto(tuple(value.shape), value.dtype, None, bool(value.requires_grad)),
                  value, None, None)


def _quantized_range(loc: LocalTensor) -> tuple[tuple[int, int], tuple[int, int]] | None:
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
        raise ShapeError(f"tensor {loc.name!r} on rank {current_rank()}: its shard at offsets {list(offsets)} with sizes "
                         f"{list(sizes)} is not one range of rows × columns of the tensor's 2-D view; shard "
                         "quantized tensors along dim 0 (FSDP2's Shard(0))")
    (r0, r1), (c0, c1) = rc
    ra, ca = q.slice_alignment()
    for what, (a, b), n, block in (("rows", (r0, r1), m, ra), ("columns", (c0, c1), k, ca)):
        if a % block or (b % block and b != n):
            raise ShapeError(
                f"tensor {loc.name!r} on rank {current_rank()}: its shard holds {what} [{a}, {b}) of {n}, which is not "
                f"aligned to the {q.layout_name()} block of {block} {what}; shard so that every rank holds whole "
                f"blocks (a multiple of {block} {what}, the last rank the rest)")
    return rc


def buffer_pieces(loc: LocalTensor, *, loading: bool = False) -> dict[str, tuple[tuple, tuple, torch.Tensor]]:
    """buffer → (global box offsets, sizes, the local data of that box in the stored dtype) of a
    quantized tensor's local shard. An empty shard saves nothing and loads only the tensor-wide
    buffers (its scale_inv / amax)."""
    rc = _quantized_range(loc)
    q, local = loc.proto.quantizer, loc.local
    lshape, lq = tuple(local.shape), local.quantizer  # the shard's own (a grouped shard: its members only)
    views, specs, values = region_views(lq, lshape), lq.describe_buffers(lshape), q.value_dtypes()
    if rc is None:
        if not loading:
            return {}
        wide = tensor_wide_buffers(q)
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


def tensor_wide_buffers(q) -> set[str]:
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


def float32_hex(hexbytes: str) -> str:
    raw = bytes.fromhex(hexbytes)
    return repr(struct.unpack("<f", raw)[0]) if len(raw) == 4 else raw.hex()


def proto_dict(p: TensorProto) -> dict:
    return {"shape": list(p.shape), "dtype": str(p.dtype), "requires_grad": p.requires_grad,
            "quantizer": p.quantizer.to_dict() if p.quantizer is not None else None}


def describe_proto(p: TensorProto) -> str:
    q = p.quantizer
    return f"{'plain' if q is None else q.layout_name()} {list(p.shape)} {str(p.dtype).replace('torch.', '')}"


# --- saving --------------------------------------------------------------------------------------------

def walk_tree(obj: Any, path: tuple, tensors: list, values: list, in_tuple: bool = False) -> None:
    """Tensor leaves (with their paths) and plain-value leaves of a state dict, in te-serial's naming."""
    if isinstance(obj, (torch.Tensor, QuantizedTensorStorage)):
        tensors.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            walk_tree(v, path + (k,), tensors, values, in_tuple)
    elif isinstance(obj, (list, tuple)) and _has_tensor(obj):
        for i, v in enumerate(obj):
            walk_tree(v, path + (i,), tensors, values, in_tuple or isinstance(obj, tuple))
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


def path_name(path: tuple) -> str:
    return ".".join(map(str, path))


def set_at_path(root: Any, path: tuple, value: Any) -> None:
    obj = root
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


MISSING = object()


def tree_value(tree: Any, path: tuple) -> Any:
    node = tree
    for k in path:
        if isinstance(node, dict):
            if k in node:
                node = node[k]
            elif isinstance(k, str) and k.isdigit() and int(k) in node:
                node = node[int(k)]
            else:
                return MISSING
        elif isinstance(node, (list, tuple)) and isinstance(k, int) and 0 <= k < len(node):
            node = node[k]
        else:
            return MISSING
    return node


def plain_value(value: Any, where: str) -> Any:
    if isinstance(value, (TensorRef, TEExtraState)):
        raise CheckpointError(f"the checkpoint holds a tensor at {where!r}, the state dict a plain value",
                              tensor=where)
    if isinstance(value, dict):
        return {k: plain_value(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_value(v, where) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def allocate_local(loc: LocalTensor) -> Any:
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


def zero_padding(t: QuantizedTensorStorage) -> None:
    for name, (r, c) in t.quantizer.valid_regions(tuple(t.shape)).items():
        s = getattr(t, name)
        s[r:] = 0
        s[:, c:] = 0


