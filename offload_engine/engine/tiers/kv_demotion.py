"""Copies demoted sequences' KV from the device pool into their new host blocks.

Demotion (engine/sched/placement.py says when) moves a decoding device-tier sequence to the host tier when the
device pool has no block for some sequence's next token: instead of being preempted and recomputed, it goes
on decoding in the host lane. Its KV crosses PCIe once.

Two ways across:
- `write_mapped` (CUDA, a pinned pool the device can address: HostKVPool.device_stacked): the device writes the
  tokens from their token-major slots straight into the host tier's head-major blocks over PCIe, on 8 programs
  (kernels.scatter_host_blocks), on the "moves" stream beside the device lane's next steps. The device blocks
  the next steps write into cross first, in a kernel of their own, and the device lane waits for that one alone;
  the rest of the freed blocks are held until the whole copy has landed (BlockPool.hold_until). On the lane's own
  stream, as before, every demotion held up the step behind it for its whole PCIe write: ~6.5 ms for a ~2k-token
  row at 8B, 0.52-0.55 s of a 31-32 s run with ~80 demotions (H100 host, 2026-11-24, the step traces of
  benchmarks/trace_placement.py). (An earlier try on the moves stream, a Triton copy on 8 SMs with the freed
  blocks reusable at once, saved nothing at 0.6B; 2026-11-23, benchmarks/NOTES.md.) The engine's thread
  only queues the kernels; the host lane and every other reader of host blocks waits for the copy's event.
  The staged way below took 47 ms of the engine's thread a demotion on the H100 host (8B, ~2k tokens each, 106
  demotions: 5.0 s of a 41 s run; 2026-11-22), waiting for staging slots whose host halves the executor frees
  only after the host lane's step, which holds it from start to end.
- `copy_to_host` (any device): the device gathers the tokens into host-block layout (one padded host block per
  `cpu_block_size` tokens); per group of layers, one copy takes them to a staging slot's pinned half, and on the
  host executor numba scatters them into the sequences' host blocks. That joins the executor's queue, which
  every later reader of those host blocks (host decode, prefix staging, promotion) also goes through, so nothing
  here waits for it. The device half is queued on the device lane's stream before the step that reuses the
  freed device blocks, so it reads the KV before anything overwrites it.
"""
import numpy as np
import torch

from cpu_attention.gather import scatter_blocks
from kernels.host_block_copies import scatter_host_blocks
from offload_engine.engine.tiers.move_staging import GROUP_BYTES, MoveStaging, split_moves
from offload_engine.engine.sequence import Sequence
from offload_engine.engine.tiers.slots import host_copy_plan, slots_for


def copy_to_host(moves: list[tuple[Sequence, list[int]]], device_stacked: torch.Tensor, host_layers, executor,
                 device_block_size: int, staging: MoveStaging) -> list:
    """moves: (sequence, the device blocks holding its KV); each sequence's `block_table` already names its host
    blocks and `num_computed_tokens` says how many tokens have KV. Returns the executor futures of the host
    writes (callers need not wait: see the module docstring)."""
    block = host_layers[0][0][0]
    batches = split_moves(moves, block.shape[1], 2 * block.numel() * block.element_size())
    return [write for batch in batches
            for write in _copy_batch(batch, device_stacked, host_layers, executor, device_block_size, staging)]


def write_mapped(moves: list[tuple[Sequence, list[int]]], device_stacked: torch.Tensor, mapped_stacked: torch.Tensor,
                 device_block_size: int, upload=None, first_blocks=(), between=None) -> None:
    """moves as copy_to_host's; device_stacked: the device pool, [L, 2, blocks, block_size, Hkv, D];
    mapped_stacked: the host pool as a tensor on the device, [L, 2, blocks, Hkv, host block size, D]. The tokens
    held in `first_blocks` (device blocks) cross first, in one kernel (kernels.scatter_host_blocks), then
    between() is called (the runner marks there what the device lane waits for; not called where none are), then
    the rest cross in another.
    Returns once they are queued on the current stream: nothing may read the host blocks, nor write the device
    blocks, before they have run (ModelRunner.demote records when). upload(array) -> its copy on the device
    (PinnedRing.upload); by default a plain copy."""
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
        arrived.synchronize()  # the device-to-host copy has landed
    for i, layer in enumerate(layers):
        for j, cache in enumerate(host_layers[layer]):
            scatter_blocks(staged[i, j], targets, cache)


def _record_event(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
