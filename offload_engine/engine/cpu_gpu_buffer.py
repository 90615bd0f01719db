"""A pinned host tensor and its device twin, written through a numpy view and copied with one non-blocking copy.

A step's inputs are made on the host. Fresh `pin_memory()` tensors per step cost an allocation each (and a
cudaHostAlloc whenever torch's pinned cache has no block of that size); these buffers are made once. The host
side is double-buffered: with async scheduling the next step's inputs are written while the copy of this step's
may not have run yet (its copy sits in the stream behind the step before), so consecutive steps alternate
between the two host halves. The device twin is single: copies into it are ordered on the stream after the step
that last read it.
"""
import numpy as np
import torch

HOST_COPIES = 2  # one step's inputs being written while the previous step's copy may still be queued


class CpuGpuBuffer:
    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device, fill=0):
        pin = device.type == "cuda"
        self.device = torch.full(shape, fill, dtype=dtype, device=device)
        self.hosts = [torch.full(shape, fill, dtype=dtype).pin_memory() if pin else torch.full(shape, fill, dtype=dtype)
                      for _ in range(HOST_COPIES)]
        self.numpys = [host.numpy() for host in self.hosts]

    def host(self, parity: int) -> np.ndarray:
        """The numpy view of one host half (parity: the step's number mod HOST_COPIES)."""
        return self.numpys[parity]

    def copy_to_device(self, parity: int, count: int) -> torch.Tensor:
        """Copies the first `count` entries (rows) of host half `parity` to the device; returns that device view."""
        view = self.device[:count]
        view.copy_(self.hosts[parity][:count], non_blocking=True)
        return view
