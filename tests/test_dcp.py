"""te_serial.dcp: pickle-free distributed checkpoints (DCP) and tensor-parallel sliced loads.

Real process groups on CPU (gloo, ``spawn``). To keep the whole set within its time bound on 2
cores, the distributed work runs once per module in one group of 4 processes (ranks 0 and 1 also
form their own 2-rank mesh and process group), and every rank records what it found; the tests
below assert on those records:

* main process (world 1): save ``ck1``;
* ranks 0-1 (2 ranks): save ``ck2`` and ``ck2a`` (async); load ``ck1`` (1→2) and ``ck2`` (2→2);
  DCP's stager on DTensors of quantized tensors; unaligned shards and per-tensor scale mismatch
  refused;
* ranks 0-3 (4 ranks): load ``ck2`` (2→4); save ``ck4``; load it (4→4);
* ranks 0-1: load ``ck4`` (4→2); rank 1 killed in the middle of a save over a copy of ``ck4``;
* main process: 1→1, 2→1, 4→1 loads, ``te_serial.open`` / ``load_quantized`` / ``verify`` /
  ``inspect`` / ``consolidate`` of each result, flipped bytes, pickle scans, the chunk column's
  validation, sliced loads.

Every format × usage of ``helpers.FORMAT_CASES`` is saved, 2-D and 3-D, shaped so that dim-0
shards on 1, 2 and 4 ranks hold whole blocks (some ranks hold empty shards), plus a
column-sharded MXFP8 weight, a replicated NVFP4 weight, plain tensors (row / column sharded,
uneven, replicated, empty, 0-d) and plain values. Every comparison is bit-exact against the same
full tensors (what a single-process save holds). ``TE_SERIAL_LONG=1`` adds adversarial input
kinds (outliers, inf/NaN) and more sliced ranges.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import random
import shutil
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
import te_serial.dcp as tdcp
import te_serial.dcp.local as tdcp_local
from te_serial.checkpoint.writer import SHARD_NAME
from te_serial.formats.slicing import buffer_regions, slice_quantized
from helpers import FORMAT_CASES, USAGES, assert_same_tensor, make_input, same_bits

LONG = os.environ.get("TE_SERIAL_LONG", "") not in ("", "0")
KINDS = ("random", "outliers", "specials") if LONG else ("random",)
CHILD_TIMEOUT = 240


# --- the state dicts: the same full tensors on every process -------------------------------------------

def _fits(q, shape) -> bool:
    try:
        q.describe_buffers(shape)
        return True
    except tse.ShapeError:
        return False


def quantized_cases() -> dict[str, tuple]:
    """name → (quantizer, full shape, shard dim): every FORMAT_CASES quantizer × usage, 2-D and 3-D,
    with dim 0 split into whole blocks on 1, 2 and 4 ranks; one column-sharded MXFP8 tensor."""
    out = {}
    for i, (make, _) in enumerate(FORMAT_CASES):
        for r, c in USAGES:
            q = make(r, c)
            ra = max(q.slice_alignment()[0], 2)
            cols = 200 if _fits(q, (4 * ra, 200)) else 64
            tag = f"q{i}_{q.layout_name()}_{'rc' if r and c else 'r' if r else 'c'}"
            out[tag] = (q, (4 * ra, cols), 0)
            out[tag + "_3d"] = (q, (4, ra, cols), 0)
    out["colsharded_mxfp8"] = (ts.MXFP8Quantizer(torch.float8_e4m3fn), (64, 128), 1)
    return out


QCASES = quantized_cases()
#: plain tensors: name → (shape, dtype, shard dim or None for a replicated plain tensor)
PLAIN = {"plain_rows": ((16, 24), torch.float32, 0), "plain_cols": ((6, 12), torch.bfloat16, 1),
         "plain_uneven": ((7, 3), torch.float16, 0), "plain_rep": ((5, 3), torch.float32, None),
         "plain_empty": ((0, 4), torch.float32, None), "plain_scalar": ((), torch.int64, None)}
VALUES = {"step": 7, "lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "flags": [True, None, 3],
          "blob": b"\x00\x80\x04", "nested": {"1": 2, "x": [1.5, "y"]}}
REPLICATED_Q = "replicated_nvfp4"


def full_tensors() -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors, identical on every process."""
    out = {}
    for j, (name, (q, shape, _)) in enumerate(QCASES.items()):
        kind = KINDS[j % len(KINDS)]
        out[name] = q(make_input(kind, shape, seed=j))
    g = torch.Generator().manual_seed(1)
    for name, (shape, dtype, _) in PLAIN.items():
        out[name] = (torch.randn(shape, generator=g) * 100).to(dtype)
    out[REPLICATED_Q] = ts.NVFP4Quantizer()(make_input("random", (32, 32), seed=99))
    return out


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, size) of ``rank``'s Shard placement of a dim of ``n`` (torch.chunk's rule)."""
    from torch.distributed.tensor import Shard
    size, offset = Shard.local_shard_size_and_offset(n, world, rank)
    return offset, size


def local_part(full, dim: int, world: int, rank: int):
    """``rank``'s part of ``full`` sharded on ``dim`` (quantized: by slice_quantized, so it keeps
    the parent's tensor-wide scale / amax; an empty shard: allocated, its tensor-wide buffers copied)."""
    shape = tuple(full.shape)
    off, size = shard_range(shape[dim], world, rank)
    local_shape = tuple(size if d == dim else s for d, s in enumerate(shape))
    if not isinstance(full, tsf.QuantizedTensorStorage):
        return full.narrow(dim, off, size).clone()
    q = full.quantizer
    if size == 0:
        bufs = q.alloc_tensors(local_shape)
        for b in tdcp_local.tensor_wide_buffers(q):
            bufs[b] = getattr(full, b).clone()
        return type(full)(local_shape, full.dtype, q, **bufs)
    if dim == 0:
        inner = math.prod(shape[1:-1])
        part = slice_quantized(full, rows=(off * inner, (off + size) * inner))
    else:
        assert dim == len(shape) - 1
        part = slice_quantized(full, cols=(off, off + size))
    specs = q.describe_buffers(local_shape)
    return type(full)(local_shape, full.dtype, q, **{n: b.reshape(specs[n].shape) for n, b in part.buffers().items()})


