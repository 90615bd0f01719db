"""Copies demoted sequences' KV from device blocks into new host blocks: `write_mapped` where the device addresses
the pinned pool, else `copy_to_host`, staged (docs/design.md, "Moves between the tiers")."""
import numpy as np
import torch

from cpu_attention.gather import scatter_blocks
from gpu_kernels.host_block_copies import scatter_host_blocks
from offload_engine.engine.sequence import Sequence
from offload_engine.engine.tiers.move_staging import GROUP_BYTES, MoveStaging, split_moves
from offload_engine.engine.tiers.slots import host_copy_plan, slots_for


def copy_to_host(moves: list[tuple[Sequence, list[int]]], device_stacked: torch.Tensor, host_layers, executor,
                 device_block_size: int, staging: MoveStaging) -> list:
    """moves: (sequence, the device blocks holding its KV); each sequence's `block_table` already names its host
    blocks. Returns the executor futures of the host writes, which nothing need wait for (ExecutorWrites)."""
    block = host_layers[0][0][0]
    batches = split_moves(moves, block.shape[1], 2 * block.numel() * block.element_size())
    return [write for batch in batches
            for write in _copy_batch(batch, device_stacked, host_layers, executor, device_block_size, staging)]


def write_mapped(moves: list[tuple[Sequence, list[int]]], device_stacked: torch.Tensor, mapped_stacked: torch.Tensor,
                 device_block_size: int, upload=None, first_blocks=(), between=None) -> None:
    """moves as copy_to_host's; device_stacked [L, 2, blocks, block_size, Hkv, D]; mapped_stacked: the host pool
    as a device tensor, [L, 2, blocks, Hkv, host block size, D]. The tokens in `first_blocks` cross in one kernel,
    then between() runs (if there were any), then the rest in another, all queued on the current stream: nothing
    may read the host blocks, nor write the device blocks, before they have run. upload: PinnedRing.upload."""
    device = device_stacked.device
    upload = upload or (lambda array: torch.from_numpy(array).to(device))
    targets, rows, slots = host_copy_plan([(seq.num_computed_tokens, seq.block_table, device_blocks)
                                           for seq, device_blocks in moves], mapped_stacked.shape[4], device_block_size)
    first = np.isin(slots // device_block_size, np.asarray(first_blocks, dtype=np.int64))
    token_slots = device_stacked.flatten(2, 3)  # [L, 2, blocks * block_size, Hkv, D]
    targets = upload(targets)
    if first.any():
        scatter_host_blocks(mapped_stacked, token_slots, targets, upload(rows[first]), upload(slots[first]))
        if between is not None:
            between()
    if not first.all():
        scatter_host_blocks(mapped_stacked, token_slots, targets, upload(rows[~first]), upload(slots[~first]))


def _plan(moves, host_block_size: int, device_block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every row of the host blocks written, in order, the device slot it is read from (a padding row reads
    its sequence's first slot, and is then zeroed); the padding rows; the host blocks in order."""
    slots, pad_rows, targets = [], [], []
    for seq, device_blocks in moves:
        num_tokens = seq.num_computed_tokens
        num_blocks = -(-num_tokens // host_block_size)
        first_row, padding = len(targets) * host_block_size, num_blocks * host_block_size - num_tokens
        seq_slots = slots_for(device_blocks, device_block_size, 0, num_tokens)
        slots += [seq_slots, np.full(padding, seq_slots[0], dtype=seq_slots.dtype)]
        pad_rows.append(first_row + num_tokens + np.arange(padding))
        targets += seq.block_table[:num_blocks]
    return (np.concatenate(slots).astype(np.int64), np.concatenate(pad_rows).astype(np.int64),
            np.array(targets, dtype=np.int64))


def _in_host_layout(token_slots: torch.Tensor, slots: torch.Tensor, pad_rows: torch.Tensor, num_blocks: int,
                    host_block_size: int) -> torch.Tensor:
    """The tokens of token_slots [layers, 2, slots, Hkv, D] at `slots` (_plan's), padding rows zeroed, laid out
    as host blocks: a view [layers, 2, num_blocks, Hkv, host_block_size, D]."""
    tokens = token_slots.index_select(2, slots)
    if pad_rows.numel():
        tokens.index_fill_(2, pad_rows, 0)
    count, _, _, num_kv_heads, head_dim = tokens.shape
    return tokens.view(count, 2, num_blocks, host_block_size, num_kv_heads, head_dim).transpose(3, 4)


def _copy_batch(moves, device_stacked, host_layers, executor, device_block_size: int, staging: MoveStaging) -> list:
    _, num_kv_heads, host_block_size, head_dim = host_layers[0][0].shape
    device = device_stacked.device
    slots, pad_rows, targets = _plan(moves, host_block_size, device_block_size)
    slots, pad_rows = (torch.from_numpy(x).to(device, non_blocking=True) for x in (slots, pad_rows))
    targets = torch.from_numpy(targets)
    token_slots = device_stacked.flatten(2, 3)  # [L, 2, blocks * block_size, Hkv, D]
    block_shape = (len(targets), num_kv_heads, host_block_size, head_dim)
    layer_bytes = 2 * host_layers[0][0].element_size() * int(np.prod(block_shape))
    group = max(1, GROUP_BYTES // max(1, layer_bytes))
    writes = []
    for first in range(0, len(host_layers), group):
        layers = range(first, min(first + group, len(host_layers)))
        slot, host_buffer, device_buffer = staging.take((len(layers), 2, *block_shape), host_layers[0][0].dtype)
        device_buffer.copy_(_in_host_layout(token_slots[first : layers.stop], slots, pad_rows, len(targets),
                                            host_block_size))
        host_buffer.copy_(device_buffer, non_blocking=True)
        write = executor.submit(_scatter_layers, _record_event(device), host_buffer, host_layers, layers, targets)
        staging.busy_until(slot, write)  # the slot is free again once the host blocks have been written
        writes.append(write)
    return writes


def _scatter_layers(arrived, staged: torch.Tensor, host_layers, layers: range, targets: torch.Tensor) -> None:
    if arrived is not None:
        arrived.synchronize()
    for i, layer in enumerate(layers):
        for j, cache in enumerate(host_layers[layer]):
            scatter_blocks(staged[i, j], targets, cache)


def _record_event(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
