"""Reading checkpoints: ``te_serial.open`` (lazy handle), ``load_quantized``, ``read_protos``, ``verify``.

Order of work on open: read and validate the manifest (schema, registry, prototype ↔ buffer
agreement) — a single file's from its header's metadata — and check every file's size against the
manifest. Then, at the first read of a file's buffers (or by ``verify``), before any of its buffers
is touched, its safetensors header is checked against the manifest: compared with the header
te-serial's writer plans from the manifest, or else parsed and checked (the one validator in
:mod:`.files`; keys, dtypes, shapes). A directory's shards and a single file go the same way; only
a single file whose header te-serial did not format is parsed, and checked, at open (its manifest
is found by the parse). On CPU, buffers are views of the file's private mmap (no copy); for
another device they are copied into buffers allocated from the tensor's prototype.
"""

from __future__ import annotations

import base64
import binascii
import errno
import math
import operator
import os
import resource
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch

from ..dtypes import safetensors_code
from ..errors import ChecksumError, CheckpointError, CheckpointFileError, ManifestError, TensorMismatchError
from ..errors import ShapeError
from ..formats.tensors import QuantizedTensorStorage
from ..formats.protocol import flatten_2d
from ..formats.slicing import range_bounds, box_to_range, buffer_regions, slice_from_regions, storage_view
from ..proto import TensorProto
from .fileops import open_regular
from .files import SafetensorsFile, checksum
from .header import (SHARD_METADATA, PlannedHeader, gc_paused, header_json, leading_metadata,
                     planned_header)
from .manifest import (HEADER_KEY, MANIFEST_NAME, MAX_MANIFEST_BYTES, PLAIN_BUFFER, SELF_FILE, Manifest,
                       expected_buffers, format_checksum, region_shapes)


class StoredPiece(NamedTuple):
    """Where one stored piece of a buffer lies: the region ``offsets`` / ``sizes`` of the buffer's
    region view that it holds, read as an array of shape ``array`` (the piece's own shape, or a
    whole buffer's storage view, whose origin box is the region)."""

    file: str
    key: str
    array: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    checksum: int | None


class BufferPieces(NamedTuple):
    """One buffer of a tensor as stored: its name, region view, stored dtype and shape, and pieces."""

    name: str
    view: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[StoredPiece]


def _narrow(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, z) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, z)
    return t
from .tree import ExtraStateBudget, extra_state_refs, rebuild_tree
from .transfer import DeviceCopier


_KEY, _WANT_SHAPE_DTYPE = operator.itemgetter(2), operator.itemgetter(3, 4)   # of buffers_by_file's rows
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")                          # of a header Entry


def _open_held(path: Path, links_into: Path | None = None) -> tuple[int, int]:
    """(descriptor, size) of a checkpoint file to hold; where the process runs out of descriptors,
    the soft limit is raised toward the hard one once, else the error says what to raise."""
    try:
        return open_regular(path, links_into=links_into)
    except CheckpointFileError as e:
        if not isinstance(e.__context__, OSError) or e.__context__.errno != errno.EMFILE:
            raise
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, max(2 * soft, soft + 1024))
    if want != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return open_regular(path, links_into=links_into)
        except (ValueError, OSError, CheckpointFileError):
            pass
    raise CheckpointFileError(f"cannot hold this checkpoint's files open: the process may open {soft} files "
                              "(raise it with ulimit -n)", file=str(path))


