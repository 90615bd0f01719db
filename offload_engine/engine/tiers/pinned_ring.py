"""One fixed pinned buffer, handed out in first-in-first-out regions, for host-tier prefill traffic and the moves'
index lists. When full, the oldest regions are waited for and reused: the ring never grows, and that wait bounds how
far host writes fall behind the device. One thread only.
Why: docs/decisions/tier-moves.md, "The pinned ring for host-tier prefill traffic".
"""
import math
from collections import deque

import numpy as np
import torch

RING_BYTES = 512 << 20
ALIGN = 256


class PinnedRing:
    def __init__(self, nbytes: int = RING_BYTES, pin: bool = True):
        self.pin = pin
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.capacity = nbytes
        self.head = 0
        self.regions: deque[list] = deque()  # [start, end, done], oldest first; they lie between tail and head

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list | None]:
        """A pinned tensor of shape and its region (pass it to busy_until). Larger than the whole ring: a
        one-off pinned tensor, and None for its region."""
        size = dtype.itemsize * math.prod(shape)
        nbytes = -(-size // ALIGN) * ALIGN
        if nbytes > self.capacity:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin), None
        start = self._fit(nbytes)
        while start is None:
            self._retire_oldest()
            start = self._fit(nbytes)
        region = [start, start + nbytes, None]
        self.regions.append(region)
        self.head = start + nbytes
        view = self.buffer[start : start + size].view(dtype).view(shape)
        return view, region

    def upload(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        """`array` on `device`, copied through the ring on the current stream without waiting for the stream."""
        host, region = self.take(array.shape, torch.from_numpy(array[:0]).dtype)
        host.numpy()[...] = array
        on_device = host.to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.busy_until(region, copied)
        return on_device

    @staticmethod
    def busy_until(region: list | None, done) -> None:
        """The region stays taken until `done` (a torch.cuda.Event or a Future) completes."""
        if region is not None:
            region[2] = done

    def drain(self) -> None:
        while self.regions:
            self._retire_oldest()

    def _fit(self, nbytes: int) -> int | None:
        if not self.regions:
            self.head = 0
            return 0
        tail = self.regions[0][0]
        if self.head > tail:  # taken: [tail, head); free: [head, capacity) and [0, tail)
            if self.head + nbytes <= self.capacity:
                return self.head
            return 0 if nbytes <= tail else None
        return self.head if self.head + nbytes <= tail else None  # wrapped: free is [head, tail)

    def _retire_oldest(self) -> None:
        _, _, done = self.regions.popleft()
        if isinstance(done, torch.cuda.Event):
            done.synchronize()
        elif done is not None:
            done.exception()  # waits; a failed write reports itself (ModelRunner.check_host_writes)

