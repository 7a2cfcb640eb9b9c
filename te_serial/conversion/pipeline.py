"""Three-stage streaming: read the next tensor, convert this one and write the previous one at once.

Reading (``preadv`` / page faults) and writing (``pwrite``, hashing) release the GIL, and so do
torch's kernels, so the three stages overlap on separate threads. One item is read ahead and one
write is in flight, so memory stays bounded by a few tensors, whatever the checkpoint's size.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

__all__ = ["run_pipeline"]

T = TypeVar("T")


def run_pipeline(items: Sequence[T], read: Callable[[T], object], compute: Callable[[T, object], object],
                 write: Callable[[T, object], None], *, threads: bool = True) -> None:
    """For each item in order: ``read(item)`` on a reader thread, ``compute(item, data)`` on the
    caller's thread, ``write(item, result)`` on a writer thread (writes stay in order).

    The first exception of any stage is raised here, after both threads have stopped (the reader
    is not asked for more, the write in flight finishes), so the caller can clean up its files.
    ``threads=False`` runs the stages one after another on the caller's thread.
    """
    if not threads:
        for item in items:
            write(item, compute(item, read(item)))
        return
    with ThreadPoolExecutor(1, thread_name_prefix="te-serial-read") as reader, \
            ThreadPoolExecutor(1, thread_name_prefix="te-serial-write") as writer:
        ahead: Future | None = reader.submit(read, items[0]) if items else None
        pending: Future | None = None
        try:
            for i, item in enumerate(items):
                data = ahead.result()
                ahead = reader.submit(read, items[i + 1]) if i + 1 < len(items) else None
                result = compute(item, data)
                del data
                if pending is not None:
                    pending.result()        # one write in flight: memory stays bounded
                pending = writer.submit(write, item, result)
                del result
            if pending is not None:
                pending.result()
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
