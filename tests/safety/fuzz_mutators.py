"""Structure-aware mutations for the fuzz targets (used by ``fuzz_driver.py``).

Byte-level mutation rarely gets past a JSON or msgpack parser with something the parser accepts
but te-serial should refuse (a shape of strings, float offsets, duplicate keys, an extension type
deep inside a field). These mutators decode the input (safetensors JSON header, msgpack
manifest, or both inside a single file), change one node of the decoded tree to a hostile value,
drop or duplicate a key, and encode it again. Only the standard library and msgpack are used, so
the driver's instrumentation is spent on te-serial.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import struct

import msgpack
import xxhash

HEADER_KEY = "te_serial.manifest"  # key of the base64 manifest in a single file's __metadata__
#: a manifest's last field (format 1.1): XXH3-64 of every byte before its 8-byte big-endian value
MANIFEST_CHECKSUM = "manifest_checksum"

BIG = [2**31, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1, 0]
HOSTILE_JSON = [*BIG, 1.5, 0.0, -0.0, 1e308, True, False, None, "", "x", "0", "F8_E4M3", "PICKLE",
                [], {}, [0], [[0], 2**40], ["x", 1200000000], [1, "0", 2**62], [1.0, 2.0], [True, 3],
                [0, 2**64 - 1], [[[[[]]]]], {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}]


class Pairs(list):
    """A map written as its (key, value) pairs, so a key can occur twice."""


def _hostile_msgpack(rng: random.Random):
    pick = rng.randrange(8)
    if pick == 0:  # msgpack's timestamp extension (-1), in range or with huge seconds
        return msgpack.Timestamp(rng.choice([1, 2**32 + 1]), 0)
    if pick == 1:
        return msgpack.Timestamp(rng.choice([2**62, -(2**62), 2**63 - 1]), rng.choice([0, 999_999_999]))
    if pick == 2:
        inner = msgpack.packb([None])
        for _ in range(rng.randrange(1, 80)):
            inner = msgpack.packb([msgpack.ExtType(2, inner)])
        return msgpack.ExtType(2, inner)  # tuples nested deep
    if pick == 3:
        return msgpack.ExtType(rng.choice([1, 2, 3, 42, 127]), rng.choice([b"", b"\xff", b"w_mx", b"\x91\xc0"]))
    if pick == 4:
        return rng.choice([b"", b"\x80\x02cos\nsystem\n", b"\x00" * 64])
    if pick == 5:
        return {rng.choice([1, 1.5, None, True, b"k", "k"]): rng.choice([0, None, []])}
    return copy.deepcopy(rng.choice(HOSTILE_JSON))


def _nodes(obj, path=()):
    """Every (path, value) in a decoded JSON/msgpack tree, containers first."""
    yield path, obj
    if isinstance(obj, Pairs):  # already mutated: a leaf from here on
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, path + (i,))


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def mutate_tree(obj, rng: random.Random, hostile) -> object:
    """One structural edit of ``obj`` (a decoded tree; changed in place where it can be)."""
    nodes = list(_nodes(obj))
    path, node = rng.choice(nodes)
    op = rng.randrange(7)
    if not path:
        if isinstance(obj, dict) and obj and op < 3:
            k = rng.choice(list(obj))
            pairs = Pairs(obj.items())
            pairs.append((k, hostile(rng)))  # a duplicate key, the later value hostile
            return pairs
        return hostile(rng) if op == 6 else obj
    parent = _get(obj, path[:-1])
    key = path[-1]
    if op <= 2:  # replace with a hostile value
        parent[key] = hostile(rng)
    elif op == 3 and isinstance(parent, dict):  # drop the key
        del parent[key]
    elif op == 3 and isinstance(parent, list):
        del parent[key]
    elif op == 4 and isinstance(parent, dict):  # duplicate the key
        pairs = Pairs(parent.items())
        pairs.append((key, rng.choice([parent[key], hostile(rng)])))
        grand = _get(obj, path[:-2]) if len(path) > 1 else None
        if grand is None:
            return pairs
        grand[path[-2]] = pairs
    elif op == 5:  # copy another node's value here (e.g. one entry's offsets onto another)
        _, other = rng.choice(nodes)
        parent[key] = copy.deepcopy(other)
    elif op == 6 and type(node) is list:
        node.append(rng.choice([node[0] if node else 0, hostile(rng)]))
    elif isinstance(node, int) and not isinstance(node, bool):
        parent[key] = node + rng.choice([-1, 1, 2**32, -(2**32), 8])
    else:
        parent[key] = hostile(rng)
    return obj


# ---- JSON with duplicate keys ---------------------------------------------------------------
def dump_json(obj) -> str:
    if isinstance(obj, Pairs):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump_json(v)}" for k, v in obj) + "}"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump_json(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list):
        return "[" + ",".join(dump_json(v) for v in obj) + "]"
    if isinstance(obj, (bytes, msgpack.ExtType)):
        return json.dumps(repr(obj))
    return json.dumps(obj)


# ---- msgpack with duplicate keys and raw extension types -------------------------------------
def pack(obj) -> bytes:
    if isinstance(obj, (dict, Pairs)):
        items = list(obj.items()) if isinstance(obj, dict) else list(obj)
        p = msgpack.Packer(use_bin_type=True)
        return p.pack_map_header(len(items)) + b"".join(
            pack(k) + (b"\xcf" + v.to_bytes(8, "big") if k == MANIFEST_CHECKSUM and isinstance(v, int)
                       and not isinstance(v, bool) and 0 <= v < 2**64 else pack(v))
            for k, v in items)
    if isinstance(obj, list):
        return msgpack.Packer().pack_array_header(len(obj)) + b"".join(pack(v) for v in obj)
    if isinstance(obj, int) and not isinstance(obj, bool):
        obj = min(max(obj, -(2**63)), 2**64 - 1)  # msgpack's integer range
    return msgpack.packb(obj, use_bin_type=True)


def reseal(data: bytes) -> bytes:
    """A manifest that ends with its checksum field gets the checksum of its (mutated) bytes, as
    an attacker would write it, so the mutation reaches the checks behind the checksum. Others
    (no checksum field last) are left as they are."""
    trailer = msgpack.packb(MANIFEST_CHECKSUM) + b"\xcf"
    if len(data) < len(trailer) + 8 or data[-8 - len(trailer):-8] != trailer:
        return data
    return data[:-8] + xxhash.xxh3_64_intdigest(data[:-8]).to_bytes(8, "big")


def reseal_single_file(data: bytes) -> bytes:
    """:func:`reseal` for the manifest inside a single file's header (same length, same layout)."""
    try:
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        old = header["__metadata__"][HEADER_KEY]
        new = base64.b64encode(reseal(base64.b64decode(old, validate=True))).decode()
    except Exception:  # noqa: BLE001 - not decodable: left as it is
        return data
    if new == old:
        return data
    at = data.find(old.encode(), 8, 8 + n)
    return data if at < 0 else data[:at] + new.encode() + data[at + len(old):]


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                           ext_hook=lambda code, d: msgpack.ExtType(code, d))