def shard_dim(name: str):
    if name in QCASES:
        return QCASES[name][2]
    if name in PLAIN:
        return PLAIN[name][2]
    return None


def sharded_state_dict(full: dict, world: int, rank: int, mesh) -> dict:
    """The state dict each rank saves: DTensors (Shard(dim)) of local parts, replicated tensors,
    nested values."""
    from torch.distributed.tensor import DTensor, Shard
    sd: dict = {"model": {}, "opt": {k: v for k, v in VALUES.items()}}
    for name, t in full.items():
        dim = shard_dim(name)
        if dim is None or mesh is None:
            sd["model"][name] = t
            continue
        local = local_part(t, dim, world, rank)
        sd["model"][name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=t.shape,
                                               stride=torch.empty(t.shape, device="meta").stride())
    return sd


def destination(full: dict, world: int, rank: int, mesh, *, meta: bool = True) -> dict:
    """A state dict to load into: same structure, meta tensors (allocated by the load), other values."""
    from torch.distributed.tensor import DTensor, Shard
    sd: dict = {"model": {}, "opt": {k: 0 for k in VALUES}}
    for name, t in full.items():
        dim = shard_dim(name)
        local_shape = tuple(t.shape)
        if dim is not None and mesh is not None:
            off, size = shard_range(t.shape[dim], world, rank)
            local_shape = tuple(size if d == dim else s for d, s in enumerate(t.shape))
        if isinstance(t, tsf.QuantizedTensorStorage):
            local = ts.TensorProto(local_shape, t.dtype, t.quantizer).create_tensor(device="meta" if meta else "cpu")
        else:
            local = torch.empty(local_shape, dtype=t.dtype, device="meta" if meta else "cpu")
        if dim is not None and mesh is not None:
            local = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=t.shape,
                                       stride=torch.empty(t.shape, device="meta").stride())
        sd["model"][name] = local
    return sd


