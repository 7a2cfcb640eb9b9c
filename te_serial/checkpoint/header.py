"""The safetensors header, both ways: :func:`read_header` is the one validator (every field is
type-checked before it is used, duplicate JSON keys are refused, entries must tile the data section
exactly, and the work is bounded by the header's size), and :func:`layout` / :func:`header_bytes`
the one rule for the files te-serial writes (widest dtypes first, packed)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import operator
import os
from typing import Callable, Iterator, Mapping, NamedTuple

import torch

from ..dtypes import dtype_from_code, safetensors_code
from ..errors import CheckpointFileError
from ..proto import addressable


#: safetensors' own limit on the header's JSON
MAX_HEADER_BYTES = 100 << 20

#: most dims a stored shape may have (safetensors has no limit; no tensor te-serial writes has more)
MAX_NDIM = 64

_ENTRY_FIELDS = frozenset(("dtype", "shape", "data_offsets"))

_json_string = json.encoder.encode_basestring_ascii  # as json.dumps quotes strings (ensure_ascii)

#: the ``__metadata__`` of every shard of a checkpoint directory (a single file holds its manifest there)
SHARD_METADATA = {"format": "pt"}

class Entry(NamedTuple):
    """One tensor of a safetensors file: its dtype, shape and byte range in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

class Header(NamedTuple):
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    size: int

def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out

