"""The host KV tier's memory: per-layer head-major K and V tensors, pinned when CUDA is present.

Layout `[num_blocks, Hkv, block_size, D]`: one (block, head) is one contiguous run of block_size * D values
that a host thread streams (see decode.py). Pinned memory cannot be swapped out, so the pool is sized
against what the host can spare (`psutil`), never more; a request beyond that is refused up front.
"""
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
    """K and V tensors for every layer; `pin=True` page-locks them in place (exact size, no rounding up)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, pin: bool):
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.layers = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(num_layers)]
        self.pinned = pin and _register_all(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def close(self) -> None:
        if self.pinned:
            for tensor in (t for pair in self.layers for t in pair):
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            self.pinned = False
        self.layers = []


def _register_all(layers) -> bool:
    """cudaHostRegister on the plain allocations: torch's pinned allocator would round each up to a power of
    two, which for a pool of tens of GiB wastes up to half of the memory it locks."""
    cudart = torch.cuda.cudart()
    for tensor in (t for pair in layers for t in pair):
        if tensor.nbytes and int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)) != 0:
            raise OSError("cudaHostRegister failed while pinning the host KV pool: lower cpu_kv_cache_gb")
    return True