def check_loaded(sd: dict, full: dict, world: int, rank: int, mesh) -> dict[str, str]:
    """name → "ok" or what differs, for a loaded destination."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, t in full.items():
        got = sd["model"][name]
        try:
            if isinstance(got, DTensor):
                got = got.to_local()
                want = local_part(t, shard_dim(name), world, rank)
            else:
                want = t
            if isinstance(want, tsf.QuantizedTensorStorage) and want.numel() == 0:
                assert type(got) is type(want) and got.shape == want.shape, "empty shard"
                for b in tdcp_local.tensor_wide_buffers(want.quantizer):
                    assert same_bits(getattr(got, b), getattr(want, b)), b
            else:
                assert_same_tensor(got, want, name)
            out[name] = "ok"
        except AssertionError as e:
            out[name] = f"differs: {e}"
    out["opt"] = "ok" if sd["opt"] == VALUES else f"values {sd['opt']!r}"
    return out


# --- child processes ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, tmp: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    mesh4 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "rank"))["rank"]  # ranks {0, 1}, {2, 3}
    result: dict = {}
    path = Path(tmp) / f"result-{rank}.json"
    try:
        _phases(rank, world, mesh4, mesh2, Path(tmp), result, path)
    except BaseException:
        result["crash"] = traceback.format_exc()
    path.write_text(json.dumps(result))
    os._exit(0)  # no teardown: a peer may have been killed on purpose


def _load_and_check(path: Path, full, world, rank, mesh) -> dict[str, str]:
    sd = destination(full, world, rank, mesh)
    tdcp.load(sd, path, process_group=mesh.get_group())
    return check_loaded(sd, full, world, rank, mesh)


def _expect_error(fn) -> dict:
    try:
        fn()
    except ts.TeSerialError as e:
        return {"type": type(e).__name__, "message": str(e)}
    except BaseException as e:  # noqa: BLE001 - recorded for the test to report
        return {"type": type(e).__name__, "message": str(e), "foreign": True}
    return {"type": None}


def _phases(rank, world, mesh4, mesh2, tmp: Path, result: dict, record: Path) -> None:
    """Everything the distributed tests need, in one group of 4 processes; the 2-rank steps run on
    ranks 0 and 1 (their own sub-mesh and process group) while ranks 2 and 3 wait."""
    import torch.distributed as dist
    full = ts.load_quantized(tmp / "full")
    if rank < 2:
        _two_ranks(rank, 2, mesh2, tmp, full, result)
    dist.barrier()
    result["load 2->4"] = _load_and_check(tmp / "ck2", full, world, rank, mesh4)
    tdcp.save(sharded_state_dict(full, world, rank, mesh4), tmp / "ck4", process_group=mesh4.get_group())
    result["load 4->4"] = _load_and_check(tmp / "ck4", full, world, rank, mesh4)
    if rank < 2:
        result["load 4->2"] = _load_and_check(tmp / "ck4", full, 2, rank, mesh2)
    if rank == 0:
        shutil.copytree(tmp / "ck4", tmp / "ck4-killed")
    dist.barrier()
    if rank >= 2:
        return
    # a rank killed in the middle of a save: the previous checkpoint stays
    from te_serial.checkpoint import shards
    sd = sharded_state_dict(full, 2, rank, mesh2)
    if rank == 1:
        record.write_text(json.dumps(result))
        write = shards.ShardSet.write

        def dying_write(self, *args, **kwargs):
            write(self, *args, **kwargs)
            os._exit(3)
        shards.ShardSet.write = dying_write
    result["killed"] = _expect_error(lambda: tdcp.save(sd, tmp / "ck4-killed", process_group=mesh2.get_group()))


def _two_ranks(rank, world, mesh, tmp: Path, full, result: dict) -> None:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    group = mesh.get_group()
    sd = sharded_state_dict(full, world, rank, mesh)
    tdcp.save(sd, tmp / "ck2", process_group=group)
    tdcp.async_save(sd, tmp / "ck2a", process_group=group).result()
    result["load 1->2"] = _load_and_check(tmp / "ck1", full, world, rank, mesh)
    result["load 2->2"] = _load_and_check(tmp / "ck2", full, world, rank, mesh)
    # DCP's own stager (what async_save uses) copies the real bytes of DTensors of quantized tensors
    staged = StateDictStager().stage(sd)
    bad = []
    for name, value in sd["model"].items():
        got = staged["model"][name]
        local, copy = (value.to_local(), got.to_local()) if isinstance(value, DTensor) else (value, got)
        if isinstance(local, tsf.QuantizedTensorStorage):
            if type(copy) is not type(local):
                bad.append(f"{name}: staged as {type(copy).__name__}")
                continue
            for b, buf in local.buffers().items():
                c = getattr(copy, b)
                if not same_bits(c, buf) or (buf.numel() and c.data_ptr() == buf.data_ptr()):
                    bad.append(f"{name}.{b}")
    result["staged"] = bad
    # refused: shards off the format's blocks, a per-tensor scale that differs between ranks
    q = ts.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2)
    x = make_input("random", (384, 128), seed=5)  # 192 rows per rank: not whole 128-row blocks
    local = q(x[rank * 192:(rank + 1) * 192])
    d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((384, 128)), stride=(128, 1))
    result["unaligned"] = _expect_error(lambda: tdcp.save({"w": d}, tmp / "bad-unaligned", process_group=group))
    q8 = ts.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    x = make_input("random", (8, 32), seed=6) * (rank + 1)
    mine = q8(x[rank * 4:(rank + 1) * 4])  # each rank quantized on its own: different scales
    d8 = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=torch.Size((8, 32)), stride=(32, 1))
    result["scale_mismatch"] = _expect_error(lambda: tdcp.save({"w8": d8}, tmp / "bad-scale", process_group=group))


def _run(world: int, tmp: Path) -> dict[int, dict]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(CHILD_TIMEOUT)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    out = {}
    for r, p in enumerate(procs):
        f = tmp / f"result-{r}.json"
        out[r] = json.loads(f.read_text()) if f.exists() else {"crash": f"rank {r} exited {p.exitcode}, no record"}
        out[r]["exitcode"] = p.exitcode
    return out


@pytest.fixture(scope="module")
def full():
    return full_tensors()


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory, full):
    """Run the distributed steps once; returns (tmp dir, {rank: record}, full tensors)."""
    tmp = tmp_path_factory.mktemp("dcp")
    ts.save_quantized(full, tmp / "full")
    tdcp.save({"model": dict(full), "opt": dict(VALUES)}, tmp / "ck1")
    return tmp, _run(4, tmp), full


def _record(records, phase, rank):
    rec = records[rank]
    assert "crash" not in rec, rec["crash"]
    return rec


# --- sharded save, load on 1, 2 and 4 ranks ---------------------------------------------------------

LOADS = [("", "load 1->2", 2), ("", "load 2->2", 2), ("", "load 2->4", 4), ("", "load 4->4", 4),
         ("", "load 4->2", 2)]


@pytest.mark.parametrize("phase,what,world", LOADS, ids=[w for _, w, _ in LOADS])
def test_sharded_load_is_bit_exact(dist_run, phase, what, world):
    _, records, full = dist_run
    for rank in range(world):
        got = _record(records, phase, rank)[what]
        bad = {n: v for n, v in got.items() if v != "ok"}
        assert not bad, f"{what} rank {rank}: {bad}"
        assert set(got) == set(full) | {"opt"}


@pytest.mark.parametrize("src", ["ck1", "ck2", "ck4"])
def test_load_on_one_process(dist_run, src):
    """1→1, 2→1, 4→1: a plain state dict of full tensors (no process group) gets every byte back."""
    tmp, _, full = dist_run
    for meta in (True, False):
        sd = destination(full, 1, 0, None, meta=meta)
        tdcp.load(sd, tmp / src)
        got = check_loaded(sd, full, 1, 0, None)
        assert all(v == "ok" for v in got.values()), {k: v for k, v in got.items() if v != "ok"}


@pytest.mark.parametrize("src", ["ck1", "ck2", "ck2a", "ck4"])
def test_open_load_verify_inspect(dist_run, src):
    """The result is a te-serial checkpoint: open / get / load_quantized / verify / inspect on one
    process assemble each tensor from its chunks, bit for bit."""
    tmp, _, full = dist_run
    path = tmp / src
    with ts.open(path) as ckpt:
        assert ckpt.manifest.version == ts.checkpoint.VERSION  # chunks need 1.2; writers tag the current version
        for name, t in full.items():
            assert_same_tensor(ckpt.get(f"model.{name}"), t, name)
    obj = ts.load_quantized(path, verify=True)
    assert obj["opt"] == VALUES
    for name, t in full.items():
        assert_same_tensor(obj["model"][name], t, name)
    assert ts.verify(path) > len(full)
    from te_serial.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(path), "--json"]) in (0, None)
    assert f"model.{REPLICATED_Q}" in json.dumps(json.loads(out.getvalue()))


def test_sharded_checkpoint_has_one_shard_per_rank_and_chunks(dist_run):
    tmp, _, full = dist_run
    for src, world in (("ck2", 2), ("ck4", 4)):
        m = ts.open(tmp / src).manifest
        assert len(m.files) == world and all(SHARD_NAME.fullmatch(f) for f in m.files)
        assert len({f.split("-")[1] for f in m.files}) == 1  # one save id
        name = next(n for n, (q, s, d) in QCASES.items() if d == 0 and s[0] >= 4 * 32)
        i = m.names.index(f"model.{name}")
        pieces = m.chunks[i][0]
        assert len(pieces) == world and len({pc.file for pc in pieces}) == world
        assert [f for f in (tmp / src).iterdir() if f.name.startswith(".te_serial-tmp-")] == []


def test_async_save_stages_the_real_bytes(dist_run):
    _, records, _ = dist_run
    for rank in range(2):
        assert _record(records, "", rank)["staged"] == []


def test_async_staging_single_process(full):
    """DCP's stager (async_save's default) copies a quantized tensor's real bytes, not NaNs."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    staged = StateDictStager().stage(full)
    for name, t in full.items():
        assert_same_tensor(staged[name], t, name)
        if isinstance(t, tsf.QuantizedTensorStorage):
            for b, buf in t.buffers().items():
                assert buf.numel() == 0 or getattr(staged[name], b).data_ptr() != buf.data_ptr()


