"""The ``torch.save`` payloads inside extra state, parsed without ``torch.load``: the legacy
(non-zip) format by hand, the zip format with :mod:`zipfile`; each pickle in them goes through the
restricted machine, and storages get their bytes after bounds checks."""

from __future__ import annotations

import io
import re
import struct
import zipfile
from typing import Any, Callable, Dict, Optional

from .errors import short_repr, unsafe_error
from .limits import MAX_PAYLOAD_BYTES, MAX_STORAGE_BYTES, MAX_ZIP_ENTRIES
from .pickle_vm import Ctx, Global, Machine, Storage, describe, elsize
from .schema import STORAGE_DTYPES

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001
LEGACY_PREFIX = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."  # pickle.dumps(_LEGACY_MAGIC, 2)
_LOCATION_RE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")
_ZIP_KEY_RE = re.compile(r"[A-Za-z0-9_]{1,64}")


def _storage_pid(pid: Any, expect_len: int, refuse: Callable[[str], Exception]):
    if type(pid) is not tuple or len(pid) != expect_len or pid[0] != "storage":
        raise refuse(f"persistent id {short_repr(pid)} (expected a {expect_len}-tuple "
                     "('storage', <torch storage class>, key, location, numel, ...))")
    _, stype, key, location, numel = pid[:5]
    if not (isinstance(stype, Global) and stype.kind == "storage_type"):
        raise refuse(f"persistent id storage type {describe(stype)}")
    if type(key) is not str or not 0 < len(key) <= 64:
        raise refuse(f"storage key {short_repr(key)}")
    if type(location) is not str or not _LOCATION_RE.fullmatch(location):
        raise refuse(f"storage location {short_repr(location)}")
    dtype = STORAGE_DTYPES[stype.name]
    if type(numel) is not int or numel < 0 or numel * elsize(dtype) > MAX_STORAGE_BYTES:
        raise refuse(f"storage of {short_repr(numel)} {dtype} elements (limit {MAX_STORAGE_BYTES} bytes)")
    return dtype, key, location, numel


def parse_legacy_torch_save(data: bytes, ctx: Ctx, *, expect_storage: bool, context: str) -> Any:
    """Parse a legacy (non-zip) ``torch.save`` payload by hand; storages get their bytes filled in."""
    where = ctx.where
    if len(data) > MAX_PAYLOAD_BYTES:
        raise unsafe_error(f"{context} of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", where)
    f = io.BytesIO(data)
    magic = Machine(f"{context}, magic number", ctx).run(f)
    if type(magic) is not int or magic != _LEGACY_MAGIC:
        raise unsafe_error(f"{context}: not a legacy torch.save payload (magic {short_repr(magic)})", where)
    version = Machine(f"{context}, protocol version", ctx).run(f)
    if type(version) is not int or version != _LEGACY_PROTOCOL_VERSION:
        raise unsafe_error(f"{context}: legacy torch.save protocol version {short_repr(version)}", where)
    sys_info = Machine(f"{context}, sys info", ctx).run(f)
    if type(sys_info) is not dict or sys_info.get("protocol_version") != _LEGACY_PROTOCOL_VERSION:
        raise unsafe_error(f"{context}: bad sys info {short_repr(sys_info)}", where)

    storages: Dict[str, Storage] = {}
    machine = Machine(f"{context}, object", ctx)

    def persistent_load(pid: Any, pos: int) -> Storage:
        dtype, key, location, numel = _storage_pid(pid, 6, machine.refuse)
        if pid[5] is not None:
            raise machine.refuse("a legacy storage view (view_metadata)")
        known = storages.get(key)
        if known is None:
            known = storages[key] = Storage(dtype, key, location, numel)
        elif (known.dtype, known.numel) != (dtype, numel):
            raise machine.refuse(f"storage {key!r} declared twice with different dtype/size")
        return known

    machine.persistent_load = persistent_load
    obj = machine.run(f)
    keys = Machine(f"{context}, storage keys", ctx).run(f)
    if type(keys) is not list or not all(type(k) is str for k in keys) \
            or len(set(keys)) != len(keys) or set(keys) != set(storages):
        raise unsafe_error(f"{context}: storage key list {short_repr(keys)} does not match the "
                     f"storages referenced ({short_repr(sorted(storages))})", where)
    for key in keys:
        st = storages[key]
        header = f.read(8)
        if len(header) != 8:
            raise unsafe_error(f"{context}: storage {key!r} is missing its size header", where)
        numel = int.from_bytes(header, "little", signed=True)
        if numel != st.numel:
            raise unsafe_error(f"{context}: storage {key!r} holds {numel} elements but its "
                         f"persistent id declares {st.numel}", where)
        nbytes = numel * elsize(st.dtype)
        remaining = len(data) - f.tell()
        if nbytes > remaining:
            raise unsafe_error(f"{context}: storage {key!r} claims {nbytes} bytes but only "
                         f"{remaining} remain", where)
        ctx.budget.spend_bytes(nbytes, where, f"storage {key!r}")
        st.data = f.read(nbytes)
    if f.tell() != len(data):
        raise unsafe_error(f"{context}: {len(data) - f.tell()} unexpected trailing bytes", where)
    if expect_storage and not isinstance(obj, Storage):
        raise unsafe_error(f"{context}: payload is a {describe(obj)}, expected a storage", where)
    return obj


