"""Opening reads the manifest only; each shard's header is checked in full at its first read.

- ``Checkpoint.protos`` / ``.metadata`` are read-only views, the same object on every access, and
  a lookup builds nothing;
- a corrupt header in one shard of many is refused at the first read of that shard (and by
  ``verify``), not at open;
- the column-at-a-time header check accepts exactly what the entry-by-entry check accepts, with
  the same entries, on valid and damaged headers alike;
- zero-size dimensions round-trip;
- a shard whose header is byte for byte the one te-serial's writer plans from the manifest is
  taken without a parse; any other valid header (another writer's formatting) is parsed and
  checked as before, and loads to the same tensors.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

import te_serial as ts
from te_serial.checkpoint import files
from te_serial.errors import CheckpointFileError, TeSerialError

from helpers import assert_same_tensor


def _many(path, n=60, shard="8KB"):
    g = torch.Generator().manual_seed(1)
    q = ts.MXFP8Quantizer()
    sd = {f"layers.{i}.w": (q(torch.randn(32, 64, generator=g)) if i % 2 else torch.randn(40, generator=g))
          for i in range(n)}
    ts.save_quantized(sd, path, max_shard_size=shard)
    return sd


def test_protos_and_metadata_are_views_built_once(tmp_path, monkeypatch):
    _many(tmp_path / "c")
    ckpt = ts.open(tmp_path / "c")
    assert ckpt.protos is ckpt.protos and ckpt.metadata is ckpt.metadata
    with pytest.raises(TypeError):
        ckpt.protos["x"] = None
    with pytest.raises(TypeError):
        ckpt.metadata["x"] = "y"
    made = []
    real = ts.TensorProto.__init__
    monkeypatch.setattr(ts.TensorProto, "__init__", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    for name in list(ckpt.protos) * 3:
        assert ckpt.protos[name].shape
    assert made == []  # lookups read the manifest's columns: no prototype is built
    assert dict(ckpt.protos) == ts.read_protos(tmp_path / "c")


def _shards(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


def _corrupt_header(shard):
    """Change one entry's shape in the header (same length, so the file stays the listed size)."""
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].decode()
    key = next(k for k in json.loads(header) if k != "__metadata__")
    entry = json.loads(header)[key]
    old = json.dumps(entry["shape"], separators=(",", ":"))
    new = old.replace("3", "2", 1) if "3" in old else old.replace("4", "5", 1)
    assert new != old and len(new) == len(old)
    at = header.index(old, header.index(json.dumps(key)))
    raw[8 + at:8 + at + len(old)] = new.encode()
    shard.write_bytes(bytes(raw))
    return key


def test_a_corrupt_header_in_the_seventh_shard_is_refused_at_its_first_read(tmp_path):
    sd = _many(tmp_path / "c")
    shards = _shards(tmp_path / "c")
    assert len(shards) >= 8
    key = _corrupt_header(shards[6])
    ckpt = ts.open(tmp_path / "c")  # the manifest only: opens
    in_seventh, elsewhere = [], []
    for name in sd:
        (in_seventh if any(loc[1] == shards[6].name for loc in ckpt.manifest.locations(name)) else elsewhere).append(name)
    assert in_seventh and elsewhere
    for name in elsewhere:  # the other shards read as ever
        ckpt.get(name)
    with pytest.raises(CheckpointFileError) as e:
        ckpt.get(in_seventh[0])
    assert shards[6].name in str(e.value) and key in str(e.value)
    with pytest.raises(CheckpointFileError):
        ts.verify(tmp_path / "c")


def _header_of(entries: dict, meta=None) -> dict:
    out = {} if meta is None else {"__metadata__": meta}
    out.update(entries)
    return out