@pytest.mark.parametrize("src", ["ck2", "ck4"])
def test_consolidate(dist_run, src, tmp_path):
    tmp, _, full = dist_run
    out = tmp_path / "whole"
    m = tdcp.consolidate(tmp / src, out)
    assert not m.chunks
    obj = ts.load_quantized(out, verify=True)
    assert obj["opt"] == VALUES
    for name, t in full.items():
        assert_same_tensor(obj["model"][name], t, name)
    single = tmp_path / "single"
    ts.save_quantized({"model": dict(full), "opt": dict(VALUES)}, single)
    a, b = ts.open(out), ts.open(single)
    for name in a.keys():  # the same buffers as a single-process save of the same tensors
        assert a.manifest.proto(name) == b.manifest.proto(name)


def test_verify_catches_a_flipped_byte_in_one_ranks_shard(dist_run, tmp_path):
    tmp, _, _ = dist_run
    for rank_file in (0, 1):
        path = tmp_path / f"flip{rank_file}"
        shutil.copytree(tmp / "ck2", path)
        m = ts.open(path).manifest
        shard = path / list(m.files)[rank_file]
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x40
        shard.write_bytes(bytes(data))
        with pytest.raises(tse.ChecksumError):
            ts.verify(path)


def test_no_file_is_a_pickle(dist_run):
    tmp, _, _ = dist_run
    for src in ("ck1", "ck2", "ck2a", "ck4"):
        path = tmp / src
        names = {p.name for p in path.iterdir()}
        assert ".metadata" not in names and not any(n.endswith((".distcp", ".pt", ".pkl")) for n in names)
        for p in path.iterdir():
            head = p.read_bytes()[:16]
            assert not head.startswith((b"\x80", b"PK\x03\x04")), p  # pickle protocol 2+, torch.save zip
            if p.name == "te_serial.msgpack":
                assert head[0] & 0xF0 == 0x80 or head[0] in (0xDE, 0xDF)  # a msgpack map
            else:
                n = int.from_bytes(head[:8], "little")
                assert head[8:9] == b"{" and 0 < n < p.stat().st_size  # safetensors header
        from te_serial.checkpoint.tree import unpack
        stack = [unpack((path / "te_serial.msgpack").read_bytes())]
        while stack:  # no value in the manifest is a pickle
            v = stack.pop()
            if isinstance(v, dict):
                stack += list(v.keys()) + list(v.values())
            elif isinstance(v, (list, tuple)):
                stack += list(v)
            elif isinstance(v, (bytes, bytearray)):
                assert not (v[:1] == b"\x80" and v[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), v[:16]


def test_nothing_pickles_or_unpickles(tmp_path, monkeypatch, full):
    """Save, async save, load, open, consolidate with pickle and torch.save/load made to fail."""
    def refuse(*a, **k):
        raise AssertionError("pickle used")
    for mod, attr in ((pickle, "dumps"), (pickle, "loads"), (pickle, "dump"), (pickle, "load"),
                      (torch, "save"), (torch, "load")):
        monkeypatch.setattr(mod, attr, refuse)
    sd = {"model": dict(full), "opt": dict(VALUES)}
    tdcp.save(sd, tmp_path / "a")
    tdcp.async_save(sd, tmp_path / "b").result()
    dst = destination(full, 1, 0, None)
    tdcp.load(dst, tmp_path / "b")
    assert all(v == "ok" for v in check_loaded(dst, full, 1, 0, None).values())
    tdcp.consolidate(tmp_path / "a", tmp_path / "c")
    assert ts.load_quantized(tmp_path / "c")["opt"] == VALUES


# --- refusals --------------------------------------------------------------------------------------------

def test_unaligned_shards_are_refused(dist_run):
    _, records, _ = dist_run
    for rank in range(2):
        err = _record(records, "", rank)["unaligned"]
        assert err["type"] == "ShapeError", err
        msg = err["message"]
        assert "'w'" in msg and "on rank 0" in msg and "block of 128 rows" in msg, msg


def test_per_tensor_scale_mismatch_is_refused(dist_run):
    _, records, _ = dist_run
    for rank in range(2):
        err = _record(records, "", rank)["scale_mismatch"]
        assert err["type"] == "CheckpointError", err
        assert "'w8'" in err["message"] and "_scale_inv" in err["message"] and "rank 1" in err["message"]


def test_killed_rank_leaves_the_previous_checkpoint(dist_run):
    tmp, records, full = dist_run
    assert records[1]["exitcode"] == 3  # rank 1 died in the middle of writing
    assert _record(records, "", 0)["killed"]["type"] == "CheckpointError"  # rank 0's save failed
    path = tmp / "ck4-killed"
    with ts.open(path) as ckpt:
        for name, t in full.items():
            assert_same_tensor(ckpt.get(f"model.{name}"), t, name)
        listed = set(ckpt.manifest.files) | {"te_serial.msgpack"}
    assert ts.verify(path)
    leftovers = {p.name for p in path.iterdir()} - listed
    assert leftovers  # what the killed save wrote, never referenced
    tdcp.save({"x": torch.ones(3)}, path)  # the next save commits and removes them
    assert {p.name for p in path.iterdir()} == set(ts.open(path).manifest.files) | {"te_serial.msgpack"}


def test_values_pickle_would_need_are_refused(tmp_path):
    class Thing:
        pass
    for bad in (Thing(), {1.5: 2}, torch.float32):
        with pytest.raises(tse.UnsupportedValueError) as e:
            tdcp.save({"opt": {"x": bad}, "w": torch.ones(2)}, tmp_path / "p")
        assert "opt" in str(e.value)
        with pytest.raises(tse.UnsupportedValueError):
            tdcp.async_save({"opt": {"x": bad}}, tmp_path / "p")
    assert not (tmp_path / "p" / "te_serial.msgpack").exists()


def test_dcp_default_planner_bytes_are_refused_by_the_writer(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(2), "v": 3}, storage_writer=tdcp.StorageWriter(tmp_path / "p"), no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, tse.UnsupportedValueError)
    # plain tensors alone work with DCP's own planner and give a te-serial checkpoint
    dcp.save({"w": torch.arange(4.0), "m": {"b": torch.ones(2, 2)}},
             storage_writer=tdcp.StorageWriter(tmp_path / "q"), no_dist=True)
    assert torch.equal(ts.load_quantized(tmp_path / "q")["w"], torch.arange(4.0))


