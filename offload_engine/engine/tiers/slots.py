"""Slot arithmetic shared by a step's inputs and the moves between the tiers."""
import numpy as np


def slots_for(block_table: list[int], block_size: int, start: int, end: int, first: int = 0) -> np.ndarray:
    """Cache slots of token positions [start, end): block_id * block_size + offset, in the tier's own pool, for a
    table whose first block holds token `first` (a split sequence's host part starts after its device part)."""
    positions = np.arange(start, end) - first
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def host_copy_plan(moves: list[tuple[int, list[int], list[int]]], host_block_size: int,
                   device_block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For moves of (tokens, host blocks, device blocks), promotions or demotions, what gpu_kernels.host_block_copies
    takes: the host blocks in order, each token's row among them, and its device slot."""
    blocks, rows, slots = [], [], []
    for num_tokens, host_blocks, device_blocks in moves:
        rows.append(len(blocks) * host_block_size + np.arange(num_tokens))
        blocks += host_blocks[: -(-num_tokens // host_block_size)]
        slots.append(slots_for(device_blocks, device_block_size, 0, num_tokens))
    return np.array(blocks, dtype=np.int64), np.concatenate(rows), np.concatenate(slots)
