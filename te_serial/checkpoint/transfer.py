"""Host → device copies for loading: pinned staging, non-blocking, double-buffered.

The file's mmap'd pages cannot be pinned, so each buffer goes through one of two reusable
pinned chunks: while chunk A's copy to the GPU runs, chunk B is being filled from the file.
"""

from __future__ import annotations

import torch


class DeviceCopier:
    """Copies CPU tensors into same-shaped tensors on ``device``; call :meth:`finish` at the end."""

    CHUNK_BYTES = 64 << 20

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stages: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _stage(self) -> tuple[torch.Tensor, int]:
        if not self._stages:
            self._stages = [torch.empty(self.CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
        i = self._turn
        self._turn ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy that last used this chunk is done
        return self._stages[i], i

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self._cuda:
            dst.copy_(src)
            return
        s = src.reshape(-1).view(torch.uint8)
        d = dst.view(-1).view(torch.uint8)
        for off in range(0, s.numel(), self.CHUNK_BYTES):
            n = min(self.CHUNK_BYTES, s.numel() - off)
            stage, i = self._stage()
            stage[:n].copy_(s[off:off + n])
            d[off:off + n].copy_(stage[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[i] = event

    def finish(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