def _valid_entries(rng: random.Random, n: int) -> tuple[dict, int]:
    codes = ["F32", "BF16", "U8", "F8_E4M3", "I64"]
    sizes = {"F32": 4, "BF16": 2, "U8": 1, "F8_E4M3": 1, "I64": 8}
    entries, at = {}, 0
    for i in range(n):
        code = rng.choice(codes)
        shape = [rng.choice([0, 1, 2, 3, 7]) for _ in range(rng.randint(0, 3))]
        nbytes = sizes[code] * (0 if 0 in shape else int(torch.tensor(shape, dtype=torch.int64).prod()))
        entries[f"t{i}"] = {"dtype": code, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    return entries, at


_MUTATIONS = [
    lambda e, rng: e.update({"dtype": "F99"}),
    lambda e, rng: e.update({"dtype": 3}),
    lambda e, rng: e.update({"shape": [-1]}),
    lambda e, rng: e.update({"shape": [1.0] * len(e["shape"])}) if e["shape"] else e.update({"shape": [True]}),
    lambda e, rng: e.update({"shape": [1] * 65}),
    lambda e, rng: e.update({"shape": [10 ** 30, 0]}),
    lambda e, rng: e.update({"shape": "12"}),
    lambda e, rng: e.update({"data_offsets": [e["data_offsets"][0]]}),
    lambda e, rng: e.update({"data_offsets": [e["data_offsets"][0], e["data_offsets"][1] + 1]}),
    lambda e, rng: e.update({"data_offsets": [e["data_offsets"][0] - 1, e["data_offsets"][1] - 1]}),
    lambda e, rng: e.update({"data_offsets": [float(e["data_offsets"][0]), e["data_offsets"][1]]}),
    lambda e, rng: e.update({"extra": 1}),
    lambda e, rng: e.pop("shape"),
]


@pytest.mark.parametrize("seed", range(40))
def test_the_column_check_agrees_with_the_entry_by_entry_check(seed):
    rng = random.Random(seed)
    entries, data_len = _valid_entries(rng, rng.randint(0, 12))
    if entries and seed % 4:
        victim = entries[rng.choice(list(entries))]
        rng.choice(_MUTATIONS)(victim, rng)
    if seed % 7 == 3:
        data_len += 1  # a gap at the end
    header = json.loads(json.dumps(_header_of(entries)))

    def fail(message, field=None):
        raise CheckpointFileError(message, field=field)
    fast = files._entries_checked_by_columns(dict(header), data_len)
    try:
        slow = files._entries_checked_one_by_one(dict(header), data_len, fail)
    except CheckpointFileError:
        slow = None
    if fast is not None:  # whatever the column check accepts, the entry check accepts the same way
        assert slow == fast and list(slow) == list(fast)
    if slow is not None and all(max(e["shape"], default=0) <= data_len for e in header.values()):
        assert fast == slow  # and it misses nothing the entry check accepts (small dimensions)


def test_zero_size_dimensions_round_trip(tmp_path):
    sd = {"a": torch.zeros(3, 0), "b": torch.ones(2), "c": torch.zeros(0, 5, dtype=torch.bfloat16)}
    ts.save_quantized(sd, tmp_path / "z")
    out = ts.load_quantized(tmp_path / "z", verify=True)
    for k, v in sd.items():
        assert out[k].shape == v.shape and out[k].dtype == v.dtype and torch.equal(out[k], v)


def test_no_error_of_another_class_escapes_a_damaged_header(tmp_path):
    _many(tmp_path / "c", n=6, shard="1GB")
    shard = _shards(tmp_path / "c")[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    rng = random.Random(0)
    for _ in range(200):
        b = bytearray(raw)
        at = rng.randrange(8, 8 + n)
        b[at] = rng.randrange(256)
        shard.write_bytes(bytes(b))
        try:
            ts.load_quantized(tmp_path / "c")
        except TeSerialError:
            pass
    shard.write_bytes(raw)


_ODD_KEYS = ["plain", 'quo"te', "back\\slash", "tab\tnew\nline", "ünï\u2603", "\x00nul", "", "emoji\U0001F600"]


@pytest.mark.parametrize("seed", range(6))
def test_the_planned_header_is_what_json_dumps_gives(seed):
    """The writer's directly formatted entries are the JSON ``json.dumps`` writes for the same
    entries, laid out widest dtype first, whatever the keys hold."""
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.int64]
    items = [(rng.choice(_ODD_KEYS) + str(i), tuple(rng.choice([0, 1, 3, 32]) for _ in range(rng.randint(0, 3))),
              rng.choice(dtypes)) for i in range(rng.randint(0, 30))]
    meta = rng.choice([None, {"format": "pt"}, {"k\"ey": "välue"}])
    planned = files.planned_header(items, meta)
    by_width = sorted(items, key=lambda it: -it[2].itemsize)
    entries, at = {}, 0
    for key, shape, dtype in by_width:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        entries[key] = {"dtype": files.safetensors_code(dtype), "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    want = json.dumps(_header_of(entries, meta), separators=(",", ":")).encode()
    assert planned.raw.rstrip(b" ") == want and len(planned.raw) % 8 == 0 and planned.data_bytes == at
    assert {k: (e.dtype, e.shape, e.start, e.end) for k, e in planned.entries.items()} == \
        {k: (files.dtype_from_code(v["dtype"]), tuple(v["shape"]), *v["data_offsets"]) for k, v in entries.items()}


def test_a_repeated_key_has_no_planned_header():
    assert files.planned_header([("a", (2,), torch.float32), ("a", (2,), torch.float32)], None) is None


def test_a_shard_as_planned_skips_the_parse_and_another_valid_header_is_parsed(tmp_path, monkeypatch):
    sd = _many(tmp_path / "c", n=20, shard="1GB")
    shard = _shards(tmp_path / "c")[0]
    parsed = []
    real = files._read_header
    monkeypatch.setattr(files, "_read_header", lambda *a: parsed.append(a[1]) or real(*a))
    ckpt = ts.open(tmp_path / "c")
    for name, t in ckpt.load_tensors().items():
        assert_same_tensor(t, sd[name], name)
    assert parsed == [] and ckpt._files[shard.name].as_planned  # te-serial's own shard: compared, not parsed
    ckpt.close()
    # the same entries in another writer's formatting (spaces, another order): valid, and parsed
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    text = json.dumps(dict(reversed(list(header.items())))).encode()
    text += b" " * (-len(text) % 8)
    shard.unlink()  # a new file: the first handle's mappings keep the old one
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    # the manifest lists the file's size: the data is the same, the header longer
    from te_serial.checkpoint.manifest import MANIFEST_NAME, Manifest
    mpath = tmp_path / "c" / MANIFEST_NAME
    m = Manifest.from_bytes(mpath.read_bytes(), source="m")
    m.files[shard.name] = shard.stat().st_size
    mpath.write_bytes(m.to_bytes())
    again = ts.open(tmp_path / "c")
    for name, t in again.load_tensors().items():
        assert_same_tensor(t, sd[name], name)
    assert parsed == [str(shard)] and not again._files[shard.name].as_planned