class Checkpoint:
    """A lazily opened checkpoint (``te_serial.open(path)``): prototypes now, bytes on demand."""

    def __init__(self, path: str | os.PathLike, *, strict: bool = True,
                 links_into: str | os.PathLike | None = None) -> None:
        """``links_into``: a directory checkpoint's files may be symlinks to files directly in that
        folder (a Hugging Face hub cache snapshot, whose files link to its repository's blobs)."""
        self.path = Path(path)
        self._links_into = Path(links_into) if links_into is not None else None
        self._files: dict[str, SafetensorsFile] = {}   # file → opened, header checked against the manifest
        self._by_file: dict[str, list] | None = None
        self._metas: dict[int, Any] = {}  # id(prototype) → its unflatten context
        self._held: dict[str, tuple[int, int]] = {}  # file → (descriptor, size) opened with the manifest
        self._self_metadata: dict[str, str] | None = None  # a single file's header metadata (its manifest)
        self._verified: set[tuple[str, str]] = set()  # (file, key) of pieces read_region found intact
        self._closed = False
        if self.path.is_dir():
            self.root = self.path
            self._open_snapshot(strict)
        elif self.path.exists():
            self.root = self.path.parent
            self._open_single(strict)
        else:
            raise CheckpointFileError("no such checkpoint", file=str(self.path))
        self._protos = self.manifest.protos_by_name()
        self._metadata = MappingProxyType(self.manifest.metadata)

    def _open_single(self, strict: bool) -> None:
        """A single file: its manifest, read from the header's ``__metadata__``, and the file held.

        Where the header begins as te-serial writes it (:func:`.header.leading_metadata`) and the
        file's size is its header's plus the bytes the manifest describes, the manifest is taken
        from there without a parse, and the rest of the header is checked at the first read, as a
        directory's shards are (compared with the header the writer plans from the manifest, else
        parsed and checked: :meth:`_file`). Any other file (another writer's formatting, a size
        that does not add up) has its header parsed and checked whole now."""
        fd, size = open_regular(self.path, follow_symlinks=True)  # the path the caller named
        self._held[SELF_FILE] = (fd, size)
        try:
            raw = header_json(fd, str(self.path), size)
            header_end = 8 + len(raw)
            value = leading_metadata(raw, HEADER_KEY)
            del raw
            parsed = None
            if value is None:
                parsed = self._parse_single()
                value = parsed.metadata.get(HEADER_KEY)
                if value is None:
                    raise ManifestError("safetensors file has no te-serial manifest in its header "
                                        "(use te_serial.convert to import plain safetensors)", file=str(self.path))
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ManifestError(f"manifest in header is not base64: {e}", file=str(self.path)) from None
            self.manifest = Manifest.from_bytes(data, source=str(self.path), strict=strict, file_bytes=size)
            if self.manifest.files:
                raise ManifestError("a single-file checkpoint must not list other files", file=str(self.path),
                                    field="files")
            self._self_metadata = {HEADER_KEY: value}  # the header's metadata, for its planned header
            if parsed is None and size != header_end + self.manifest.nbytes():
                parsed = self._parse_single()  # its data section is not the manifest's buffers alone
            if parsed is not None:
                self._check_header(SELF_FILE, parsed)
        except BaseException:
            self.close()
            raise

    def _parse_single(self) -> SafetensorsFile:
        """The single file held at open, its header parsed and checked now (the full parse)."""
        f = self._files[SELF_FILE] = SafetensorsFile(self.path, fd=self._held.pop(SELF_FILE))
        return f

    def _read_manifest(self, path: Path) -> bytes:
        try:
            fd, size = open_regular(path, links_into=self._links_into)
        except CheckpointFileError as e:
            missing = not path.exists() and not path.is_symlink()
            raise ManifestError(f"no {MANIFEST_NAME} in checkpoint directory" if missing else e.message,
                                file=str(path.parent if missing else path)) from None
        try:
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit", file=str(path))
            data = os.pread(fd, size, 0)
        except OSError as e:
            raise ManifestError(f"cannot read manifest: {e}", file=str(path)) from None
        finally:
            os.close(fd)
        if len(data) != size:
            raise ManifestError("manifest changed while it was read", file=str(path))
        return data

    # --- what the handle tells without reading buffers ----------------------------------------
    @property
    def protos(self) -> Mapping[str, TensorProto]:
        """name → prototype: a read-only view (the same object on every access, O(1) per lookup)."""
        return self._protos

    @property
    def metadata(self) -> Mapping[str, str]:
        """The checkpoint's string metadata, read-only."""
        return self._metadata

    def keys(self) -> list[str]:
        return list(self.manifest.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def __len__(self) -> int:
        return len(self.manifest.tensors)

    # --- files ------------------------------------------------------------------------------------
    def _file_path(self, name: str) -> Path:
        return self.path if name == SELF_FILE else self.root / name

    #: how often open re-reads a manifest that a concurrent save replaced between its reads
    SNAPSHOT_TRIES = 5

    def _open_snapshot(self, strict: bool) -> None:
        """Read the manifest and open every file it lists, keeping the descriptors: later reads see
        this version of the checkpoint whatever saves do to the directory afterwards (a save
        commits new files, then removes the old ones; an open descriptor keeps its file). A file
        already removed means a save committed in between: the new manifest is read instead."""
        path = self.path / MANIFEST_NAME
        for attempt in range(self.SNAPSHOT_TRIES):
            data = self._read_manifest(path)
            self.manifest = Manifest.from_bytes(data, source=str(path), strict=strict,
                                                file_bytes=0)  # plus the sizes its files list
            try:
                self._hold_files()
                return
            except CheckpointFileError:
                self._release_held()
                if attempt + 1 == self.SNAPSHOT_TRIES or self._read_manifest(path) == data:
                    raise  # not a concurrent save: the checkpoint itself is damaged

    def _hold_files(self) -> None:
        """Open every listed file (a regular file, no symlink) and check its size."""
        for name, size in self.manifest.files.items():
            p = self._file_path(name)
            fd, got = _open_held(p, self._links_into)
            self._held[name] = (fd, got)
            if got != size:
                raise CheckpointFileError(f"file is {got} bytes, the manifest says {size} (truncated or "
                                          "replaced?)", file=str(p))

    def _release_held(self) -> None:
        for fd, _ in self._held.values():
            os.close(fd)
        self._held.clear()

    def _file(self, name: str) -> SafetensorsFile:
        """The file, opened and its header checked against the manifest before its first buffer is read."""
        f = self._files.get(name)
        if f is None:
            held = self._held.pop(name, None)
            if held is None and self._closed:
                raise CheckpointError("the checkpoint handle is closed", file=str(self._file_path(name)))
            f = SafetensorsFile(self._file_path(name), fd=held, expected=self._planned_header(name))
            try:
                if name != SELF_FILE and f.size != self.manifest.files[name]:  # a single file's own size
                    raise CheckpointFileError(f"file is {f.size} bytes, the manifest says {self.manifest.files[name]}",
                                              file=str(f.path))
                if not f.as_planned:  # its entries are the manifest's by construction when it is
                    self._check_header(name, f)
            except BaseException:
                f.close()
                raise
            self._files[name] = f
        return f

    def _wanted(self, name: str) -> list[tuple[str, str, str, tuple[int, ...], torch.dtype]]:
        """(tensor, buffer, key, shape, stored dtype) of every buffer the manifest puts in a file."""
        if self._by_file is None:
            self._by_file = self.manifest.buffers_by_file()
        return self._by_file.get(name, [])

    def _planned_header(self, name: str) -> PlannedHeader | None:
        """The header te-serial's writer gives a file holding the manifest's buffers of that file:
        a shard's metadata is :data:`.header.SHARD_METADATA`, a single file's the manifest it carries."""
        return planned_header([(key, shape, dtype) for _, _, key, shape, dtype in self._wanted(name)],
                              self._self_metadata if name == SELF_FILE else SHARD_METADATA)

    def _check_header(self, name: str, f: SafetensorsFile) -> None:
        """Every buffer the manifest puts in this file is there, with the manifest's dtype and shape."""
        entries = f.entries
        wanted = self._wanted(name)
        found = list(map(entries.get, map(_KEY, wanted)))
        if None not in found and list(map(_SHAPE_DTYPE, found)) == list(map(_WANT_SHAPE_DTYPE, wanted)):
            return  # all at once; else the loop names the first buffer at fault
        for tname, bname, key, want_shape, want_dtype in wanted:
            e = entries.get(key)
            if e is None:
                raise TensorMismatchError(f"buffer {bname} (key {key!r}) is not in the file",
                                          file=str(f.path), tensor=tname, field=bname)
            if e.shape != want_shape or e.dtype != want_dtype:
                raise TensorMismatchError(
                    f"buffer {bname} is {safetensors_code(e.dtype)}{list(e.shape)} in the file but "
                    f"{safetensors_code(want_dtype)}{list(want_shape)} in the manifest",
                    file=str(f.path), tensor=tname, field=bname)

    def close(self) -> None:
        self._closed = True
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._release_held()

    def __del__(self) -> None:
        if getattr(self, "_held", None):
            self._release_held()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- reading tensors ------------------------------------------------------------------------
    def _read_buffer(self, tname: str, bname: str, file: str, key: str, expected: int | None,
                     verify: bool, mmap: bool = True) -> torch.Tensor:
        """One stored buffer: a view of the file's private mmap, or (``mmap=False``) a fresh copy."""
        f = self._file(file)
        t = f.mapped(key) if mmap else f.read(key)
        if verify:
            self._check(tname, bname, f, t, expected)
        return t

    def _verify_piece(self, tname: str, bname: str, pc: StoredPiece, data: torch.Tensor | None = None) -> None:
        """Check a whole stored piece once per open checkpoint, from ``data`` (its bytes, already mapped)
        or through a mapping of its own pages let go after (reading a grouped tensor's experts one by
        one, or a tensor's slices, would otherwise check, and keep resident, its whole buffer at every read)."""
        if (pc.file, pc.key) not in self._verified:
            f = self._file(pc.file)
            self._check(tname, bname, f, data if data is not None else f.mapped(pc.key, own=True), pc.checksum)
            self._verified.add((pc.file, pc.key))

    @staticmethod
    def _check(tname: str, bname: str, f: SafetensorsFile, t: torch.Tensor, expected: int | None) -> None:
        if expected is None:
            raise ChecksumError("cannot verify: the checkpoint was saved without checksums",
                                file=str(f.path), tensor=tname, field=bname)
        if checksum(t) != expected:
            raise ChecksumError(f"buffer {bname} does not match its checksum {format_checksum(expected)}",
                                file=str(f.path), tensor=tname, field=bname)

    def _assembly(self, proto: TensorProto) -> tuple[Any, dict[str, torch.dtype]]:
        """(unflatten context, in-memory dtype per buffer) of a prototype, worked out once."""
        found = self._metas.get(id(proto))
        if found is None:
            found = self._metas[id(proto)] = (proto.create_metadata(),
                                              {n: s.dtype for n, s in proto.buffer_specs().items()})
        return found

    def _load(self, name: str, device: torch.device, verify: bool, copier: DeviceCopier | None,
              cache: dict, mmap: bool = True) -> torch.Tensor:
        where = self.manifest.locations(name)
        ident = tuple(loc[2] for loc in where)  # keys are unique to a stored tensor
        if ident in cache:  # tied tensors come back as one object
            return cache[ident]
        proto = self._protos[name]
        if device.type == "meta":
            out = proto.create_tensor(device="meta")
        else:
            if self.manifest.chunks and self.manifest.is_chunked(name):
                raw = self._assemble(name, verify, mmap)
            else:
                raw = {b: self._read_buffer(name, b, f, k, c, verify, mmap) for b, f, k, _, _, c in where}
            if copier is not None:  # allocate from the prototype on the target device, copy in
                dtypes = self._assembly(proto)[1] if proto.quantizer is not None else {}
                dst = (proto.quantizer.alloc_tensors(proto.shape, device=device) if proto.quantizer is not None
                       else {PLAIN_BUFFER: torch.empty(proto.shape, dtype=proto.dtype, device=device)})
                for n, t in raw.items():
                    copier.copy(dst[n], t.view(dtypes[n]) if dtypes else t)
                raw = dst
            out = self._checked(name, self._build(proto, raw))
        cache[ident] = out
        return out

    def _checked(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (tensor ``name`` as read), refused where a buffer holds a value its format never
        writes (``Quantizer.refused_value``: MXFP4's E8M0 NaN scale byte)."""
        if isinstance(t, QuantizedTensorStorage):
            bad = t.quantizer.refused_value(t.buffers())
            if bad is not None:
                raise CheckpointError(bad[1], file=str(self.path), tensor=name, field=bad[0])
        return t

    def _build(self, proto: TensorProto, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensor of ``proto`` from its buffers: TensorProto's unflatten context + the storage
        class's ``__tensor_unflatten__`` (a plain tensor is its one buffer)."""
        if proto.quantizer is None:
            out = raw[PLAIN_BUFFER]
            if proto.requires_grad:
                out.requires_grad_(True)
            return out
        meta, dtypes = self._assembly(proto)
        raw = {n: t.view(dtypes[n]) for n, t in raw.items()}
        return QuantizedTensorStorage.__tensor_unflatten__(raw, meta, proto.shape, None)

    def stream(self, name: str, *, verify: bool = True, members: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """One tensor for a streaming copy (``convert``'s byte relayouts), and the check of its stored
        checksums to run once its bytes are written (None when ``verify`` is off or it ran already).
        ``members=(start, stop)``: only those experts (as :meth:`get` reads them), views of their part
        of each buffer; the check covers the whole stored buffers, once per open checkpoint.

        Each buffer is a mapping of its own pages, unmapped when the tensor is freed, so memory stays
        bounded by the tensors in flight; written before anything reads them, the bytes go from the
        page cache to the output in one kernel copy. A failed check still comes before the caller
        commits its output. Chunked (sharded-save) tensors are read into fresh memory and checked now.
        """
        proto = self._protos.get(name)
        if proto is None:
            raise CheckpointError(f"no tensor {name!r} in checkpoint", file=str(self.path), tensor=name)
        if self.manifest.chunks and self.manifest.is_chunked(name):
            return self.get(name, verify=verify, mmap=False, members=members), None
        where = self.manifest.locations(name)
        raw = {b: self._file(f).mapped(k, own=True) for b, f, k, _, _, _ in where}
        if members is None:
            out = self._build(proto, dict(raw))
        else:
            part, boxes = self._member_boxes(name, members)
            bufs = self.pieces(name)
            out = self._assemble_members(name, part, {buf.name: _narrow(raw[buf.name].reshape(buf.pieces[0].array),
                                                                        *boxes[buf.name]) for buf in bufs})
        if not verify:
            return out, None

        def check() -> None:
            if members is not None:   # a range of experts: each whole stored buffer once per open
                for buf in bufs:
                    self._verify_piece(name, buf.name, buf.pieces[0], raw[buf.name])
                return
            for b, f, k, _, _, c in where:
                self._check(name, b, self._file(f), raw[b], c)
        return out, check

    def get(self, name: str, device: str | torch.device = "cpu", *, verify: bool = False,
            mmap: bool = True, rows=None, cols=None, member: int | None = None,
            members: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor, reading only its own buffers.

        ``rows=(r0, r1)`` / ``cols=(c0, c1)`` (TE's 2-D view: rows are the leading dims
        flattened) read just that block-aligned range, for tensor-parallel layers: only the
        bytes of the range are read (plus whole-tensor scalars such as an amax), and the result
        equals ``te_serial.slice_quantized`` of the whole tensor (a plain tensor: the same range,
        shaped as ``slice_quantized`` shapes it). With ``verify``, every stored piece the range
        touches is read whole to check its checksum.

        ``member=i`` of a grouped (MoE) tensor reads only expert ``i``'s bytes and returns that
        member (a quantized tensor of the member format, or a plain tensor); ``members=(start, stop)``
        reads only those experts' bytes and returns them as a grouped tensor of their own (an
        expert-parallel rank's experts); of a plain tensor, its first dim's entries ``start`` ..
        ``stop - 1`` (a 3-D stack's experts).
        """
        if name not in self.manifest.tensors:
            raise CheckpointError(f"no tensor {name!r} in checkpoint", file=str(self.path), tensor=name)
        grouped = getattr(self._protos[name].quantizer, "is_container", False)
        if member is not None or members is not None or (grouped and (rows is not None or cols is not None)):
            if rows is not None or cols is not None or (member is not None and members is not None) \
                    or (member is not None and not grouped):
                raise CheckpointError("member= / members= read members of a grouped tensor (members=, also a plain "
                                      "tensor's first-dim entries), and a grouped tensor is read whole or by member= "
                                      "or members= (not rows= / cols=)", file=str(self.path), tensor=name)
            out = self._get_member(name, member, verify) if members is None else \
                self._get_members(name, members, verify)
            device = torch.device(device)
            return out if device.type == "cpu" else out.to(device)
        if rows is not None or cols is not None:
            out = self._get_slice(name, rows, cols, verify)
            device = torch.device(device)
            return out if device.type == "cpu" else out.to(device)
        return self.load_tensors([name], device=device, verify=verify, mmap=mmap)[name]

    # --- pieces: whole buffers and chunks alike ------------------------------------------------
    def pieces(self, name: str) -> list[BufferPieces]:
        """Each buffer of a tensor (flatten order) as stored: its region view and the pieces that
        tile it — one whole buffer, or (format 1.2) the chunks of a sharded save."""
        m = self.manifest
        proto = self._protos[name]
        if m.chunks and m.is_chunked(name):
            shapes = expected_buffers(proto)
            return [BufferPieces(b, view, dtype, shapes[b][0],
                                 [StoredPiece(f, k, z, o, z, c) for f, k, o, z, c in pcs])
                    for b, view, dtype, pcs in m.pieces(name)]
        out = []
        for (b, f, k, shape, dtype, c), view in zip(m.locations(name), region_shapes(proto)):
            out.append(BufferPieces(b, view, dtype, shape,
                                    [StoredPiece(f, k, storage_view(shape, view), (0,) * len(view), view, c)]))
        return out

    def _piece_data(self, tname: str, bname: str, pc: StoredPiece, verify: bool, mmap: bool = True) -> torch.Tensor:
        """A whole stored piece (a view of the file's mmap, or fresh memory), checked if asked."""
        t = self._read_buffer(tname, bname, pc.file, pc.key, pc.checksum, verify, mmap)
        return t.reshape(pc.array)

    def _assemble(self, name: str, verify: bool, mmap: bool = True) -> dict[str, torch.Tensor]:
        """A chunked tensor's buffers (stored dtypes), built from its pieces; padding zero."""
        out = {}
        for buf in self.pieces(name):
            nbytes = buf.dtype.itemsize
            full = storage_view(buf.shape, buf.view)
            t = torch.zeros((*full[:-1], full[-1] * nbytes) if full else (nbytes,), dtype=torch.uint8)
            t = t.view(buf.dtype).reshape(full)
            region = t[tuple(slice(0, v) for v in buf.view)]
            for pc in buf.pieces:
                piece = self._piece_data(name, buf.name, pc, verify, mmap)
                _narrow(region, pc.offsets, pc.sizes).copy_(_narrow(piece, (0,) * len(pc.sizes), pc.sizes))
            out[buf.name] = t.reshape(buf.shape)
        return out

    def read_region(self, name: str, buf: BufferPieces, offsets, sizes, verify: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``offsets`` / ``sizes`` of one buffer's region view (stored dtype), reading only
        the bytes of the pieces' parts inside it (``verify``: whole touched pieces, checked once per
        open checkpoint)."""
        offsets, sizes = tuple(offsets), tuple(sizes)
        if out is None:
            out = torch.empty(sizes, dtype=buf.dtype)
        for pc in buf.pieces:
            lo = [max(a, b) for a, b in zip(offsets, pc.offsets)]
            hi = [min(a + z, b + w) for a, z, b, w in zip(offsets, sizes, pc.offsets, pc.sizes)]
            if any(h <= l for l, h in zip(lo, hi)) and sizes:
                continue
            within = tuple(l - b for l, b in zip(lo, pc.offsets))
            extent = tuple(h - l for l, h in zip(lo, hi))
            dst = _narrow(out, [l - o for l, o in zip(lo, offsets)], extent)
            # a whole piece read into one run of memory is checked there; a part of one, through its own mapping
            whole = verify and (pc.file, pc.key) not in self._verified and extent == tuple(pc.sizes) \
                and math.prod(pc.array) == math.prod(extent) and dst.is_contiguous()
            if verify and not whole:
                self._verify_piece(name, buf.name, pc)
            if dst.is_contiguous():
                self._file(pc.file).read_box(pc.key, pc.array, within, extent, out=dst)
            else:
                dst.copy_(self._file(pc.file).read_box(pc.key, pc.array, within, extent))
            if whole:
                self._check(name, buf.name, self._file(pc.file), dst, pc.checksum)
                self._verified.add((pc.file, pc.key))
        return out

    def _get_member(self, name: str, i: int, verify: bool) -> torch.Tensor:
        """Member ``i`` of a grouped tensor, reading only its range of each packed buffer."""
        proto = self._protos[name]
        q = proto.quantizer
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < q.num_tensors:
            raise CheckpointError(f"member {i!r} out of range: the group has {q.num_tensors} members",
                                  file=str(self.path), tensor=name)
        ranges = q.member_ranges(i)
        parts = {buf.name: self.read_region(name, buf, (ranges[buf.name][0],), (ranges[buf.name][1],), verify=verify)
                 for buf in self.pieces(name)}
        return self._checked(name, q.assemble_member(i, parts, proto.dtype, requires_grad=proto.requires_grad))

    def _get_members(self, name: str, members, verify: bool) -> torch.Tensor:
        """Members ``start`` .. ``stop - 1`` of a grouped tensor as a grouped tensor (of a plain tensor,
        those entries of its first dim), reading only their range of each buffer."""
        part, boxes = self._member_boxes(name, members)
        return self._assemble_members(name, part, {buf.name: self.read_region(name, buf, *boxes[buf.name],
                                                                              verify=verify)
                                                   for buf in self.pieces(name)})

    def _member_boxes(self, name: str, members) -> tuple[Any, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
        """(the quantizer of members ``start`` .. ``stop - 1`` of a grouped tensor as a group of their own,
        or None for a plain tensor; buffer → the box of their part in its region view)."""
        proto = self._protos[name]
        q = proto.quantizer
        try:
            start, stop = members
            if q is None:
                shape = tuple(proto.shape)
                if not shape or isinstance(start, bool) or isinstance(stop, bool) \
                        or not 0 <= start < stop <= shape[0]:
                    raise ShapeError(f"entries [{start}, {stop}) out of range: the first dim is "
                                     f"{shape[0] if shape else 'absent (0-d)'}")
                return None, {PLAIN_BUFFER: ((start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]))}
            if not getattr(q, "is_container", False):
                raise ShapeError(f"a {q.layout_name()} tensor is not grouped: it has no members")
            part, spans = q.member_span(start, stop)
        except (TypeError, ValueError, ShapeError) as e:
            raise CheckpointError(f"members={members!r}: {e if isinstance(e, ShapeError) else 'a (start, stop) pair'}",
                                  file=str(self.path), tensor=name) from None
        return part, {b: ((first,), (count,)) for b, (first, count) in spans.items()}

    def _assemble_members(self, name: str, part: Any, regions: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensor of :meth:`_member_boxes`' part from its buffers' regions (stored dtypes)."""
        proto = self._protos[name]
        if part is None:
            out = regions[PLAIN_BUFFER]
            return out.requires_grad_(True) if proto.requires_grad else out
        specs = part.describe_buffers(part.group_shape)
        parts = {b: t.view(specs[b].dtype) for b, t in regions.items()}
        return self._checked(name, part.tensor_class(part.group_shape, proto.dtype, part,
                                                      requires_grad=proto.requires_grad, **parts))

    def _get_slice(self, name: str, rows, cols, verify: bool) -> torch.Tensor:
        proto = self._protos[name]
        shape = tuple(proto.shape)
        if not shape:
            raise ShapeError(f"tensor {name!r} is 0-d; rows / cols need at least one dim")
        m, k = flatten_2d(shape)
        q = proto.quantizer
        bufs = self.pieces(name)
        if q is not None:
            boxes = buffer_regions(q, shape, rows, cols)  # alignment refused here (ShapeError)
            (r0, r1), (c0, c1) = range_bounds(rows, m, 1, "rows"), range_bounds(cols, k, 1, "cols")
        else:
            (r0, r1), (c0, c1) = range_bounds(rows, m, 1, "rows"), range_bounds(cols, k, 1, "cols")
            [buf] = bufs
            flat = []
            for pc in buf.pieces:  # plain pieces as ranges of rows × cols of [M, K]
                rc = box_to_range(shape, pc.offsets, pc.sizes)
                if rc is None:  # a chunk no range of rows × cols describes: read the tensor whole
                    return _slice_plain(self.get(name, verify=verify), shape, rows, cols, r0, r1, c0, c1)
                (a0, a1), (b0, b1) = rc  # the piece's bytes, in C order, are that block
                flat.append(pc._replace(array=(a1 - a0, b1 - b0), offsets=(a0, b0), sizes=(a1 - a0, b1 - b0)))
            bufs = [buf._replace(view=(m, k), pieces=flat)]
            boxes = {PLAIN_BUFFER: ((r0, c0), (r1 - r0, c1 - c0))}
        new_shape = (*shape[:-1], c1 - c0) if rows is None else (r1 - r0, c1 - c0)
        regions = {buf.name: self.read_region(name, buf, *boxes[buf.name], verify=verify) for buf in bufs}
        if q is None:
            out = regions[PLAIN_BUFFER].reshape(new_shape)
            return out.requires_grad_(True) if proto.requires_grad else out
        dtypes = {n: spec.dtype for n, spec in q.describe_buffers(new_shape).items()}
        pieces = {n: t.view(dtypes[n]) for n, t in regions.items()}
        return self._checked(name, q.tensor_class(new_shape, proto.dtype, q, requires_grad=proto.requires_grad,
                                                  **slice_from_regions(q, new_shape, pieces)))

    def load_tensors(self, names=None, device: str | torch.device = "cpu", *,
                     verify: bool = False, as_te: bool = False, mmap: bool = True) -> dict[str, torch.Tensor]:
        """Tensors by flat name (all by default), on ``device``; TE's own classes if ``as_te``.

        On CPU the buffers are views of the files' private mmaps (no copy); ``mmap=False`` reads
        them into fresh memory instead, so streaming through a checkpoint keeps no file pages."""
        device = torch.device(device)
        names = list(self.manifest.tensors) if names is None else list(names)
        copier = DeviceCopier(device) if device.type not in ("cpu", "meta") else None
        cache: dict = {}
        with gc_paused():  # many small objects at once
            out = {n: self._load(n, device, verify, copier, cache, mmap) for n in names}
        if copier is not None:
            copier.finish()
        if as_te:
            from ..te.interop import to_te
            converted: dict[int, Any] = {}  # keep tied tensors tied
            out = {n: converted.setdefault(id(t), to_te(t)) if isinstance(t, QuantizedTensorStorage) else t
                   for n, t in out.items()}
        return out

    def load(self, device: str | torch.device = "cpu", *, verify: bool = False, as_te: bool = False) -> Any:
        """The saved object with its structure: nested dicts, lists, tuples and plain values.

        In a non-strict load, a skipped tensor is left out of its dict and is None in a list or
        tuple; :attr:`missing` names them."""
        tree = self.manifest.tree
        if tree is None:
            return self.load_tensors(device=device, verify=verify, as_te=as_te)
        on_cpu = extra_state_refs(tree)  # TE's _extra_state is CPU bytes, whatever the device
        tensors = self.load_tensors([n for n in self.manifest.tensors if n not in on_cpu], device=device,
                                    verify=verify, as_te=as_te)
        if on_cpu:
            tensors.update(self.load_tensors([n for n in self.manifest.tensors if n in on_cpu], device="cpu",
                                             verify=verify))
        # one budget for all extra state, from the checkpoint's size (schema/README.md, bounds)
        nbytes = sum(self.manifest.files.values()) + (
            (self.path / MANIFEST_NAME).stat().st_size if self.path.is_dir() else self.path.stat().st_size)
        self.missing: list[str] = []
        return rebuild_tree(tree, tensors, budget=ExtraStateBudget(nbytes), missing=self.missing,
                            file=str(self.path))

    def verify(self) -> int:
        """Check every file's header against the manifest (one that holds no buffer too) and every
        buffer against its checksum; returns the number of buffers checked."""
        for name in self.manifest.files or [SELF_FILE]:
            self._file(name)
        checked = 0
        for name in self.manifest.tensors:
            if self.manifest.chunks and self.manifest.is_chunked(name):
                for b, _, _, pcs in self.manifest.pieces(name):
                    for f, k, _, _, c in pcs:
                        self._read_buffer(name, b, f, k, c, verify=True)
                        checked += 1
                continue
            for b, f, k, _, _, c in self.manifest.locations(name):
                self._read_buffer(name, b, f, k, c, verify=True)
                checked += 1
        return checked


def _slice_plain(t: torch.Tensor, shape, rows, cols, r0, r1, c0, c1) -> torch.Tensor:
    m, k = flatten_2d(tuple(shape))
    part = t.detach().reshape(m, k)[r0:r1, c0:c1]
    new_shape = (*tuple(shape)[:-1], c1 - c0) if rows is None else (r1 - r0, c1 - c0)
    out = part.contiguous().reshape(new_shape)
    return out.requires_grad_(True) if t.requires_grad else out


def open_checkpoint(path: str | os.PathLike, *, strict: bool = True) -> Checkpoint:
    """Open a checkpoint lazily: ``.protos``, ``.metadata``, ``.keys()``, ``.get(name, device=)``."""
    return Checkpoint(path, strict=strict)


def load_quantized(path: str | os.PathLike, *, device: str | torch.device = "cpu", strict: bool = True,
                   verify: bool = False, as_te: bool = False) -> Any:
    """Load what ``save_quantized`` saved: same structure, keys, dtypes and bytes, on ``device``.

    ``strict=False`` skips tensors whose entry cannot be rebuilt (e.g. a quantizer kind from a
    newer te-serial) instead of failing; ``verify=True`` checks every buffer's checksum;
    ``as_te=True`` returns Transformer Engine's own tensor classes (TE must be importable).
    """
    with Checkpoint(path, strict=strict) as ckpt:
        return ckpt.load(device=device, verify=verify, as_te=as_te)


def read_protos(path: str | os.PathLike, *, verify: bool = False) -> dict[str, TensorProto]:
    """name → TensorProto, reading only the manifest (no buffer is touched).

    The manifest is validated as ``open`` validates it, which keeps the per-buffer checksums column
    as bytes and checks it at the first read of a tensor (open speed: schema/README.md §8).
    ``verify=True`` checks that column here too (its schema rule, a checksum per stored buffer), so
    every flaw of the manifest is found without reading a buffer; ``te_serial.verify`` also checks
    the buffers' bytes against it."""
    with Checkpoint(path) as ckpt:
        if verify:
            ckpt.manifest.checksums  # noqa: B018 - decoded and checked on first use
        return dict(ckpt.protos)


def verify(path: str | os.PathLike) -> int:
    """Validate a checkpoint completely (schema, headers, checksums); returns buffers checked."""
    with Checkpoint(path) as ckpt:
        return ckpt.verify()
