"""Opening reads the manifest only; each shard's header is checked in full at its first read.

- ``Checkpoint.protos`` / ``.metadata`` are read-only views, the same object on every access, and
  a lookup builds nothing;
- a corrupt header in one shard of many is refused at the first read of that shard (and by
  ``verify``), not at open;
- the column-at-a-time header check accepts exactly what the entry-by-entry check accepts, with
  the same entries, on valid and damaged headers alike;
- zero-size dimensions round-trip;
- a shard whose header is byte for byte the one te-serial's writer plans from the manifest (up to
  the spaces that pad it) is taken without a parse; any other valid header (another writer's
  formatting) is parsed and checked as before, and loads to the same tensors;
- a single file goes the same way: te-serial's own opens from the manifest at its header's start
  (no parse, no per-file index) and is compared at its first read; another writer's formatting is
  parsed at open, te-serial's metadata over other entries at the first read; a tampered or damaged
  one is refused with te-serial's error.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

import te_serial as ts
from te_serial.checkpoint import files
from te_serial.checkpoint import header as st_header
from te_serial.checkpoint.manifest import HEADER_KEY
from te_serial.errors import CheckpointFileError, ManifestError, TeSerialError, TensorMismatchError

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
    fast = st_header._entries_checked_by_columns(dict(header), data_len)
    try:
        slow = st_header._entries_checked_one_by_one(dict(header), data_len, fail)
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
    planned = st_header.planned_header(items, meta)
    by_width = sorted(items, key=lambda it: -it[2].itemsize)
    entries, at = {}, 0
    for key, shape, dtype in by_width:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        entries[key] = {"dtype": st_header.safetensors_code(dtype), "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    want = json.dumps(_header_of(entries, meta), separators=(",", ":")).encode()
    assert planned.raw.rstrip(b" ") == want and len(planned.raw) % 8 == 0 and planned.data_bytes == at
    assert {k: (e.dtype, e.shape, e.start, e.end) for k, e in planned.entries.items()} == \
        {k: (st_header.dtype_from_code(v["dtype"]), tuple(v["shape"]), *v["data_offsets"]) for k, v in entries.items()}


def test_a_repeated_key_has_no_planned_header():
    assert st_header.planned_header([("a", (2,), torch.float32), ("a", (2,), torch.float32)], None) is None


def test_a_shard_as_planned_skips_the_parse_and_another_valid_header_is_parsed(tmp_path, monkeypatch):
    sd = _many(tmp_path / "c", n=20, shard="1GB")
    shard = _shards(tmp_path / "c")[0]
    parsed = []
    real = st_header._read_header
    monkeypatch.setattr(st_header, "_read_header", lambda *a: parsed.append(a[1]) or real(*a))
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


# --- a single file: the same compare-not-parse path ------------------------------------------------

def _split(path):
    """(header JSON, data section) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[8:8 + n], raw[8 + n:]


def _rewrite(path, text: bytes, data: bytes, *, room: int | None = None):
    """A new file at ``path`` (the old one unlinked: open handles keep theirs) with this header's
    JSON, space-padded to ``room`` bytes if given (else to a multiple of 8), and this data."""
    size = room if room is not None else len(text) + (-len(text) % 8)
    assert len(text) <= size
    path.unlink()
    path.write_bytes(struct.pack("<Q", size) + text + b" " * (size - len(text)) + data)


def _count_parses_and_indexes(monkeypatch):
    """Paths whose header got the full parse, and how often the manifest's per-file index was built."""
    parsed, indexed = [], []
    real_parse = st_header._read_header
    monkeypatch.setattr(st_header, "_read_header", lambda *a: parsed.append(a[1]) or real_parse(*a))
    from te_serial.checkpoint.manifest import Manifest
    real_index = Manifest.buffers_by_file
    monkeypatch.setattr(Manifest, "buffers_by_file", lambda self: indexed.append(1) or real_index(self))
    return parsed, indexed


