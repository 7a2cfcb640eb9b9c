"""The bounds on decoding extra state: fixed per-payload limits, and the work and bytes budget that
all ``_extra_state`` entries of one checkpoint share (see the package's Bounds for the why)."""

from __future__ import annotations

from typing import Optional

from .errors import UnsafeExtraStateError

MAX_PAYLOAD_BYTES = 64 << 20
"""Largest extra-state payload accepted (a 256-GEMM GroupedLinear's amax histories are ~5 MiB)."""
MAX_STORAGE_BYTES = 64 << 20
"""Largest single storage accepted."""
MAX_DEPTH = 32
"""Deepest container nesting accepted in the decoded value."""
MAX_NODES = 1_000_000
"""Most values (counting shared ones each time they are reachable) in one decoded value."""
MAX_STACK = 100_000
MAX_MARKS = 64
MAX_MEMO = 65_536
MAX_INT_BITS = 1024
MAX_NDIM = 32
MAX_ZIP_ENTRIES = 1024
"""Most entries in a zip-format ``torch.save`` payload (TE 1.x wrote fewer than 20)."""

MAX_WORK = 2_000_000
"""Most work units (opcodes + values) for all extra state of one checkpoint."""
MAX_PAYLOAD_WORK = 1 << 18
"""Most work units one payload's decode may spend (a TE payload needs a few thousand)."""
WORK_SLACK = 1 << 16
WORK_BYTES_PER_UNIT = 4
BYTES_FACTOR = 2
BYTES_SLACK = 16 << 20


class ExtraStateBudget:
    """Work and bytes that all ``_extra_state`` entries of one checkpoint may spend together.

    ``file_bytes`` is the checkpoint's size (manifest + buffer files). Work (pickle opcodes
    interpreted, values checked / converted / rebuilt) is bounded by
    ``min(MAX_WORK, WORK_SLACK + file_bytes // WORK_BYTES_PER_UNIT)``; bytes (tensor bytes
    materialized by the decoder, storage bytes it copies, encoded payloads) by
    ``BYTES_FACTOR * file_bytes + BYTES_SLACK``. Exceeding either raises
    :class:`UnsafeExtraStateError` before the memory is allocated.
    """

    __slots__ = ("file_bytes", "max_work", "max_bytes", "work", "bytes")

    def __init__(self, file_bytes: int) -> None:
        f = max(0, int(file_bytes))
        self.file_bytes = f
        self.max_work = min(MAX_WORK, WORK_SLACK + f // WORK_BYTES_PER_UNIT)
        self.max_bytes = BYTES_FACTOR * f + BYTES_SLACK
        self.work = 0
        self.bytes = 0

    def __repr__(self) -> str:
        return (f"ExtraStateBudget(file_bytes={self.file_bytes}, work={self.work}/{self.max_work}, "
                f"bytes={self.bytes}/{self.max_bytes})")

    def exhausted(self, where: Optional[str]) -> UnsafeExtraStateError:
        return UnsafeExtraStateError(
            f"TE extra state: over its budget of {self.max_work} steps (pickle opcodes and value "
            f"nodes; checkpoint of {self.file_bytes} bytes)", tensor=where)

    def spend(self, units: int, where: Optional[str]) -> None:
        self.work += units
        if self.work > self.max_work:
            raise self.exhausted(where)

    def spend_bytes(self, n: int, where: Optional[str], what: str = "") -> None:
        self.bytes += n
        if self.bytes > self.max_bytes:
            raise UnsafeExtraStateError(
                f"TE extra state: {what + ' ' if what else ''}would take the checkpoint's extra "
                f"state past {self.max_bytes} bytes (2 x its {self.file_bytes} bytes + 16 MiB)",
                tensor=where)