@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic-GC pass inside: parsing or building many small objects at once would set one off
    (likelier the more objects the process holds), and it would cost more than the work itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """The cyclic GC leaves what the process held before alone inside (``gc.freeze``); what is made
    inside is collected as ever. A long run making thousands of small objects (a MoE's per-expert
    plans and reports) would otherwise set off full passes over the whole heap, 0.2 s each in a
    process that imported transformers. Nothing changes where the process froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")

def _is_int(v) -> bool:
    return type(v) is int  # noqa: E721 - bool and float are refused on purpose

def read_header(fd: int, path: str, size: int, expected: PlannedHeader | None = None) -> Header:
    """The checked header of the safetensors file open at ``fd`` (``size`` bytes long); see
    :func:`_read_header`, parsed with the cyclic GC paused (:func:`gc_paused`).

    ``expected``: the header te-serial's writer gives this file (:func:`planned_header`). A file
    whose header's JSON is those bytes followed by nothing but the spaces that pad a header (a
    single file's header is padded to the room its writer reserved), at the size they plan, has
    that header: the bytes are compared instead of parsed and checked (the same guarantees, a
    fraction of the work); any other file goes through the full parse, which names what differs."""
    if expected is not None and _is_planned(fd, size, expected):
        return Header(expected.entries, dict(expected.metadata), size - expected.data_bytes, size)
    with gc_paused():
        return _read_header(fd, path, size)

def _is_planned(fd: int, size: int, expected: PlannedHeader) -> bool:
    """Whether the file holds ``expected``'s header, space-padded, and its data section's size."""
    n = len(expected.raw)
    head = os.pread(fd, 8 + n, 0)
    room = int.from_bytes(head[:8], "little") if len(head) == 8 + n else -1
    if room < n or room > MAX_HEADER_BYTES or size != 8 + room + expected.data_bytes \
            or not head.startswith(expected.raw, 8):
        return False
    pad = os.pread(fd, room - n, 8 + n) if room > n else b""
    return len(pad) == room - n and not pad.strip(b" ")

def header_json(fd: int, path: str, size: int) -> bytes:
    """The JSON of the safetensors header of the file open at ``fd`` (``size`` bytes long), read in
    one piece: its length must fit the file and :data:`MAX_HEADER_BYTES` (else
    :class:`CheckpointFileError`), so what is read is bounded by both. Not yet parsed or checked."""
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
        raise CheckpointFileError(f"safetensors header length {n} does not fit the file ({size} bytes)", file=path)
    return _pread_exact(fd, n, 8, path)

def _read_header(fd: int, path: str, size: int) -> Header:
    """The checked header of the safetensors file open at ``fd`` (``size`` bytes long).

    Refused with :class:`CheckpointFileError` naming the file and the entry: a header length
    that does not fit, JSON that is invalid, deeper than Python parses, or has duplicate keys;
    ``__metadata__`` that is not string → string; an entry that is not exactly ``dtype`` (a code
    te-serial knows), ``shape`` (at most 64 non-negative ints) and ``data_offsets`` (two ints);
    byte ranges that do not match shape × dtype or do not tile the data section without gaps
    or overlaps.
    """
    def fail(message: str, field: str | None = None):
        raise CheckpointFileError(message, file=path, field=field)

    raw = header_json(fd, path, size)
    n = len(raw)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        fail(f"unreadable safetensors header: {type(e).__name__}: {e}")
    if not isinstance(header, dict):
        fail("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        fail("safetensors __metadata__ must map strings to strings", "__metadata__")
    data_len = size - 8 - n
    entries = _entries_checked_by_columns(header, data_len)
    if entries is None:  # a flaw somewhere (or an unusual form): the loop below names it
        entries = _entries_checked_one_by_one(header, data_len, fail)
    return Header(entries, meta, 8 + n, size)

_get_dtype, _get_shape, _get_offsets = (operator.itemgetter(k) for k in ("dtype", "shape", "data_offsets"))

_first, _second = operator.itemgetter(0), operator.itemgetter(1)

def _ints(values: list) -> bool:
    return not values or set(map(type, values)) == {int}

def _entries_checked_by_columns(header: dict, data_len: int) -> dict[str, Entry] | None:
    """The entries, when every check :func:`_entries_checked_one_by_one` makes passes, made a
    field at a time over all entries with C-level builtins; None where any fails (then the
    one-by-one loop finds and names the first flaw)."""
    values = list(header.values())
    if not values:
        return {} if data_len == 0 else None
    if set(map(type, values)) != {dict} or set(map(len, values)) != {len(_ENTRY_FIELDS)}:
        return None
    try:  # three keys each, and these three: exactly the fields
        codes, shapes, offsets = (list(map(get, values)) for get in (_get_dtype, _get_shape, _get_offsets))
    except KeyError:
        return None
    if set(map(type, codes)) != {str}:
        return None
    known = {code: dtype_from_code(code) for code in set(codes)}
    dtypes = list(map(known.__getitem__, codes))
    if None in known.values() or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    if max(map(len, shapes)) > MAX_NDIM or set(map(len, offsets)) != {2}:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if not _ints(dims) or (dims and (min(dims) < 0 or max(dims) > data_len)):  # products stay small
        return None
    if 0 in dims and not all(map(addressable, shapes, map(operator.attrgetter("itemsize"), dtypes))):
        return None
    starts, ends = list(map(_first, offsets)), list(map(_second, offsets))
    if not (_ints(starts) and _ints(ends)) or min(starts) < 0 or max(ends) > data_len:
        return None
    itemsize = {code: dt.itemsize for code, dt in known.items()}
    sizes = list(map(operator.mul, map(math.prod, shapes), map(itemsize.__getitem__, codes)))
    if list(map(operator.sub, ends, starts)) != sizes:  # sizes are >= 0, so start <= end too
        return None
    spans = sorted(zip(starts, ends))  # the data section tiled: no gaps, no overlaps
    if spans[0][0] != 0 or spans[-1][1] != data_len or \
            list(map(_first, spans[1:])) != list(map(_second, spans[:-1])):
        return None
    return dict(zip(header, map(tuple.__new__, itertools.repeat(Entry), zip(dtypes, map(tuple, shapes), starts, ends))))

def _entries_checked_one_by_one(header: dict, data_len: int, fail: Callable) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for key, info in header.items():
        if not isinstance(info, dict) or info.keys() != _ENTRY_FIELDS:
            fail("safetensors entry must have exactly dtype, shape and data_offsets", key)
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = dtype_from_code(code) if isinstance(code, str) else None
        if dtype is None:
            fail(f"safetensors entry has dtype {code!r}, which te-serial does not read", key)
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(s) and s >= 0 for s in shape)):
            fail("safetensors entry shape must be a list of at most 64 non-negative integers", key)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            fail("safetensors entry data_offsets must be two integers", key)
        if not addressable(shape, dtype.itemsize):
            fail(f"safetensors entry shape {shape} is larger than torch can lay out", key)
        start, end = offsets
        if not 0 <= start <= end <= data_len:
            fail(f"safetensors entry data_offsets {offsets} lie outside the {data_len}-byte data section", key)
        count = 0 if 0 in shape else 1
        for s in shape if count else ():  # bounded: stops once the count exceeds what the range holds
            count *= s
            if count * dtype.itemsize > end - start:
                break
        if count * dtype.itemsize != end - start:
            fail(f"safetensors entry holds {end - start} bytes but its shape {shape} and dtype {code} "
                 "need a different number", key)
        entries[key] = Entry(dtype, tuple(shape), start, end)
    end = 0  # as safetensors requires: buffers tile the data section, no gaps, no overlaps
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != end:
            fail("safetensors entry overlaps another or leaves a gap", key)
        end = e.end
    if end != data_len:
        fail(f"safetensors data section is {data_len} bytes but its entries cover {end}")
    return entries

def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise CheckpointFileError(f"file ends {n - got} bytes early", file=path)
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)

class Layout(NamedTuple):
    """Where each buffer of a file goes, and the header entries saying so (JSON text)."""

    entries: dict[str, Entry]
    entries_json: str
    data_bytes: int

def layout(items: list[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
    """The one layout rule for the files te-serial writes: the widest dtypes first (every buffer
    aligned to its item size), in the given order otherwise, packed. The entries' JSON is what
    ``json.dumps`` gives for them, formatted directly (a tenth of the time for 10,000 tensors)."""
    kinds: dict[tuple, tuple[int, str]] = {}  # (shape, dtype) → (bytes, the entry's JSON up to its offsets)
    for _, shape, dtype in items:
        if (shape, dtype) not in kinds:
            kinds[shape, dtype] = (math.prod(shape) * dtype.itemsize, f'{{"dtype":"{safetensors_code(dtype)}",'
                                   f'"shape":[{",".join(map(str, shape))}],"data_offsets":[')
    ordered = sorted(items, key=lambda item: -item[2].itemsize)  # a stable sort
    sizes = [kinds[shape, dtype][0] for _, shape, dtype in ordered]
    ends = list(itertools.accumulate(sizes))
    starts = [0, *ends[:-1]]
    entries = {key: Entry(dtype, tuple(shape), start, end)
               for (key, shape, dtype), start, end in zip(ordered, starts, ends)}
    text = ",".join([f"{_json_string(key)}:{kinds[shape, dtype][1]}{start},{end}]}}"
                     for (key, shape, dtype), start, end in zip(ordered, starts, ends)])
    return Layout(entries, text, ends[-1] if ends else 0)

def _metadata_json(metadata: Mapping[str, str]) -> str:
    """The ``__metadata__`` member of a header te-serial writes (compact ``json.dumps``)."""
    return '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"))

def header_bytes(planned: Layout, metadata: Mapping[str, str] | None, pad_to: int = 0) -> bytes:
    """A safetensors header (JSON, space-padded so the data starts 8-aligned, at least ``pad_to`` long)."""
    head = "" if metadata is None else _metadata_json(metadata)
    raw = ("{" + ",".join(p for p in (head, planned.entries_json) if p) + "}").encode("utf-8")
    size = max(len(raw), pad_to)
    size += (-size) % 8
    return raw + b" " * (size - len(raw))

class PlannedHeader(NamedTuple):
    """The header the writer gives a file of these buffers: its bytes and what they parse to."""

    raw: bytes
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_bytes: int

def planned_header(items: list[tuple[str, tuple[int, ...], torch.dtype]],
                   metadata: Mapping[str, str] | None) -> PlannedHeader | None:
    """The header :class:`ShardSet` writes for ``items`` (key, shape, dtype) and ``metadata``. A file
    whose header is these exact bytes needs no parse and no check (:func:`read_header`). None where
    a key repeats: no writer plans that, and the parse refuses it."""
    with gc_paused():
        planned = layout(items)
    if len(planned.entries) != len(items):
        return None
    return PlannedHeader(header_bytes(planned, metadata), planned.entries, dict(metadata or {}), planned.data_bytes)

#: the characters a JSON string holds as they are, in ``json.dumps``' ASCII output (no escape)
_JSON_PLAIN = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')

def leading_metadata(raw: bytes, key: str) -> str | None:
    """``__metadata__[key]`` of a header whose JSON ``raw`` begins as :func:`header_bytes` writes a
    header whose metadata is that one key — ``{"__metadata__":{"<key>":"<value>"}`` then ``,`` or
    ``}`` — with a value of plain printable ASCII (no escape): read without a parse (a single
    file's manifest, before its header is checked; the value's own size bounds the work). Where
    the whole header is valid, this is the value its parse gives (a duplicate ``__metadata__``
    later on is refused by that parse). None where the header begins otherwise: parse it."""
    member = _metadata_json({key: ""}).encode("ascii")  # "__metadata__":{"<key>":""}
    start = 1 + len(member) - 2
    if not raw.startswith(b"{" + member[:-2]):
        return None
    end = raw.find(b'"', start)
    if end < 0 or raw[end + 1:end + 2] != b"}" or raw[end + 2:end + 3] not in (b",", b"}"):
        return None
    value = raw[start:end]
    return None if value.translate(None, _JSON_PLAIN) else value.decode("ascii")
