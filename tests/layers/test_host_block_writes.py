"""Host-tier prefill K/V written whole host blocks at a time (layers/host_block_writes.py), against a plain loop that
writes each token into its slot. The engine-level path (host-tier and split prompts, chunked, against transformers)
runs in test_cpu_tier.py, test_split_sequences.py and test_prefill_segments.py, where the CPU's "mapped" pool is
the host pool itself."""
import numpy as np
import pytest
import torch

from offload_engine.layers.host_block_writes import HostBlockWrites, plan_host_block_writes, write_host_blocks

BLOCK_SIZE, NUM_BLOCKS, HKV, D = 8, 24, 2, 4


def _step_slots(rng, starts_and_lengths, gpu_tokens_between: int) -> np.ndarray:
    """Each row's tokens [start, start + length) in fresh host blocks (shuffled), with device-tier tokens (-1)
    between rows."""
    blocks = rng.permutation(NUM_BLOCKS)
    slots, taken = [], 0
    for start, length in starts_and_lengths:
        positions = np.arange(start, start + length)
        table = blocks[taken:taken + -(-(start + length) // BLOCK_SIZE)]
        taken += len(table)
        slots += [table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE, np.full(gpu_tokens_between, -1)]
    return np.concatenate(slots).astype(np.int64)


@pytest.mark.parametrize("rows", [
    [(0, 8)],  # one whole block
    [(0, 13), (0, 1)],  # a tail block padded; a one-token prompt
    [(5, 11), (8, 16)],  # a chunk starting mid-block (its head goes the executor's way), one at a boundary
    [(3, 2)],  # only a head: nothing written whole
    [(0, 17), (7, 1), (16, 9)],
])
@pytest.mark.parametrize("gpu_tokens_between", [0, 3])
def test_whole_blocks_and_the_rest_write_exactly_each_token(rows, gpu_tokens_between):
    rng = np.random.default_rng(len(rows) * 10 + gpu_tokens_between)
    host_slots = _step_slots(rng, rows, gpu_tokens_between)
    k, v = (torch.randn(len(host_slots), HKV, D, dtype=torch.float64) for _ in range(2))
    # The pool holds older KV (and garbage) everywhere: blocks a step began earlier must keep their first tokens.
    pools = [torch.randn(NUM_BLOCKS, HKV, BLOCK_SIZE, D, dtype=torch.float64) for _ in range(2)]
    expected = [p.clone() for p in pools]
    for token, slot in enumerate(host_slots):
        if slot >= 0:
            for pool, source in zip(expected, (k, v)):
                pool[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE] = source[token]

    plan, rest = plan_host_block_writes(host_slots, BLOCK_SIZE)
    if plan is not None:
        writes = HostBlockWrites(*(torch.from_numpy(a) for a in plan))
        write_host_blocks(k, v, writes, *pools)
        # Rows past a whole block's last token are zeroed.
        for pool in pools:
            rows_written = pool[writes.targets].transpose(1, 2).reshape(-1, HKV, D)
            assert torch.all(rows_written[writes.token_rows < 0] == 0)
    for token in rest:  # the executor's path, as a loop
        slot = host_slots[token]
        for pool, source in zip(pools, (k, v)):
            pool[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE] = source[token]

    host_tokens = np.flatnonzero(host_slots >= 0)
    for pool, reference in zip(pools, expected):
        got = pool.transpose(1, 2).reshape(-1, HKV, D)
        want = reference.transpose(1, 2).reshape(-1, HKV, D)
        # Every host-tier token exactly, and every slot of a block no whole write touched as it was.
        assert torch.equal(got[host_slots[host_tokens]], want[host_slots[host_tokens]])
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS), plan[1] if plan is not None else [])
        assert torch.equal(pool[untouched], reference[untouched])


def test_a_block_begun_earlier_is_never_written_whole():
    # Tokens 5..12 of a row: block 0's offsets 5-7 came after earlier tokens, block 1 starts here.
    host_slots = np.arange(5, 13, dtype=np.int64)
    plan, rest = plan_host_block_writes(host_slots, BLOCK_SIZE)
    assert list(rest) == [0, 1, 2]
    assert list(plan[1]) == [1]
    assert list(plan[0]) == [3, 4, 5, 6, 7, -1, -1, -1]  # block 1 holds tokens 8..12: its last three rows are padding