def test_a_single_file_as_written_opens_without_a_parse_and_reads_as_planned(tmp_path, monkeypatch):
    """te-serial's own single file: the manifest is taken from the header's start, no header is
    parsed and no per-file index is built at open (every prototype built); the first read compares
    the header with the planned one instead of parsing it."""
    from te_serial.checkpoint.manifest import SELF_FILE
    path = tmp_path / "one.safetensors"
    sd = _many(path, n=30)
    parsed, indexed = _count_parses_and_indexes(monkeypatch)
    with ts.open(path) as ckpt:
        built = [ckpt.protos[name] for name in ckpt.protos]
        assert [(p.shape, p.dtype, p.quantizer) for p in built] == \
            [(tuple(t.shape), t.dtype, getattr(t, "quantizer", None)) for t in sd.values()]
        assert parsed == [] and indexed == []  # open and every prototype: the manifest alone
        for name, t in ckpt.load_tensors().items():
            assert_same_tensor(t, sd[name], name)
        assert parsed == [] and ckpt._files[SELF_FILE].as_planned  # compared, not parsed
    assert ts.verify(path) == sum(len(t.buffers()) if hasattr(t, "buffers") else 1 for t in sd.values())
    assert parsed == []


def test_a_single_file_in_another_formatting_is_parsed_and_checked_at_open(tmp_path, monkeypatch):
    """The same header as another writer formats it (spaces, the metadata last): its manifest is
    found by the full parse, at open, and the file loads the same tensors."""
    path = tmp_path / "one.safetensors"
    sd = _many(path, n=30)
    text, data = _split(path)
    header = json.loads(text)
    meta = header.pop("__metadata__")
    _rewrite(path, json.dumps({**dict(reversed(list(header.items()))), "__metadata__": meta}).encode(), data)
    parsed, _ = _count_parses_and_indexes(monkeypatch)
    with ts.open(path) as ckpt:
        assert parsed == [str(path)]
        for name, t in ckpt.load_tensors().items():
            assert_same_tensor(t, sd[name], name)
        assert parsed == [str(path)] and not ckpt._files[""].as_planned


def test_a_single_file_with_te_serials_metadata_but_other_entries_is_parsed_at_its_first_read(tmp_path, monkeypatch):
    """The metadata first, as te-serial writes it, but the entries in another order and the header
    in another room: opened without a parse, parsed and checked at the first read, the same tensors."""
    path = tmp_path / "one.safetensors"
    sd = _many(path, n=30)
    text, data = _split(path)
    header = json.loads(text)
    meta = header.pop("__metadata__")
    compact = json.dumps({"__metadata__": meta, **dict(reversed(list(header.items())))},
                         separators=(",", ":")).encode()
    _rewrite(path, compact, data, room=len(compact) + 40 + (-len(compact) % 8))
    parsed, _ = _count_parses_and_indexes(monkeypatch)
    with ts.open(path) as ckpt:
        assert parsed == []
        for name, t in ckpt.load_tensors().items():
            assert_same_tensor(t, sd[name], name)
        assert parsed == [str(path)] and not ckpt._files[""].as_planned


def _tampered_entry(path) -> str:
    """A te-serial single file with one MXFP8 data entry's shape transposed in place: the same bytes
    and header length, a valid header, but not the manifest's shape. Returns the entry's key."""
    text, data = _split(path)
    key = next(k for k in json.loads(text) if k.endswith("._rowwise_data"))
    at = text.index(json.dumps(key).encode())
    old = b'"shape":[32,64]'
    pos = text.index(old, at)
    _rewrite(path, text[:pos] + b'"shape":[64,32]' + text[pos + len(old):], data, room=len(text))
    return key


def test_a_tampered_single_file_is_refused_at_its_first_read(tmp_path):
    path = tmp_path / "one.safetensors"
    _many(path, n=30)
    key = _tampered_entry(path)
    ckpt = ts.open(path)  # the manifest only: opens
    with pytest.raises(TensorMismatchError) as e:
        ckpt.get(key.rsplit(".", 1)[0])
    assert str(path) in str(e.value) and "_rowwise_data" in str(e.value)
    ckpt.close()
    for refused in (lambda: ts.load_quantized(path), lambda: ts.verify(path)):
        with pytest.raises(TensorMismatchError):
            refused()


