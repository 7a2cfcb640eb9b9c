"""Three-stage streaming: read the next tensor, convert this one and write earlier ones at once.

Reading (``preadv`` / page faults) and writing (``pwrite``, hashing) release the GIL, and so do
torch's kernels, so the three stages overlap on separate threads. One item is read ahead, and the
writes in flight are bounded in bytes, so memory stays bounded by a few tensors, whatever the
checkpoint's size.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def run_pipeline(items: Sequence[T], read: Callable[[T], object], compute: Callable[[T, object], object],
                 write: Callable[[T, object], None], *, threads: bool = True,
                 size: Callable[[T], int] | None = None, write_budget: int = 0) -> None:
    """For each item in order: ``read(item)`` on a reader thread, ``compute(item, data)`` on the
    caller's thread, ``write(item, result)`` on a writer thread (writes stay in order).

    Results wait for the writer while their ``size(item)`` sum stays within ``write_budget``
    bytes (one is always let through): a large tensor's write then overlaps the computing of the
    small ones after it rather than stalling it. Without ``size``, one write is in flight.

    The first exception of any stage is raised here, after both threads have stopped (the reader
    is not asked for more, the writes already handed over finish, none after a failed one runs),
    so the caller can clean up its files. ``threads=False`` runs the stages one after another on the
    caller's thread.
    """
    if not threads:
        for item in items:
            write(item, compute(item, read(item)))
        return
    failed = threading.Event()

    def write_in_order(item: T, result: object) -> None:
        if failed.is_set():
            return  # an earlier write failed: nothing after it is written
        try:
            write(item, result)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(1, thread_name_prefix="te-serial-read") as reader, \
            ThreadPoolExecutor(1, thread_name_prefix="te-serial-write") as writer:
        ahead: Future | None = reader.submit(read, items[0]) if items else None
        pending: deque[tuple[Future, int]] = deque()
        held = 0
        try:
            for i, item in enumerate(items):
                data = ahead.result()
                ahead = reader.submit(read, items[i + 1]) if i + 1 < len(items) else None
                result = compute(item, data)
                del data
                nbytes = size(item) if size is not None else write_budget + 1
                while pending and (held + nbytes > write_budget or pending[0][0].done()):
                    done, n = pending.popleft()
                    done.result()           # the oldest write; its error, if any, is raised here
                    held -= n
                pending.append((writer.submit(write_in_order, item, result), nbytes))
                held += nbytes
                del result
            while pending:
                pending.popleft()[0].result()
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
