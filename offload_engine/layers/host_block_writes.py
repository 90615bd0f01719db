"""Host-tier prefill K/V written by the device straight into the pinned host pool, a whole host block at a time.

A host-tier prompt's K/V are computed on the device and belong in the host pool. They used to cross every layer
to the pinned ring, where numba scattered them into the pool on the executor. The executor is the host lane's
one worker, and a host step holds it from start to end. So once the ring was full (two 2k-token prompts at the
0.6B shape), a prefill could wait for the host step in flight and then for the scatter. 15 host-tier prompts added
1.16 s of prefill to a 9.4 s run (0.6B, 64 x (2048 + 256) at 576 blocks: 1.73 s against gpu's 0.57, ~77 ms a
prompt against ~9). Written this way, 16 such prompts added 0.58 s (1.11 against 0.53; H100 host, 2026-11-23,
benchmarks/results/nvidia-h100-80gb-hbm3/prefill_writes_b576_*.json). What is left is what placement's check now
counts (LaneStats.prefill_done).

Where the device can address the pinned pool (HostKVPool.device_stacked), the prefill writes the pool itself,
as demotion does (engine/tiers/kv_demotion.py): one kernel a layer (kernels.write_host_blocks_whole) writes its tokens
across PCIe into head-major host blocks, on the prefill-writes stream, beside the next layers. Nothing on the
host takes part. Readers of those blocks wait for the step's event (ModelRunner._wait_direct_writes). The kernel
replaced a layout on the device and an index_copy_ (~14 torch calls a layer): at the 0.6B shape, whose prefill is
launch-bound, a 1,024-token host-tier prompt's step took ~14 ms longer than a device-tier one's (36 against 16 ms
alone; H100 host, 2026-11-24, benchmarks/probe_host_prefill.py --isolated).

Only blocks whose first token is in the step are written this way: the rest of such a block holds no KV yet, so
it can be written whole, its unused rows zeroed. The tokens of a block an earlier step began (a prompt's chunk
that starts mid-block) take the executor's path, so no KV already in the pool is overwritten.
"""
from dataclasses import dataclass

import numpy as np
import torch

from kernels.host_block_copies import write_host_blocks_whole


@dataclass
class HostBlockWrites:
    """A step's host blocks that the device writes whole: row r of block j is the step's token token_rows[j * block
    size + r], or a zeroed padding row."""

    token_rows: torch.Tensor  # device int64 [blocks * block_size]: the step's token (k/v row) per row, -1: padding
    targets: torch.Tensor  # device int64 [blocks]: host-pool block ids, in the order of token_rows


def plan_host_block_writes(host_slots: np.ndarray, block_size: int) -> tuple[tuple | None, np.ndarray]:
    """host_slots: the host-pool slot of each token of the step (-1: not host-tier). -> ((token_rows, targets) as
    host arrays, or None where no block is written whole; the indices of the host-tier tokens left for the
    executor's path)."""
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
    """k/v [T, Hkv, D] of the step -> the whole blocks of `writes` in k_pool/v_pool [blocks, Hkv, block_size, D]
    (the host pool as the device addresses it, or the host pool itself off CUDA). On CUDA one kernel a layer
    (kernels.write_host_blocks_whole) on `stream`, which waits for the layer's stream first."""
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
