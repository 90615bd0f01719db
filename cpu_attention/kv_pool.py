"""The host KV tier's memory: per-layer head-major K and V tensors in one mapping, pinned when CUDA is present.

Layout `[num_blocks, Hkv, block_size, D]`. Pinned memory cannot be swapped out, so the pool is sized against what
the host can spare (`psutil`). The mapping asks for transparent huge pages (a 2 MiB page faults in and locks in one
go) and pins in chunks on threads (host_pinning.py) until `wait_pinned()`; nothing copies into it by DMA before the
engine's first step. `device_stacked()` is the same memory as a CUDA tensor, read and written over PCIe by
kernels. Release order: the registration goes before the memory, or the next mapping at that address cannot be
pinned; `close()` (or a finalizer) unpins at once, and the mapping is freed with its last view.
"""
import math
import mmap
import weakref

import psutil
import torch

GiB = 1 << 30


def host_bytes_to_spare() -> int:
    """Available RAM minus headroom for the process and the OS (the larger of 4 GiB and 10% of RAM)."""
    memory = psutil.virtual_memory()
    return max(0, memory.available - max(4 * GiB, memory.total // 10))


def host_pool_blocks(bytes_per_block: int, num_blocks: int | None, kv_cache_gb: float | None,
                     wanted_blocks: int) -> int:
    """Blocks for the host pool: as asked (num_blocks or kv_cache_gb), else up to half of what is spare."""
    spare = host_bytes_to_spare() // bytes_per_block
    if num_blocks is None and kv_cache_gb is None:
        return max(1, min(wanted_blocks, spare // 2))
    asked = num_blocks if num_blocks is not None else int(kv_cache_gb * GiB) // bytes_per_block
    if asked > spare:
        raise ValueError(
            f"the host KV pool would need {asked * bytes_per_block / GiB:.1f} GiB but this host can spare only "
            f"{spare * bytes_per_block / GiB:.1f} GiB: lower num_cpu_blocks / cpu_kv_cache_gb")
    return max(1, asked)


class HostKVPool:
    """K and V tensors for every layer; `pin_device` (a CUDA device) page-locks them for that device's copies."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, pin_device: torch.device | None = None):
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        per_tensor = math.prod(shape)
        memory = mmap.mmap(-1, max(1, 2 * num_layers * per_tensor * dtype.itemsize),
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        flat = torch.frombuffer(memory, dtype=dtype)  # the tensors keep the mapping alive, not this object
        views = [flat[i * per_tensor : (i + 1) * per_tensor].view(shape) for i in range(2 * num_layers)]
        self.layers = list(zip(views[0::2], views[1::2]))
        # The same memory as one [L, 2, blocks, Hkv, block_size, D] tensor: a whole host step's kernel
        # (layer_loop.py) takes every layer's K and V in one argument.
        self.stacked = flat.view(num_layers, 2, *shape)
        self.nbytes = 2 * num_layers * per_tensor * dtype.itemsize
        self._pinning = None
        if pin_device is not None and self.nbytes:
            from cpu_attention.host_pinning import HostPinning

            index = pin_device.index or 0  # named by index, as the engine names its GPU: never the current one
            self._pinning = HostPinning(flat.data_ptr(), self.nbytes, index)
        self._flat, self._device_stacked = flat, {}
        # The finalizer holds the flat tensor, so the memory cannot be freed before it has been unpinned.
        self._finalizer = weakref.finalize(self, _unpin, self._pinning, flat)

    @property
    def pinned(self) -> bool:
        return self._pinning is not None and bool(self._pinning.registered)

    def wait_pinned(self) -> float:
        """Blocks until pinning has finished; returns the seconds it took (0 when not pinned)."""
        return self._pinning.wait() if self._pinning is not None else 0.0

    @property
    def device_can_address(self) -> bool:
        """Whether device_stacked() is (or, once pinning ends, will be) available: known before pinning ends."""
        return self._pinning is not None and bool(self._pinning.driver.can_use_host_pointer(self._pinning.device_index))

    def device_stacked(self, device_index: int | None = None) -> torch.Tensor | None:
        """`stacked` as a CUDA tensor over this pinned memory on device `device_index` (default: the pinning
        device; the pinning is portable, so another GPU of the process may address it too), or None where that is
        not possible (not pinned, or a device that cannot use the host pointer). It owns nothing: valid until
        close()."""
        index = self._pinning.device_index if device_index is None and self._pinning else device_index
        if index not in self._device_stacked and self.pinned and self._pinning.driver.can_use_host_pointer(index):
            self._device_stacked[index] = cuda_alias(self._flat, index).view(self.stacked.shape)
        return self._device_stacked.get(index)

    def close(self) -> None:
        """Unpins now (idempotent); the memory goes once nothing else holds a view of it."""
        self._device_stacked, self._flat = {}, None
        self._finalizer()
        self.layers, self.stacked = [], None


def cuda_alias(tensor: torch.Tensor, device_index: int) -> torch.Tensor:
    """A CUDA tensor at the same address as the pinned host tensor (through __cuda_array_interface__)."""

    class _Interface:
        __cuda_array_interface__ = {"shape": (tensor.numel() * tensor.element_size(),), "typestr": "|u1",
                                    "data": (tensor.data_ptr(), False), "version": 3, "strides": None}

    alias = torch.as_tensor(_Interface(), device=torch.device("cuda", device_index))
    return alias.view(tensor.dtype)


def _unpin(pinning, _flat) -> None:
    if pinning is not None:
        pinning.release()
