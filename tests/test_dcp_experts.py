"""MoE expert stacks through ``te_serial.dcp`` (issue 36): grouped (3-D) expert tensors sharded by
whole experts — FSDP2's ``Shard(0)`` and expert parallelism are the same cut of a stack — saved from
2 processes, loaded back into 2 and resharded into 3 (uneven: 3 + 3, then 2 + 2 + 2, with 5 and 6
experts), into one process whole, and read a range of experts at a time (only their bytes).

Real process groups on CPU (gloo, ``spawn``): one run of 2 processes and one of 3, each checking
its own shards against the full tensors built the same way in every process.
"""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial.formats.grouped import GroupedTensor, per_expert

pytestmark = pytest.mark.slow


def full_state() -> dict[str, GroupedTensor]:
    """Expert stacks of every grouped format, experts of very different magnitudes, one all zero; a
    transposed (gpt-oss) stack among them."""
    g = torch.Generator().manual_seed(7)
    out = {}
    cases = (("l0.mlp.experts.gate_up_proj", ts.MXFP8Quantizer(), (6, 64, 32), False),
             ("l0.mlp.experts.down_proj", ts.NVFP4Quantizer(columnwise=False), (6, 32, 32), False),
             ("l1.mlp.experts.gate_up_proj", ts.Float8CurrentScalingQuantizer(), (5, 32, 48), False),
             ("l1.mlp.experts.down_proj", ts.Float8BlockQuantizer(block_scaling_dim=1), (5, 16, 128), False),
             ("l2.mlp.experts.gate_up_proj", ts.MXFP8Quantizer(columnwise=False), (5, 32, 64), True))
    for name, q, shape, transposed in cases:
        x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0]).reshape(-1, 1, 1)
        x[1] = 0
        out[name] = per_expert(q, shape, transposed=transposed).quantize(x)
    return out


def expert_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's Shard(0) cut of ``n`` experts: ceil(n / world) a rank, the last ones fewer."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def same(a, b) -> bool:
    return (a.quantizer == b.quantizer and a.shape == b.shape and set(a.buffers()) == set(b.buffers())
            and all(torch.equal(x.view(torch.uint8), b.buffers()[k].view(torch.uint8)) for k, x in a.buffers().items()))


def _child(rank: int, world: int, port: int, tmp: str, save: bool, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    import te_serial.dcp as tdcp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_state()

        def sharded(t):
            a, b = expert_range(t.shape[0], world, rank)
            return DTensor.from_local(t.member_range(a, b), mesh, [Shard(0)], run_check=False, shape=t.shape,
                                      stride=t.stride())
        if save:
            tdcp.save({k: sharded(v) for k, v in full.items()}, Path(tmp) / "ck", process_group=mesh.get_group())
        dest = {k: sharded(v.quantizer.quantize(torch.zeros(v.shape))) for k, v in full.items()}
        tdcp.load(dest, Path(tmp) / "ck", process_group=mesh.get_group())
        out[rank] = {k: same(dest[k]._local_tensor, sharded(v)._local_tensor) for k, v in full.items()}
    finally:
        dist.destroy_process_group()


def _entry(rank, world, port, tmp, save, result_dir):
    import json
    got: dict = {}
    _child(rank, world, port, tmp, save, got)
    Path(result_dir, f"{world}_{rank}.json").write_text(json.dumps(got[rank]))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, tmp: Path, save: bool) -> dict[int, dict]:
    import json
    import torch.multiprocessing as mp
    sys.path.insert(0, str(Path(__file__).parent))
    mp.start_processes(_entry, args=(world, _port(), str(tmp), save, str(tmp)), nprocs=world, start_method="spawn")
    return {r: json.loads((tmp / f"{world}_{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        two = _run(2, tmp, save=True)     # save from 2 ranks, load back into the same cut
        three = _run(3, tmp, save=False)  # reshard 2 -> 3
        yield tmp / "ck", two, three


def test_each_rank_loads_its_own_experts_exactly(saved):
    _, two, three = saved
    for results in (two, three):
        for rank, checks in results.items():
            assert checks and all(checks.values()), (rank, checks)


def test_the_checkpoint_reads_whole_and_by_range_of_experts_reading_only_their_bytes(saved):
    path, _, _ = saved
    full = full_state()
    with ts.open(path) as ckpt:
        for name, t in full.items():
            assert same(ckpt.get(name), t), name
            before = sum(f.bytes_read for f in ckpt._files.values())
            part = ckpt.get(name, members=(2, 4))
            read = sum(f.bytes_read for f in ckpt._files.values()) - before
            assert same(part, t.member_range(2, 4)), name
            assert read == part.quantized_nbytes(), name   # those experts' bytes, nothing else
            assert torch.equal(part.dequantize(), t.dequantize()[2:4])
