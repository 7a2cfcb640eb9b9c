"""Checkpoint round trips: every format × usage, plain dtypes, structure, sharding, lazy reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.checkpoint.tree import unpack
from helpers import E5M2, FORMAT_CASES, USAGES, assert_same_tensor, make_input

FORMATS = FORMAT_CASES
PLAIN_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.complex64]


def _quantized_state():
    sd = {}
    for i, (make, shape) in enumerate(FORMATS):
        for r, c in USAGES:
            q = make(r, c)
            sd[f"{q.kind}{i}.{'r' if r else ''}{'c' if c else ''}"] = q(make_input("outliers", shape, torch.bfloat16, i))
    return sd


def _plain(dtype, shape=(3, 4)):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw[..., 0] % 2 == 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("layout", ["dir", "file", "sharded"])
def test_every_format_and_usage_round_trips_bit_exactly(tmp_path, layout):
    sd = _quantized_state()
    path = tmp_path / ("ck.safetensors" if layout == "file" else "ck")
    ts.save_quantized(sd, path, max_shard_size=3000 if layout == "sharded" else "5GB")
    if layout == "sharded":
        assert len(list(path.glob("*.safetensors"))) > 5
    out = ts.load_quantized(path, verify=True)
    assert list(out) == list(sd)
    for k in sd:
        assert_same_tensor(out[k], sd[k], k)
        assert torch.equal(out[k].dequantize(torch.float32).nan_to_num(), sd[k].dequantize(torch.float32).nan_to_num())


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_plain_tensors_of_every_dtype_and_odd_shapes(tmp_path, dtype):
    sd = {"t": _plain(dtype), "empty": _plain(dtype, (0, 5)), "scalar": _plain(dtype, ()),
          "vec": _plain(dtype, (7,))}
    for path in (tmp_path / "d", tmp_path / "f.safetensors"):
        ts.save_quantized(sd, path)
        out = ts.load_quantized(path)
        for k in sd:
            assert_same_tensor(out[k], sd[k], k)


def test_structure_values_and_metadata_come_back(tmp_path):
    opt_state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}, 1: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                          "amsgrad": False, "maximize": False, "foreach": None, "params": [0, 1],
                          "name": "all", "big": 2**62, "neg": -7, "blob": b"\x00\xff"}],
    }
    sd = {"model": {"layer": {"weight": ts.NVFP4Quantizer()(torch.randn(32, 32))}}, "optim": opt_state,
          "epoch": 4, "tags": ["a", "b"], "empty": {}, "nothing": None, "pair": (1, "x")}
    path = tmp_path / "ck"
    ts.save_quantized(sd, path, metadata={"run": "abc", "step": "12"})
    out = ts.load_quantized(path)
    assert out["optim"]["param_groups"] == opt_state["param_groups"]
    assert isinstance(out["optim"]["param_groups"][0]["betas"], tuple)
    assert list(out["optim"]["state"]) == [0, 1] and isinstance(next(iter(out["optim"]["state"])), int)
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], opt_state["state"][0]["exp_avg"])
    assert (out["epoch"], out["tags"], out["empty"], out["nothing"], out["pair"]) == (4, ["a", "b"], {}, None, (1, "x"))
    assert_same_tensor(out["model"]["layer"]["weight"], sd["model"]["layer"]["weight"])
    with ts.open(path) as h:
        assert h.metadata == {"run": "abc", "step": "12"}
        assert "model.layer.weight" in h.keys() and "optim.state.0.exp_avg" in h


def test_module_state_dict_and_tied_weights(tmp_path):
    m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    m[1].weight = m[0].weight  # tied
    path = tmp_path / "m.safetensors"
    ts.save_quantized(m, path)
    with safe_open(str(path), "pt") as f:
        assert len(list(f.keys())) == 1  # stored once
    out = ts.load_quantized(path)
    assert out["0.weight"] is out["1.weight"]
    assert torch.equal(out["0.weight"], m[0].weight.detach())
    w = ts.MXFP8Quantizer()(torch.randn(32, 32))
    out = ts.load_quantized(ts.save_quantized({"a": w, "b": w.detach()}, tmp_path / "q") and tmp_path / "q")
    assert out["a"] is out["b"]


def test_views_and_non_contiguous_tensors_are_saved_by_value(tmp_path):
    base = torch.arange(20.0).reshape(4, 5)
    sd = {"t": base.t(), "row": base[1], "col": base[:, 2], "base": base}
    out = ts.load_quantized(ts.save_quantized(sd, tmp_path / "v") and tmp_path / "v")
    for k, v in sd.items():
        assert torch.equal(out[k], v) and out[k].shape == v.shape


def test_requires_grad_is_kept(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    q = ts.MXFP8Quantizer()(torch.randn(32, 32)).requires_grad_(True)
    out = ts.load_quantized(ts.save_quantized({"p": p, "q": q}, tmp_path / "g") and tmp_path / "g")
    assert out["p"].requires_grad and out["q"].requires_grad
    assert ts.read_protos(tmp_path / "g")["q"].requires_grad


def test_buffers_readable_by_plain_safetensors_with_true_dtypes(tmp_path):
    sd = {"fp8": ts.Float8CurrentScalingQuantizer(E5M2, columnwise=False)(torch.randn(16, 16)),
          "mx": ts.MXFP8Quantizer(columnwise=False)(torch.randn(32, 64)),
          "nv": ts.NVFP4Quantizer(columnwise=False)(torch.randn(16, 32)),
          "blk": ts.Float8BlockQuantizer(columnwise=False)(torch.randn(16, 32)),
          "bias": torch.randn(4, dtype=torch.bfloat16)}
    path = tmp_path / "ck"
    ts.save_quantized(sd, path)
    [shard] = list(path.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        assert torch.equal(f.get_tensor("mx._rowwise_data").view(torch.uint8), sd["mx"]._rowwise_data)
    assert dtypes == {"fp8._data": "F8_E5M2", "fp8._scale_inv": "F32", "mx._rowwise_data": "F8_E4M3",
                      "mx._rowwise_scale_inv": "F8_E8M0", "nv._rowwise_data": "U8",
                      "nv._rowwise_scale_inv": "F8_E4M3", "nv._amax_rowwise": "F32",
                      "blk._rowwise_data": "F8_E4M3", "blk._rowwise_scale_inv": "F32", "bias": "BF16"}


def test_same_tensors_give_the_same_bytes(tmp_path):
    x = torch.randn(100, 200)
    a = ts.save_quantized({"w": ts.Float8BlockQuantizer()(x)}, tmp_path / "a.safetensors")
    b = ts.save_quantized({"w": ts.Float8BlockQuantizer()(x.clone())}, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert a.tensors["w"].buffers["_rowwise_scale_inv"].checksum == b.tensors["w"].buffers["_rowwise_scale_inv"].checksum


def test_lazy_open_reads_only_what_is_asked(tmp_path, monkeypatch):
    sd = {f"w{i}": ts.MXFP8Quantizer()(torch.randn(64, 64)) for i in range(6)}
    path = tmp_path / "ck"
    ts.save_quantized(sd, path, max_shard_size=10_000)
    read = []
    from te_serial.checkpoint import reader
    orig = reader.Checkpoint._read_buffer
    monkeypatch.setattr(reader.Checkpoint, "_read_buffer",
                        lambda self, t, b, *rest: read.append((t, b)) or orig(self, t, b, *rest))
    with ts.open(path) as h:
        protos = h.protos
        assert set(protos) == set(sd) and read == []
        assert protos["w3"] == ts.to_tensor_proto(sd["w3"]).__class__(
            (64, 64), torch.float32, ts.MXFP8Quantizer(), False, None)
        w3 = h.get("w3")
        assert {t for t, _ in read} == {"w3"}
        assert_same_tensor(w3, sd["w3"])
        sub = h.load_tensors(["w1", "w5"])
        assert set(sub) == {"w1", "w5"} and {t for t, _ in read} == {"w1", "w3", "w5"}
        meta = h.get("w2", device="meta")
        assert meta.device.type == "meta" and isinstance(meta, tsf.MXFP8Tensor)
        with pytest.raises(ts.CheckpointError, match="no tensor 'nope'"):
            h.get("nope")
    assert ts.read_protos(path) == protos


def test_cpu_load_is_zero_copy_mmap(tmp_path):
    w = ts.MXFP8Quantizer(columnwise=False)(torch.randn(1024, 1024))
    path = tmp_path / "z.safetensors"
    ts.save_quantized({"w": w}, path)
    out = ts.load_quantized(path)["w"]
    maps = open("/proc/self/maps").read().splitlines()
    ptr = out._rowwise_data.data_ptr()
    mapped = [line for line in maps if str(path) in line]
    assert any(int(l.split()[0].split("-")[0], 16) <= ptr < int(l.split()[0].split("-")[1], 16) for l in mapped)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    return [tuple(int(a, 16) for a in line.split()[0].split("-"))
            for line in open("/proc/self/maps").read().splitlines() if str(path) in line]


def test_stream_maps_each_buffer_alone_and_checks_once_asked(tmp_path):
    """Checkpoint.stream (convert's byte relayouts): the same tensor as get, each buffer a mapping of
    its own pages that goes away with the tensor, and a checksum check that runs when called."""
    sd = {"w": ts.NVFP4Quantizer()(make_input("outliers", (256, 128), torch.bfloat16, 0)),
          "b": torch.randn(1000), "s": torch.tensor(3.0)}
    path = tmp_path / "s.safetensors"
    ts.save_quantized(sd, path)
    with ts.Checkpoint(path) as ck:
        for name in sd:
            t, check = ck.stream(name)
            assert_same_tensor(t, ck.get(name, mmap=False), name)
            check()
            assert ck.stream(name, verify=False)[1] is None
        t, _ = ck.stream("w")
        ptr = t._rowwise_data.data_ptr()
        assert [r for r in _mapped_ranges(path) if r[0] <= ptr < r[1]]
        before = len(_mapped_ranges(path))
        del t, _
        assert len(_mapped_ranges(path)) < before  # the buffers' own mappings are gone with the tensor
    entry = ts.Checkpoint(path).manifest.locations("w")[0]  # the rowwise codes' key
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:header])[entry[2]]["data_offsets"]
    data[header + offsets[0]] ^= 0x10
    path.write_bytes(bytes(data))
    with ts.Checkpoint(path) as ck:
        t, check = ck.stream("w")  # nothing is checked yet
        with pytest.raises(tse.ChecksumError, match="does not match its checksum") as e:
            check()
        assert e.value.tensor == "w"
    nocheck = tmp_path / "n.safetensors"
    ts.save_quantized({"a": torch.ones(3)}, nocheck, checksums=False)
    with ts.Checkpoint(nocheck) as ck:
        t, check = ck.stream("a")
        assert torch.equal(t, torch.ones(3))
        with pytest.raises(tse.ChecksumError, match="without checksums"):
            check()


def test_resave_replaces_old_shards_and_keeps_directory_clean(tmp_path):
    path = tmp_path / "ck"
    ts.save_quantized({"a": torch.randn(1000)}, path, max_shard_size=1000)
    first = set(p.name for p in path.iterdir())
    ts.save_quantized({"b": torch.randn(10)}, path)
    second = set(p.name for p in path.iterdir())
    assert not (first - {"te_serial.msgpack"}) & second
    assert len(second) == 2 and list(ts.load_quantized(path)) == ["b"]


def test_manifest_records_producer_files_and_layout(tmp_path):
    path = tmp_path / "ck"
    ts.save_quantized({"w": ts.NVFP4Quantizer()(torch.randn(32, 32)), "b": torch.zeros(2),
                       "w2": ts.NVFP4Quantizer()(torch.randn(32, 32))}, path)
    doc = unpack((path / "te_serial.msgpack").read_bytes())
    assert doc["format"] == "te-serial" and tuple(doc["version"]) == ts.checkpoint.VERSION
    assert doc["producer"]["te_serial"] == ts.__version__ and doc["producer"]["torch"]
    [f] = doc["files"]
    assert (path / f["name"]).stat().st_size == f["size"]
    assert doc["quantizers"] == [ts.NVFP4Quantizer().to_dict()]
    cols = doc["tensors"]
    assert cols["names"] == ["w", "b", "w2"] and cols["protos"] == [0, 1, 0]  # w and w2 share a prototype
    w = doc["protos"][0]
    assert w["storage"] == "NVFP4Tensor" and w["scale_layout"] == "compact" and w["quantizer"] == 0
    assert [b["name"] for b in w["buffers"]] == list(ts.NVFP4Quantizer().describe_buffers((32, 32)))
    assert {b["name"]: b["dtype"] for b in w["buffers"]}["_rowwise_scale_inv"] == "float8_e4m3fn"
    assert doc["protos"][1]["quantizer"] is None and [b["name"] for b in doc["protos"][1]["buffers"]] == ["data"]
    assert len(cols["checksums"][0]) == 6 and all(isinstance(c, int) for c in cols["checksums"][0])
    assert "tree" not in doc  # a flat state dict needs no tree
    json.dumps(doc)  # the manifest is JSON-compatible when it has no tree


def test_no_checksums_option_and_verify_refuses(tmp_path):
    path = tmp_path / "n.safetensors"
    ts.save_quantized({"a": torch.ones(3)}, path, checksums=False)
    assert torch.equal(ts.load_quantized(path)["a"], torch.ones(3))
    with pytest.raises(tse.ChecksumError, match="without checksums"):
        ts.verify(path)


@pytest.mark.parametrize("bad", [{"x": object()}, {"x": torch.float32}, {1.5: torch.ones(1)},
                                 {"x": {"y": lambda: 0}}, [torch.ones(1)]])
def test_unsupported_values_are_refused_with_their_path(tmp_path, bad):
    with pytest.raises(tse.UnsupportedValueError):
        ts.save_quantized(bad, tmp_path / "u")
    assert not (tmp_path / "u" / "te_serial.msgpack").exists()


def test_name_collisions_and_bad_options(tmp_path):
    with pytest.raises(tse.UnsupportedValueError, match="a.b"):
        ts.save_quantized({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "c")
    with pytest.raises(ts.CheckpointError, match="max_shard_size"):
        ts.save_quantized({"a": torch.ones(1)}, tmp_path / "c", max_shard_size="lots")
    with pytest.raises(tse.UnsupportedValueError, match="metadata"):
        ts.save_quantized({"a": torch.ones(1)}, tmp_path / "c", metadata={"k": 1})
    assert ts.checkpoint.parse_size("5GB") == 5 * 10**9 and ts.checkpoint.parse_size("2MiB") == 2 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_straight_to_cuda(tmp_path):
    sd = _quantized_state()
    sd["big"] = torch.randn(40 << 20 >> 2)  # larger than one staging chunk
    path = tmp_path / "ck"
    ts.save_quantized(sd, path)
    out = ts.load_quantized(path, device="cuda")
    for k in sd:
        assert out[k].device.type == "cuda"
        assert_same_tensor(out[k].cpu(), sd[k], k)


def test_streaming_writer_writes_planned_shards_and_commits_at_close(tmp_path):
    from te_serial.checkpoint import CheckpointWriter
    path = tmp_path / "s"
    ts.save_quantized({"old": torch.ones(3)}, path)
    tensors = {f"w{i}": ts.MXFP8Quantizer(columnwise=False)(torch.randn(64, 64)) for i in range(5)}
    protos = {n: ts.to_tensor_proto(t) for n, t in tensors.items()}
    with CheckpointWriter(path, protos, max_shard_size=8000) as w:
        for name in reversed(list(tensors)):  # any order: every buffer has its place already
            w.write(name, tensors[name])
        # shards already on disk under temporary names, yet the old checkpoint is what loads
        assert len(list(path.glob(".te_serial-tmp-*"))) >= 2
        assert list(ts.load_quantized(path)) == ["old"]
        with pytest.raises(tse.UnsupportedValueError, match="written twice"):
            w.write("w0", tensors["w0"])
        with pytest.raises(tse.UnsupportedValueError, match="not in the writer's plan"):
            w.write("other", tensors["w0"])
    out = ts.load_quantized(path, verify=True)
    assert list(out) == list(tensors)
    for k in tensors:
        assert_same_tensor(out[k], tensors[k], k)
    assert not list(path.glob(".te_serial-tmp-*")) and len(list(path.glob("*.safetensors"))) == len(w.manifest.files)


@pytest.mark.parametrize("single", [False, True])
def test_writer_streams_a_grouped_tensor_a_range_of_members_at_a_time(tmp_path, single):
    """``write_members`` writes an expert stack in ranges, in order: the same file bytes and checksums as
    ``write`` of the whole; a range out of order, past the end or in another format is refused, and a
    stack left part-written is never committed."""
    from te_serial.checkpoint import CheckpointWriter
    from te_serial.formats.grouped import GroupedTensor
    stack = GroupedTensor.from_members([ts.MXFP8Quantizer(columnwise=False)(torch.randn(64, 64) * (i + 1))
                                        for i in range(5)])
    plain = torch.randn(7)
    protos = {"w": ts.to_tensor_proto(stack), "b": ts.to_tensor_proto(plain)}
    name = "ck.safetensors" if single else "ck"
    with CheckpointWriter(tmp_path / "whole" / name, protos) as w:
        w.write("w", stack)
        w.write("b", plain)
    with CheckpointWriter(tmp_path / "parts" / name, protos) as w:
        for a, b in ((0, 2), (2, 3), (3, 5)):
            w.write_members("w", stack.member_range(a, b))
        w.write("b", plain)
    with ts.open(tmp_path / "whole" / name) as x, ts.open(tmp_path / "parts" / name) as y:
        for n in protos:
            assert x.manifest.tensors[n].proto == y.manifest.tensors[n].proto
            assert [e.checksum for e in x.manifest.tensors[n].buffers.values()] == \
                [e.checksum for e in y.manifest.tensors[n].buffers.values()]
    out = ts.load_quantized(tmp_path / "parts" / name, verify=True)
    assert_same_tensor(out["w"], stack, "w")
    other = GroupedTensor.from_members([ts.MXFP8Quantizer(columnwise=True)(torch.randn(64, 64)) for _ in range(2)])
    with pytest.raises(tse.CheckpointError, match="never written"):
        with CheckpointWriter(tmp_path / "bad", protos) as w:
            w.write_members("w", stack.member_range(0, 2))
            with pytest.raises(tse.UnsupportedValueError, match="do not match"):
                w.write_members("w", other)                     # another format
            with pytest.raises(tse.UnsupportedValueError, match="members 2.."):
                w.write_members("w", stack.member_range(0, 4))  # past the end
            with pytest.raises(tse.UnsupportedValueError, match="expected members 0.."):
                w.write_members("b", plain)                     # not a grouped tensor
            w.write("b", plain)
    assert not (tmp_path / "bad" / "te_serial.msgpack").exists() and not list((tmp_path / "bad").iterdir())


def test_shard_parts_come_in_order(tmp_path):
    from te_serial.checkpoint.shards import ShardSet
    files = ShardSet(tmp_path, [("k", (8,), torch.uint8)], limit=1 << 20, shard_name=lambda i, n: "x.safetensors")
    files.write_part("k", torch.arange(3, dtype=torch.uint8), 0, with_checksum=True)
    with pytest.raises(tse.CheckpointError, match="parts come in order"):
        files.write_part("k", torch.arange(3, dtype=torch.uint8), 4, with_checksum=True)
    with pytest.raises(tse.CheckpointError, match="hashed all or none"):
        files.write_part("k", torch.arange(3, dtype=torch.uint8), 3)
    import xxhash
    assert files.write_part("k", torch.arange(5, dtype=torch.uint8), 3, with_checksum=True) == \
        xxhash.xxh3_64_intdigest(bytes([0, 1, 2, 0, 1, 2, 3, 4]))
    files.abort()


def test_writer_refuses_a_tensor_unlike_its_prototype_and_an_unwritten_plan(tmp_path):
    from te_serial.checkpoint import CheckpointWriter
    protos = {"a": ts.to_tensor_proto(torch.zeros(4)), "b": ts.to_tensor_proto(torch.zeros(2))}
    with pytest.raises(tse.UnsupportedValueError, match="planned prototype"):
        with CheckpointWriter(tmp_path / "x", protos) as w:
            w.write("a", torch.zeros(5))
    with pytest.raises(ts.CheckpointError, match="never written"):
        with CheckpointWriter(tmp_path / "y", protos) as w:
            w.write("a", torch.zeros(4))
    assert not (tmp_path / "y" / "te_serial.msgpack").exists()
    assert not [p for p in (tmp_path / "y").iterdir()]


def test_streaming_writer_aborts_on_error_and_keeps_the_old_checkpoint(tmp_path):
    from te_serial.checkpoint import CheckpointWriter
    path = tmp_path / "s"
    ts.save_quantized({"old": torch.arange(4)}, path)
    before = sorted(p.name for p in path.iterdir())
    protos = {n: ts.to_tensor_proto(torch.randn(100)) for n in ("a", "b")}
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(path, protos, max_shard_size=100) as w:
            w.write("a", torch.randn(100))
            w.write("b", torch.randn(100))
            raise RuntimeError("boom")
    assert sorted(p.name for p in path.iterdir()) == before
    assert torch.equal(ts.load_quantized(path)["old"], torch.arange(4))


def _odd_state():
    """Buffers of odd sizes at odd offsets: every one has partial first and last blocks."""
    g = torch.Generator().manual_seed(7)
    sd = {f"w{i}": ts.MXFP8Quantizer()(torch.randn(64 * (i + 3), 96, generator=g)) for i in range(3)}
    sd.update({"odd": torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=g),
               "f32": torch.randn(3001, generator=g), "scalar": torch.tensor(1.5)})
    return sd


def test_direct_io_writes_whole_blocks_and_buffers_the_edges(tmp_path, monkeypatch):
    """Large files write each buffer's whole blocks with O_DIRECT and its partial edge blocks through
    the page cache: the file is byte for byte what a buffered save writes."""
    from te_serial.checkpoint import direct_io, shards
    sd = _odd_state()
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "0")
    ts.save_quantized(sd, tmp_path / "buffered.safetensors")
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "1")
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)
    calls = []
    real = shards._DirectBlocks.write
    monkeypatch.setattr(shards._DirectBlocks, "write", lambda self, v, o: calls.append(real(self, v, o)) or calls[-1])
    try:
        probe = shards._DirectBlocks(tmp_path / "buffered.safetensors")
        probe.close()
        direct_here = True
    except OSError:
        direct_here = False  # a file system without O_DIRECT (tmpfs): the fallback is what runs
    ts.save_quantized(sd, tmp_path / "direct.safetensors")
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    assert bool(calls and sum(calls)) == direct_here  # whole blocks went direct where the file system allows
    out = ts.load_quantized(tmp_path / "direct.safetensors", verify=True)
    for k in sd:
        assert_same_tensor(out[k], sd[k], k)


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    from te_serial.checkpoint import direct_io, shards
    sd = _odd_state()
    ts.save_quantized(sd, tmp_path / "ref.safetensors")
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "1")
    monkeypatch.setattr(shards, "DIRECT_MIN_BYTES", 0)

    def refuse(self, view, offset):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(shards._DirectBlocks, "write", refuse)
    ts.save_quantized(sd, tmp_path / "fallback.safetensors")
    assert (tmp_path / "fallback.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_a_file_system_that_cannot_map_streams_read_bytes(tmp_path, monkeypatch):
    """Checkpoint.stream on a file system without mmap (some network and FUSE mounts) reads the
    buffers instead: the same tensor, still checked."""
    import mmap as mmap_module
    sd = {"w": ts.MXFP8Quantizer()(torch.randn(64, 64)), "b": torch.randn(100)}
    ts.save_quantized(sd, tmp_path / "m.safetensors")

    def no_mmap(*a, **k):
        raise OSError(19, "No such device")
    monkeypatch.setattr(mmap_module, "mmap", no_mmap)
    with ts.Checkpoint(tmp_path / "m.safetensors") as ck:
        for name in sd:
            t, check = ck.stream(name)
            assert_same_tensor(t, sd[name], name)
            check()
