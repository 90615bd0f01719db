"""Copies promoted sequences' KV from host blocks into new device blocks: `read_mapped` where the device addresses
the pinned pool, else `copy_to_device`, staged (docs/design.md, "Moves between the tiers")."""
from collections import deque

import numpy as np
import torch

from cpu_attention.gather import gather_blocks
from gpu_kernels.host_block_copies import gather_host_blocks
from offload_engine.engine.sequence import Sequence
from offload_engine.engine.tiers.move_staging import GROUP_BYTES, MoveStaging, split_moves
from offload_engine.engine.tiers.slots import host_copy_plan


def read_mapped(moves: list[tuple[Sequence, list[int]]], mapped_stacked: torch.Tensor, device_stacked: torch.Tensor,
                device_block_size: int, upload=None) -> None:
    """moves as copy_to_device's; mapped_stacked: the host pool as a device tensor, [L, 2, blocks, Hkv, host block
    size, D]; device_stacked [L, 2, blocks, block_size, Hkv, D]. Queues one kernel on the current stream: the host
    blocks must not be written before it has run. upload: PinnedRing.upload (by default a plain copy)."""
    device = device_stacked.device
    upload = upload or (lambda array: torch.from_numpy(array).to(device))
    sources, rows, slots = map(upload, _plan(moves, mapped_stacked.shape[4], device_block_size))
    gather_host_blocks(mapped_stacked, device_stacked.flatten(2, 3), sources, rows, slots)


def _plan(moves, host_block_size: int, device_block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host blocks to read in order, each moved token's row among them, and its new device slot."""
    return host_copy_plan([(seq.num_computed_tokens, host_blocks, seq.block_table) for seq, host_blocks in moves],
                          host_block_size, device_block_size)


def _store_tokens(token_slots: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """token_slots [layers, 2, slots, Hkv, D] at `slots` <- the tokens at `rows` (_plan's) of the gathered host
    blocks [layers, 2, blocks, Hkv, host block size, D]."""
    count, _, _, num_kv_heads, _, head_dim = blocks.shape
    tokens = blocks.transpose(3, 4).reshape(count, 2, -1, num_kv_heads, head_dim).index_select(2, rows)
    token_slots.index_copy_(2, slots, tokens)


def copy_to_device(moves: list[tuple[Sequence, list[int]]], host_layers, device_stacked: torch.Tensor, executor,
                   device_block_size: int, staging: MoveStaging) -> None:
    """moves: (sequence, the host blocks holding its KV); each sequence's `block_table` already names its device
    blocks and `num_computed_tokens` says how many tokens have KV. Returns once the host blocks are read."""
    block = host_layers[0][0][0]
    for batch in split_moves(moves, block.shape[1], 2 * block.numel() * block.element_size()):
        _copy_batch(batch, host_layers, device_stacked, executor, device_block_size, staging)


def _copy_batch(moves, host_layers, device_stacked: torch.Tensor, executor, device_block_size: int,
                staging: MoveStaging) -> None:
    _, num_kv_heads, host_block_size, head_dim = host_layers[0][0].shape
    device = device_stacked.device
    sources, rows, slots = _plan(moves, host_block_size, device_block_size)
    source = torch.from_numpy(sources)
    rows = torch.from_numpy(rows).to(device, non_blocking=True)
    slots = torch.from_numpy(slots).to(device, non_blocking=True)
    token_slots = device_stacked.flatten(2, 3)  # [L, 2, blocks * block_size, Hkv, D]
    block_shape = (len(sources), num_kv_heads, host_block_size, head_dim)
    layer_bytes = 2 * host_layers[0][0].element_size() * int(np.prod(block_shape))
    group = max(1, GROUP_BYTES // max(1, layer_bytes))
    # Two groups in flight: the executor gathers the next group while this one crosses PCIe and is stored.
    pending = deque()
    for first in range(0, len(host_layers), group):
        if len(pending) == 2:
            _store_group(*pending.popleft(), token_slots, rows, slots, staging)
        layers = range(first, min(first + group, len(host_layers)))
        slot, host_buffer, device_buffer = staging.take((len(layers), 2, *block_shape), host_layers[0][0].dtype)
        gathered = executor.submit(_gather_layers, host_layers, layers, source, host_buffer)
        pending.append((layers, slot, host_buffer, device_buffer, gathered))
    while pending:
        _store_group(*pending.popleft(), token_slots, rows, slots, staging)


def _store_group(layers: range, slot: int, host_buffer, device_buffer, gathered, token_slots, rows, slots,
                 staging: MoveStaging) -> None:
    gathered.result()
    device_buffer.copy_(host_buffer, non_blocking=True)
    if device_buffer.device.type == "cuda":
        crossed = torch.cuda.Event()
        crossed.record()
        staging.busy_until(slot, crossed)
    _store_tokens(token_slots[layers.start : layers.stop], device_buffer, rows, slots)


def _gather_layers(host_layers, layers: range, source: torch.Tensor, staged: torch.Tensor) -> None:
    for i, layer in enumerate(layers):
        for j, cache in enumerate(host_layers[layer]):
            gather_blocks(cache, source, staged[i, j])
