"""One fixed pinned buffer, handed out in first-in-first-out regions, for host-tier prefill traffic.

A host-tier prefill step sends every layer's new K/V to the host (written into the pool on the executor, not
waited for) and may stage cached prefix blocks back. Fresh pinned tensors for these, in sizes that change
every step and many in flight at once, made torch's pinned-memory cache grow by 0.1-0.25 GiB per 1,000
requests without levelling off (benchmarks/bench_load.py, H100, 2026-11-22): the cache keeps whatever peak
it has seen, in every size. The ring never grows: a region is taken at the head, and when the ring is full
the oldest regions are waited for (their host write, or the copy that reads them) and reused. That wait is
also the backpressure that bounds how far host writes may fall behind the device.

The moves between the tiers upload their index lists through it too (`upload`): a copy from pageable memory
may make the host wait for the stream to drain first, and a promotion or demotion that waited so would let the
device lane's queue of steps run dry. (Not measured apart from the other changes to the moves.)

Used from the engine's thread only (prefill, promotions and demotions run there).
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
        self.head = 0  # where the next region starts
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

