"""Host-to-device copies of the worker's steering buffers, staged in one pinned ring (see :class:`Uploader`)."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["Uploader"]


class Uploader:
    """Host-to-device copies that neither stall the CPU on the GPU nor pin memory per copy: values are staged in
    a pinned ring, and a region of it is written again only once the copy that read it has run (an event per
    copy; the CPU waits only if the ring comes round before the GPU got there). On a CPU device: plain copies."""

    ALIGN = 64

    def __init__(self, device: torch.device, ring_bytes: int = 1 << 22):
        self.device = device
        self.cuda = device.type == "cuda"
        self._ring = torch.empty(ring_bytes if self.cuda else 0, dtype=torch.uint8, pin_memory=self.cuda)
        self._head = 0
        # Per copy the GPU may not have run yet: (event, start, end) of its ring region, or (event, 0, 0) and the
        # pinned copy of its own to keep alive.
        self._inflight: deque[tuple[Any, int, int, torch.Tensor | None]] = deque()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A new device tensor holding ``host``'s values (for ``index_copy_`` sources)."""
        if not self.cuda:
            return host
        staged, region = self._stage(host)
        out = staged.to(self.device, non_blocking=True)
        self._record(region)
        return out

    def copy_(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """``dst.copy_(host)``, one host-to-device copy straight into ``dst``."""
        if not self.cuda:
            dst.copy_(host)
            return
        staged, region = self._stage(host)
        dst.copy_(staged, non_blocking=True)
        self._record(region)

    def _stage(self, host: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, torch.Tensor | None]]:
        """A pinned copy of ``host`` and what keeps it valid until the GPU read it: ``(start, end, None)`` in the
        ring, or ``(0, 0, copy)`` for a copy of its own."""
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()
        size = -(-host.numel() * host.element_size() // self.ALIGN) * self.ALIGN
        if size > len(self._ring):  # larger than the ring (a big batch of bank writes): a pinned copy of its own
            pinned = host.pin_memory()
            return pinned, (0, 0, pinned)
        start = self._head if self._head + size <= len(self._ring) else 0
        end = self._head = start + size
        for event, a, b, _ in self._inflight:
            if a < end and start < b:  # the ring came round to a copy the GPU has not run yet
                event.synchronize()
        staged = self._ring[start : start + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        return staged.copy_(host), (start, end, None)

    def _record(self, region: tuple[int, int, torch.Tensor | None]) -> None:
        event = torch.cuda.Event()
        event.record()
        self._inflight.append((event, *region))