@pytest.mark.parametrize("damage", ["duplicate-metadata", "appended-bytes", "other-manifest", "not-base64"])
def test_other_damage_to_a_single_file_is_refused(tmp_path, damage):
    """A header that begins as te-serial writes it but holds a second ``__metadata__``; a file with
    bytes beyond its entries (its size does not add up: parsed at open); the manifest of another
    checkpoint; a manifest that is not base64 — each refused with te-serial's error."""
    path = tmp_path / "one.safetensors"
    _many(path, n=30)
    text, data = _split(path)
    at_open = damage != "duplicate-metadata"
    if damage == "duplicate-metadata":
        body = text.rstrip(b" ")
        _rewrite(path, body[:-1] + b',"__metadata__":{"format":"pt"}}', data, room=len(text))
        error = CheckpointFileError
    elif damage == "appended-bytes":
        _rewrite(path, text, data + b"\0" * 8, room=len(text))
        error = CheckpointFileError
    elif damage == "other-manifest":
        other = tmp_path / "other.safetensors"
        ts.save_quantized({"layers.1.w": torch.zeros(64, 64)}, other)
        value = json.loads(_split(other)[0])["__metadata__"][HEADER_KEY].encode()
        start = text.index(b'":"') + 3
        end = text.index(b'"', start)
        _rewrite(path, text[:start] + value + text[end:], data)
        error = TensorMismatchError
    else:
        start = text.index(b'":"') + 3
        _rewrite(path, text[:start] + b"!" + text[start + 1:], data, room=len(text))
        error = ManifestError
    if at_open:
        with pytest.raises(error) as e:
            ts.open(path)
    else:
        ckpt = ts.open(path)
        with pytest.raises(error) as e:
            ckpt.load_tensors()
        ckpt.close()
    assert str(path) in str(e.value)
    with pytest.raises(error):
        ts.verify(path)


def test_verify_checks_a_single_files_header_even_without_buffers(tmp_path):
    """A checkpoint with no tensor reads no buffer; ``verify`` still checks its header whole."""
    path = tmp_path / "empty.safetensors"
    ts.save_quantized({"step": 3}, path)
    text, data = _split(path)
    body = text.rstrip(b" ")
    _rewrite(path, body[:-1] + b',"x":1}', data, room=len(text))
    assert ts.load_quantized(path) == {"step": 3}  # nothing read from the file
    with pytest.raises(CheckpointFileError) as e:
        ts.verify(path)
    assert str(path) in str(e.value)


_VALUES = ["", "abc+/=", "a b", 'q"uote', "back\\slash", "tab\t", "ünï", "\x7f", "x" * 300]


@pytest.mark.parametrize("value", _VALUES)
@pytest.mark.parametrize("key", [HEADER_KEY, 'k"ey', "ké"])
def test_the_leading_metadata_is_what_a_parse_gives_or_none(key, value):
    """Read without a parse only where the header begins as te-serial writes it, the value plain
    printable ASCII; then it is the value the parse gives."""
    entries, _ = _valid_entries(random.Random(len(value)), 3)
    planned = st_header.planned_header([(k, tuple(e["shape"]), st_header.dtype_from_code(e["dtype"]))
                                    for k, e in entries.items()], {key: value})
    got = st_header.leading_metadata(planned.raw, key)
    plain = all(0x20 <= ord(c) < 0x7F for c in value) and '"' not in value and "\\" not in value
    assert got == (value if plain else None)
    assert json.loads(planned.raw)["__metadata__"][key] == value
    others = [json.dumps({"__metadata__": {key: value}}).encode(),              # spaces
              b" " + planned.raw,                                            # leading space
              json.dumps({"__metadata__": {key: value, "b": "c"}}, separators=(",", ":")).encode(),
              json.dumps({"a": 1, "__metadata__": {key: value}}, separators=(",", ":")).encode()]
    assert [st_header.leading_metadata(raw, key) for raw in others] == [None] * 4


def test_a_planned_header_padded_with_spaces_is_compared_and_any_other_byte_parsed(tmp_path, monkeypatch):
    items = [("a", (2, 3), torch.float32), ("b", (5,), torch.bfloat16)]
    planned = st_header.planned_header(items, {"k": "v"})
    data = bytes(range(34))
    parsed = []
    real = st_header._read_header
    monkeypatch.setattr(st_header, "_read_header", lambda *a: parsed.append(a[1]) or real(*a))
    for pad, as_planned in ((b"", True), (b" " * 16, True), (b"\t" + b" " * 7, False), (b"\n" * 8, False)):
        p = tmp_path / f"f{len(parsed)}{as_planned}.safetensors"
        raw = planned.raw + pad
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        with files.SafetensorsFile(p, expected=planned) as f:
            assert f.as_planned == as_planned and f.entries == planned.entries
            got = f.read("a").view(torch.uint8).reshape(-1)
            assert torch.equal(got, torch.arange(24, dtype=torch.uint8))
    assert len(parsed) == 2