def test_filesystem_writer_checkpoint_is_refused_unread(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
    assert (tmp_path / "fs" / ".metadata").exists()

    def refuse(*a, **k):
        raise AssertionError("unpickled")
    for mod, attr in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(mod, attr, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    with pytest.raises(tse.ManifestError) as e:
        tdcp.load({"w": torch.zeros(2)}, tmp_path / "fs")
    assert "FileSystemReader" in str(e.value) and "pickle" in str(e.value)


def test_load_refuses_another_format_or_shape(tmp_path):
    w = ts.MXFP8Quantizer(torch.float8_e4m3fn)(torch.randn(64, 64))
    tdcp.save({"w": w}, tmp_path / "c")
    for other in (ts.NVFP4Quantizer()(torch.randn(64, 64)), ts.MXFP8Quantizer(torch.float8_e4m3fn)(torch.randn(32, 64)),
                  torch.zeros(64, 64)):
        with pytest.raises(ts.CheckpointError) as e:
            tdcp.load({"w": other}, tmp_path / "c")
        assert "'w'" in str(e.value)
    with pytest.raises(ts.CheckpointError):
        tdcp.load({"w": w, "missing": torch.zeros(2)}, tmp_path / "c")
    tdcp.load({"w": w, "missing": torch.zeros(2)}, tmp_path / "c", allow_partial_load=True)


# --- tensor-parallel sliced loads -----------------------------------------------------------------------

def _slice_cases():
    out = {}
    for i, (make, shape) in enumerate(FORMAT_CASES):
        for r, c in USAGES:
            out[f"t{i}_{int(r)}{int(c)}"] = make(r, c)(make_input("random", shape, seed=i))
    out["plain"] = torch.randn(6, 10, 12)
    return out


def _ranges(rng: random.Random, n: int, align: int, count: int):
    blocks = math.ceil(n / align)
    out = [None]
    for _ in range(count):
        b0 = rng.randrange(blocks)
        b1 = rng.randrange(b0 + 1, blocks + 1)
        out.append((b0 * align, min(b1 * align, n)))
    return out


@pytest.fixture(scope="module")
def slice_ckpts(tmp_path_factory, dist_run):
    tmp = tmp_path_factory.mktemp("slices")
    sd = _slice_cases()
    ts.save_quantized(sd, tmp / "dir")
    ts.save_quantized(sd, tmp / "one.safetensors")
    return sd, {"dir": tmp / "dir", "file": tmp / "one.safetensors", "ck2": dist_run[0] / "ck2"}, dist_run[2]


@pytest.mark.parametrize("layout", ["dir", "file"])
def test_sliced_get_equals_slice_quantized(slice_ckpts, layout):
    sd, paths, _ = slice_ckpts
    rng = random.Random(layout)
    with ts.open(paths[layout]) as ckpt:
        for name, t in sd.items():
            m, k = math.prod(t.shape[:-1]), t.shape[-1]
            ra, ca = t.quantizer.slice_alignment() if isinstance(t, tsf.QuantizedTensorStorage) else (1, 1)
            for rows in _ranges(rng, m, ra, 2 if not LONG else 5):
                for cols in _ranges(rng, k, ca, 2 if not LONG else 5):
                    if rows is None and cols is None:
                        continue
                    got = ckpt.get(name, rows=rows, cols=cols)
                    if isinstance(t, tsf.QuantizedTensorStorage):
                        assert_same_tensor(got, slice_quantized(t, rows=rows, cols=cols), f"{name} {rows} {cols}")
                    else:
                        r0, r1 = rows or (0, m)
                        c0, c1 = cols or (0, k)
                        want = t.reshape(m, k)[r0:r1, c0:c1]
                        want = want.reshape(*t.shape[:-1], c1 - c0) if rows is None else want
                        assert same_bits(got, want.contiguous()), name


def test_sliced_get_of_a_sharded_checkpoint(slice_ckpts):
    """Ranges that cut across the chunks of a DCP checkpoint."""
    _, paths, full = slice_ckpts
    rng = random.Random(7)
    with ts.open(paths["ck2"]) as ckpt:
        for name, t in full.items():
            if not isinstance(t, tsf.QuantizedTensorStorage) or t.dim() < 1:
                continue
            m, k = math.prod(t.shape[:-1]), t.shape[-1]
            ra, ca = t.quantizer.slice_alignment()
            for rows in _ranges(rng, m, ra, 3):
                for cols in _ranges(rng, k, ca, 2):
                    if rows is None and cols is None:
                        continue
                    got = ckpt.get(f"model.{name}", rows=rows, cols=cols)
                    assert_same_tensor(got, slice_quantized(t, rows=rows, cols=cols), f"{name} {rows} {cols}")
        for name in PLAIN:
            t = full[name]
            if t.dim() == 2 and t.numel():
                got = ckpt.get(f"model.{name}", rows=(1, t.shape[0]), cols=(1, 2))
                assert same_bits(got, t[1:, 1:2].contiguous()), name


def test_unaligned_slices_are_refused(slice_ckpts):
    sd, paths, _ = slice_ckpts
    with ts.open(paths["dir"]) as ckpt:
        with pytest.raises(tse.ShapeError, match="blocks of 32"):
            ckpt.get("t2_11", rows=(16, 48))
        with pytest.raises(tse.ShapeError, match="blocks of 16"):
            ckpt.get("t6_10", cols=(8, 32))
        with pytest.raises(tse.ShapeError):
            ckpt.get("t0_11", rows=(5, 5))


def _region_bytes(t, rows, cols) -> int:
    q, shape = t.quantizer, tuple(t.shape)
    values = q.value_dtypes()
    return sum(math.prod(z) * values[b].itemsize for b, (_, z) in buffer_regions(q, shape, rows, cols).items())


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return -1


def test_sliced_get_reads_only_the_slice(tmp_path):
    """A quarter of the rows reads the quarter's bytes: counted by the reader and by the kernel
    (``rchar``: bytes read through read syscalls), at most the slice's bytes plus the header."""
    q = ts.MXFP8Quantizer(torch.float8_e4m3fn)
    w = q(torch.randn(512, 256))
    ts.save_quantized({"w": w, "other": torch.randn(256, 256)}, tmp_path / "c")
    with ts.open(tmp_path / "c") as ckpt:
        for rows, cols in (((128, 256), None), (None, (64, 128)), ((0, 32), (224, 256))):
            f = ckpt._file(ckpt.manifest.locations("w")[0][1])
            before, kernel = f.bytes_read, _rchar()
            got = ckpt.get("w", rows=rows, cols=cols)
            kernel = _rchar() - kernel
            want = _region_bytes(w, rows, cols)
            assert f.bytes_read - before == want
            if kernel >= 0:
                assert kernel <= want + f.header.data_start
            assert_same_tensor(got, slice_quantized(w, rows=rows, cols=cols))
        whole = sum(b.nbytes for b in ckpt.manifest.tensors["w"].buffers.values())
        assert _region_bytes(w, (0, 128), None) <= 0.3 * whole


def test_load_into_with_shard_fn(tmp_path):
    import inspect
    from torch import nn
    if "shard_fn" not in inspect.signature(ts.load_into).parameters:
        pytest.skip("load_into(..., shard_fn=) is not in te_serial.model yet")
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    ts.quantize_model(full, ts.MXFP8Quantizer(torch.float8_e4m3fn), exclude=[])
    ts.save_quantized(full, tmp_path / "c")
    world = 2
    for rank in range(world):
        def shard_fn(name, proto):
            if name == "0.weight":       # column-parallel: a slice of the output rows
                n = proto.shape[0] // world
                return {"rows": (rank * n, (rank + 1) * n)}
            if name == "1.weight":       # row-parallel: a slice of the input columns
                n = proto.shape[1] // world
                return {"cols": (rank * n, (rank + 1) * n)}
            if name == "0.bias":
                n = proto.shape[0] // world
                return {"cols": (rank * n, (rank + 1) * n)}
            return None
        with torch.device("meta"):
            local = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        ts.load_into(local, tmp_path / "c", shard_fn=shard_fn)
        for got, want in ((local[0].weight, slice_quantized(full[0].weight, rows=(rank * 64, rank * 64 + 64))),
                          (local[1].weight, slice_quantized(full[1].weight, cols=(rank * 64, rank * 64 + 64)))):
            assert isinstance(got, tsf.QuantizedTensorStorage) and got.shape == want.shape
            for n, b in want.buffers().items():
                assert same_bits(getattr(got, n), b), n
        assert torch.equal(local[0].bias.detach(), full[0].bias.detach()[rank * 64:(rank + 1) * 64])
        assert torch.equal(local[1].bias.detach(), full[1].bias.detach())


# --- the chunk extension of the manifest (format 1.2): what the reader refuses ----------------------

def _rewrite(path: Path, edit) -> None:
    from te_serial.checkpoint.manifest import seal
    from te_serial.checkpoint.tree import unpack
    doc = unpack((path / "te_serial.msgpack").read_bytes())
    edit(doc)
    (path / "te_serial.msgpack").write_bytes(seal(doc))


def _chunked_row(doc, pieces: int = 2) -> tuple[int, dict]:
    """The first tensor whose first buffer has ``pieces`` pieces along rows of a 2-D region."""
    for i, entry in enumerate(doc["tensors"]["chunks"]):
        if entry is not None and len(entry["offsets"][0]) == pieces and len(entry["offsets"][0][0]) == 2:
            return i, entry
    raise AssertionError("no such tensor")


def _overlap(doc):
    _, e = _chunked_row(doc)
    (o0, o1), (s0, _) = e["offsets"][0], e["sizes"][0]
    assert o0 == [0, 0] and o1[0] == s0[0] and o1[1] == 0  # two row pieces
    o1[0] -= 1  # same volume, inside the region, overlapping by one row


def _drop_piece(doc):
    _, e = _chunked_row(doc)
    for col in ("offsets", "sizes", "files", "checksums"):
        e[col][0].pop()


CHUNK_EDITS = {
    "overlap": (_overlap, "overlap"),
    "outside": (lambda d: _chunked_row(d)[1]["sizes"][0][1].__setitem__(0, 10 ** 6), "leaves the region"),
    "missing piece": (_drop_piece, "elements"),
    "file index": (lambda d: _chunked_row(d)[1]["files"][0].__setitem__(0, 99), "file index out of range"),
    "no checksums": (lambda d: _chunked_row(d)[1].__setitem__("checksums", None), "checksums"),
    "buffers": (lambda d: [_chunked_row(d)[1][c].append([]) for c in ("offsets", "sizes", "files", "checksums")],
                "buffers"),
    "dims": (lambda d: _chunked_row(d)[1]["offsets"][0][0].append(0), "offsets/sizes"),
    "float": (lambda d: _chunked_row(d)[1]["offsets"][0][1].__setitem__(0, float(_chunked_row(d)[1]["offsets"][0][1][0])),
              "not an integer"),
    "files row": (lambda d: d["tensors"]["files"].__setitem__(_chunked_row(d)[0], [0]), "must be empty"),
    # the checkpoint holds every format, MXFP4 (format 1.5) too: relabelled 1.1 it breaks both rules
    "version 1.1": (lambda d: d.__setitem__("version", [1, 1]), r"needs format 1\.[25]"),
    "version 1.4": (lambda d: d.__setitem__("version", [1, 4]), "'mxfp4' needs format 1.5"),
    "column length": (lambda d: d["tensors"]["chunks"].pop(), "different lengths"),
    "tied": (lambda d: _tie(d), "cannot be tied"),
}


def _tie(doc):
    """A second row with the same prototype and chunks, tied to the chunked tensor."""
    i, e = _chunked_row(doc)
    cols = doc["tensors"]
    cols["names"].append(cols["names"][i] + "_tied")
    for col, value in (("protos", cols["protos"][i]), ("files", []), ("checksums", []), ("chunks", e)):
        cols[col].append(value)
    cols["aliases"] = [[len(cols["names"]) - 1, i]]


@pytest.mark.parametrize("case", list(CHUNK_EDITS))
def test_chunk_manifest_is_validated(dist_run, tmp_path, case):
    tmp, _, _ = dist_run
    path = tmp_path / "c"
    shutil.copytree(tmp / "ck2", path)
    edit, message = CHUNK_EDITS[case]
    _rewrite(path, edit)
    with pytest.raises(tse.ManifestError, match=message):
        ts.open(path)


def test_chunk_piece_in_the_wrong_file_is_refused(dist_run, tmp_path):
    tmp, _, _ = dist_run
    path = tmp_path / "c"
    shutil.copytree(tmp / "ck2", path)
    _rewrite(path, lambda d: _chunked_row(d)[1]["files"][0].__setitem__(0, 1 - _chunked_row(d)[1]["files"][0][0]))
    with pytest.raises(ts.CheckpointError):
        ts.load_quantized(path)


def test_piece_key_collision_is_refused(tmp_path):
    w = ts.MXFP8Quantizer(torch.float8_e4m3fn)(torch.randn(32, 32))
    tdcp.save({"w": w, "x": torch.ones(2)}, tmp_path / "c")

    def rename(doc):
        doc["tensors"]["names"][doc["tensors"]["names"].index("x")] = "w._rowwise_data@0"
    _rewrite(tmp_path / "c", rename)
    with pytest.raises(tse.ManifestError, match="piece of a chunked tensor"):
        ts.open(tmp_path / "c")


def test_tiling_check_is_bounded():
    from te_serial.checkpoint.manifest import check_tiling
    boxes = [((i, 0), (1, 100)) for i in range(100)]  # 100 row pieces: a valid tiling
    assert check_tiling((100, 100), boxes, [10 ** 6]) is None
    stacked = [((0, i), (100, 1)) for i in range(100)]  # every piece spans the sweep dim
    assert check_tiling((100, 100), stacked, [10 ** 6]) is None  # swept along the other dim
    assert "overlap" in check_tiling((100, 100), [((0, 0), (50, 100)), ((40, 0), (50, 100))], [10 ** 6])
    crossing = [((a, b), (1, 1)) for a in range(30) for b in range(30)]
    assert "work bound" in check_tiling((30, 30), crossing, [5])


def test_load_into_shard_fn_refusals(tmp_path):
    import inspect
    from torch import nn
    if "shard_fn" not in inspect.signature(ts.load_into).parameters:
        pytest.skip("load_into(..., shard_fn=) is not in te_serial.model yet")
    full = nn.Linear(64, 64)
    ts.quantize_model(full, ts.MXFP8Quantizer(torch.float8_e4m3fn), exclude=[])
    ts.save_quantized(full, tmp_path / "c")
    for spec, err in (({"rows": (0, 32), "bad": 1}, ts.CheckpointError), ({"rows": (0, 16)}, tse.ShapeError),
                      ({"rows": (0, 48)}, ts.CheckpointError)):  # not a dict of rows/cols; unaligned; shape
        out = 16 if spec.get("rows") == (0, 16) else 32
        with torch.device("meta"):
            local = nn.Linear(64, out)
        with pytest.raises(err):
            ts.load_into(local, tmp_path / "c", shard_fn=lambda n, p, s=spec, o=out: s if n == "weight" else
                         {"cols": (0, o)})