def _hostile_json(rng: random.Random):
    return copy.deepcopy(rng.choice(HOSTILE_JSON))  # a fresh copy: the tree is edited in place


def mutate_header(header: bytes, rng: random.Random) -> bytes | None:
    """A safetensors JSON header (without its length prefix), structurally mutated."""
    try:
        obj = json.loads(header)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    for _ in range(rng.randrange(1, 3)):
        obj = mutate_tree(obj, rng, _hostile_json)
    text = dump_json(obj).encode()
    return text + b" " * (-len(text) % 8)


def mutate_manifest(raw: bytes, rng: random.Random) -> bytes | None:
    try:
        obj = unpack(raw)
    except Exception:  # noqa: BLE001 - any undecodable input falls back to byte mutation
        return None
    for _ in range(rng.randrange(1, 3)):
        obj = mutate_tree(obj, rng, _hostile_msgpack)
    return pack(obj)


def mutate_single_file(data: bytes, rng: random.Random) -> bytes | None:
    """A single-file checkpoint: mutate its JSON header, or the manifest inside it."""
    if len(data) < 8:
        return None
    n = struct.unpack("<Q", data[:8])[0]
    if n > len(data) - 8:
        return None
    header, body = data[8:8 + n], data[8 + n:]
    try:
        obj = json.loads(header)
        manifest = base64.b64decode(obj["__metadata__"][HEADER_KEY], validate=True)
    except Exception:  # noqa: BLE001
        new = mutate_header(header, rng)
        return None if new is None else struct.pack("<Q", len(new)) + new + body
    if rng.random() < 0.5:
        new_manifest = mutate_manifest(manifest, rng)
        if new_manifest is None:
            return None
        obj["__metadata__"][HEADER_KEY] = base64.b64encode(new_manifest).decode()
        text = json.dumps(obj, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
    else:
        text = mutate_header(header, rng)
    return struct.pack("<Q", len(text)) + text + body


def mutate(target: str, data: bytes, rng: random.Random) -> bytes | None:
    """A structural mutation of an input of ``target``; None when the input does not decode."""
    if target == "file":
        return mutate_single_file(data, rng)
    if target == "manifest":
        return mutate_manifest(data, rng)
    if target == "header":
        if not data:
            return None
        new = mutate_header(data[1:], rng)
        return None if new is None else data[:1] + new
    raise ValueError(target)