def load_storage_from_bytes(data: bytes, ctx: Ctx) -> Storage:
    """``torch.storage._load_from_bytes(data)`` of a top-level pickle: a legacy ``torch.save`` of
    one storage (the :class:`Machine`'s ``load_from_bytes``)."""
    return parse_legacy_torch_save(data, ctx, expect_storage=True,
                                    context="nested torch.save of a storage")


_ZIP_CDIR = b"PK\x01\x02"
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
               NotImplementedError, RuntimeError, KeyError, IndexError, OverflowError,
               struct.error, UnicodeDecodeError)
"""What :mod:`zipfile` raises for malformed archives (NotImplementedError: an unsupported
"version needed to extract" or compression method; RuntimeError: encryption)."""


def parse_zip_torch_save(data: bytes, ctx: Ctx) -> Any:
    """Parse a zip-format ``torch.save`` payload (``<root>/data.pkl`` + ``<root>/data/<key>``).

    Before :mod:`zipfile` sees the archive, the number of central-directory signatures bounds
    the entries it can list (each ``ZipInfo`` costs hundreds of bytes). Entries must be stored
    (``torch.save`` never compresses) and unencrypted.
    """
    context = "torch.save zip payload"
    where = ctx.where
    n_entries = data.count(_ZIP_CDIR)
    if n_entries > MAX_ZIP_ENTRIES:
        raise unsafe_error(f"{context}: {n_entries} central directory entries (limit "
                     f"{MAX_ZIP_ENTRIES})", where)
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = {i.filename: i for i in zf.infolist()}
    except _ZIP_ERRORS as exc:
        raise unsafe_error(f"{context}: unreadable zip: {type(exc).__name__}: {short_repr(str(exc))}",
                     where) from None
    for info in infos.values():
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x41:
            raise unsafe_error(f"{context}: entry {short_repr(info.filename)} is compressed or encrypted "
                         "(torch.save stores entries as they are)", where)
    pkls = [n for n in infos if n == "data.pkl" or (n.endswith("/data.pkl") and n.count("/") == 1)]
    if len(pkls) != 1:
        raise unsafe_error(f"{context}: expected one <root>/data.pkl, found {short_repr(pkls)}", where)
    prefix = pkls[0][: -len("data.pkl")]
    total = sum(i.file_size for i in infos.values())
    if total > MAX_PAYLOAD_BYTES + MAX_STORAGE_BYTES:
        raise unsafe_error(f"{context}: entries declare {total} bytes", where)

    def read(name: str, expect: Optional[int] = None) -> bytes:
        info = infos.get(name)
        if info is None:
            raise unsafe_error(f"{context}: missing entry {short_repr(name)}", where)
        if info.file_size > (MAX_PAYLOAD_BYTES if expect is None else expect):
            raise unsafe_error(f"{context}: entry {short_repr(name)} declares {info.file_size} bytes"
                         + ("" if expect is None else f", expected {expect}"), where)
        ctx.budget.spend_bytes(info.file_size, where, f"zip entry {short_repr(name)}")
        try:
            blob = zf.read(info)
        except Exception as exc:  # pylint: disable=broad-except  # CRC, truncation, bad headers
            raise unsafe_error(f"{context}: cannot read {short_repr(name)}: {type(exc).__name__}: "
                         f"{short_repr(str(exc))}", where) from None
        if expect is not None and len(blob) != expect:
            raise unsafe_error(f"{context}: entry {short_repr(name)} holds {len(blob)} bytes, expected "
                         f"{expect}", where)
        return blob

    byteorder = prefix + "byteorder"
    if byteorder in infos and read(byteorder).strip() != b"little":
        raise unsafe_error(f"{context}: big-endian payloads are not supported", where)

    storages: Dict[str, Storage] = {}
    machine = Machine(f"{context}, data.pkl", ctx)

    def persistent_load(pid: Any, pos: int) -> Storage:
        dtype, key, location, numel = _storage_pid(pid, 5, machine.refuse)
        if not _ZIP_KEY_RE.fullmatch(key):
            raise machine.refuse(f"zip storage key {key!r}")
        known = storages.get(key)
        if known is not None:
            if (known.dtype, known.numel) != (dtype, numel):
                raise machine.refuse(f"storage {key!r} declared twice with different dtype/size")
            return known
        st = storages[key] = Storage(dtype, key, location, numel)
        st.data = read(f"{prefix}data/{key}", numel * elsize(dtype))
        return st

    machine.persistent_load = persistent_load
    f = io.BytesIO(read(pkls[0]))
    obj = machine.run(f)
    if f.tell() != len(f.getvalue()):
        raise unsafe_error(f"{context}: trailing bytes after data.pkl's STOP", where)
    return obj
