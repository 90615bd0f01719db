"""Host-tier prefill K/V written by the device straight into the pinned host pool, whole host blocks only (those whose
first token is in the step, unused rows zeroed), so no KV already in the pool is overwritten; the other tokens take the
executor's path. Why: docs/decisions/host-prefill.md, "The device writes whole host blocks"."""
from dataclasses import dataclass

import numpy as np
import torch

from gpu_kernels.host_block_copies import write_host_blocks_whole


@dataclass
class HostBlockWrites:
    # Row r of block j holds the step's token token_rows[j * block_size + r]; -1: a zeroed padding row.
    token_rows: torch.Tensor  # device int64 [blocks * block_size]
    targets: torch.Tensor  # device int64 [blocks]: host-pool block ids, in the order of token_rows


def plan_host_block_writes(host_slots: np.ndarray, block_size: int) -> tuple[tuple | None, np.ndarray]:
    """host_slots: each of the step's tokens' host-pool slot (-1: not host-tier) -> ((token_rows, targets) as host
    arrays, or None where no block is written whole; the indices of the host-tier tokens left for the executor)."""
    tokens = np.flatnonzero(host_slots >= 0)
    slots = host_slots[tokens]
    blocks = slots // block_size
    whole = np.unique(blocks[slots % block_size == 0])
    if not whole.size:
        return None, tokens
    direct = np.isin(blocks, whole)
    rows = np.searchsorted(whole, blocks[direct]) * block_size + slots[direct] % block_size
    token_rows = np.full(whole.size * block_size, -1, dtype=np.int64)
    token_rows[rows] = tokens[direct]
    return (token_rows, whole.astype(np.int64)), tokens[~direct]


def write_host_blocks(k: torch.Tensor, v: torch.Tensor, writes: HostBlockWrites, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, stream=None) -> None:
    """k/v [T, Hkv, D] -> the whole blocks of `writes` in k_pool/v_pool [blocks, Hkv, block_size, D] (the host pool as
    the device addresses it; the pool itself off CUDA). On CUDA one kernel, on `stream` after the layer's stream."""
    if k.is_cuda:
        current = torch.cuda.current_stream(k.device)
        with torch.cuda.stream(stream or current):
            if stream is not None:
                stream.wait_stream(current)
            write_host_blocks_whole(k, v, k_pool, v_pool, writes.token_rows, writes.targets)
        if stream is not None:  # the allocator keeps them until the kernel has read them
            for t in (k, v, writes.token_rows, writes.targets):
                t.record_stream(stream)
        return
    num_blocks, num_kv_heads, block_size, head_dim = writes.targets.numel(), *k_pool.shape[1:]
    for source, pool in ((k, k_pool), (v, v_pool)):
        rows = source.index_select(0, writes.token_rows.clamp(min=0))
        rows[writes.token_rows < 0] = 0  # padding (off CUDA: a mask costs no sync)
        pool.index_copy_(0, writes.targets,
                         rows.view(num_blocks, block_size, num_kv_heads, head_dim).transpose(1, 2).contiguous())
