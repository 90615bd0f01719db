"""Numba kernel: every layer of one host-lane decode step in one parallel region, each as the device hands it over.

The Python side, and why one native call spans the step, are in layer_loop.py. The attention itself is
decode_kernel's: the same work items and merges, per layer.

Gates: int32 [2, num_layers] in pinned memory that the device reads and writes by DMA. gates[0, l] = 1 once the
device has put layer l's q/k/v into host memory; the loop sets gates[1, l] = 1 once layer l's output is there.
"""
import numpy as np
from numba import njit, prange

from cpu_attention.decode_kernel import (ABANDONED, attend_item, check_tables, merge_row, work_plan, worker_queries,
                                         worker_scratch)
from cpu_attention.llvm_ops import atomic_increment, cycle_counter, load_acquire, spin_pause, store_release
from cpu_attention.numerics import FASTMATH


@njit(nogil=True, cache=True)
def cycles():
    """The cycle counter from Python (layer_loop.py calibrates it against perf_counter)."""
    return cycle_counter()


@njit(inline="always")
def _wait_for(flags_or_counts, index, target, abandon):
    """Spins until flags_or_counts[index] >= target; False if the lane abandoned the step (abandon[1] != 0)."""
    while load_acquire(flags_or_counts, index) < target:
        if load_acquire(abandon, 1) != 0:
            return False
        spin_pause()
    return True


@njit(nogil=True)
def _take_in_row(k_new, v_new, k_cache, v_cache, slot):
    """One row's new token into its slot (-1: no token; bit patterns copied, never widened)."""
    if slot >= 0:
        block, offset = slot // k_cache.shape[2], slot % k_cache.shape[2]
        for h in range(k_cache.shape[1]):
            for d in range(k_cache.shape[3]):
                k_cache[block, h, offset, d] = k_new[h, d]
                v_cache[block, h, offset, d] = v_new[h, d]


# A layer's three phases, each a queue of items: rows in (stores), attention items, merges. Each phase has a
# ticket counter and a tally of finished items, each on a cache line of its own (8 int64s).
_LINE = 8
_TICKETS, _DONE = 0, _LINE
_ROWS_IN, _ATTEND, _MERGE = 0, 2 * _LINE, 4 * _LINE


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def decode_layers(gates, flags, q, k_new, v_new, pools, slots, block_tables, context_lens, batch, scale, num_threads,
                  out, lse, times):
    """Every layer of one host-lane decode step, each once the device has handed it over; 0, or an ERRORS code.

    q [L, rows, Hq, D], k_new/v_new [L, rows, Hkv, D] in the caches' element type (rows >= batch, only the first
    batch are read); pools [L, 2, num_blocks, Hkv, block_size, D] (K then V of each layer); slots int64 [batch];
    block_tables/context_lens as decode_kernel's, with the new token counted; out float32 [L, rows, Hq, D]
    (the device rounds it); lse float32 [L, rows, Hq], each layer's log-sum-exp (merged with a split row's device
    part). flags int64 [2]: the loop sets flags[0] once it runs (without the GIL); flags[1] != 0 from the lane
    abandons a step whose device never hands a layer over.
    times int64 [L + 1, 2]: cycle counts, row 0 the entry (twice), row l + 1 when layer l's gate 0 was seen open
    and when its gate 1 was opened: the device's turnaround between layers against the host's work on each.
    It never returns before its last gate is open (layer_loop.py says why). Maps the kernel refuses open every
    gate and return the error before any work, so the device's step still ends (its output is thrown away).

    One parallel region for the step (docs/decisions/host-kernel.md, "One parallel region per host step"): the
    workers wait on each layer's gate 0 together, take its items from shared counters, and start a phase once the
    tally of the one before is complete. Waiting on tallies, not on each other, keeps it correct with fewer threads
    than num_threads: a worker that comes late finds its layers done.
    """
    store_release(flags, 0, 1)
    times[0, 0] = times[0, 1] = cycle_counter()
    num_layers, num_q_heads, dim = q.shape[0], q.shape[2], q.shape[3]
    num_blocks, num_kv_heads, block_size = pools.shape[2], pools.shape[3], pools.shape[4]
    group = num_q_heads // num_kv_heads
    error = check_tables(block_tables, context_lens, num_blocks, block_size)
    if error or batch == 0:
        for layer in range(num_layers):
            if not error and not _wait_for(gates[0], layer, 1, flags):
                return ABANDONED
            store_release(gates[1], layer, 1)
        return error
    chunk_blocks, item_heads, num_items, offsets, split_seq, part_acc, part_max, part_sum = work_plan(
        context_lens, block_size, num_kv_heads, group, dim, 0, num_threads)
    num_rows = batch * num_q_heads
    counts = np.zeros((num_layers, 6 * _LINE), np.int64)
    scratch = worker_scratch(num_threads, block_size, group, num_kv_heads)
    queries = worker_queries(num_threads, num_q_heads, dim)
    scale32 = np.float32(scale)
    for w in prange(num_threads):
        scores, stats = scratch[w, :group], scratch[w, group:]
        for layer in range(num_layers):
            if not _wait_for(gates[0], layer, 1, flags):
                break
            # The layer before must be merged before this one's items overwrite the partials it merges from.
            # On the GPU the gates order this already (gate 0 of a layer opens after gate 1 of the one before);
            # with the gates open ahead, as in warm-up, a worker could otherwise run on into the next layer.
            if layer > 0 and not _wait_for(counts[layer - 1], _MERGE + _DONE, num_rows, flags):
                break
            c = counts[layer]
            k_cache, v_cache = pools[layer, 0], pools[layer, 1]
            b = atomic_increment(c, _ROWS_IN + _TICKETS)
            while b < batch:
                if b == 0:
                    times[layer + 1, 0] = cycle_counter()
                _take_in_row(k_new[layer, b], v_new[layer, b], k_cache, v_cache, slots[b])
                atomic_increment(c, _ROWS_IN + _DONE)
                b = atomic_increment(c, _ROWS_IN + _TICKETS)
            if not _wait_for(c, _ROWS_IN + _DONE, batch, flags):
                break
            item = atomic_increment(c, _ATTEND + _TICKETS)
            while item < num_items:
                attend_item(item, q[layer], scale32, queries[w], k_cache, v_cache, block_tables,
                             context_lens, split_seq, offsets, chunk_blocks, item_heads, part_acc, part_max,
                             part_sum, scores, stats)
                atomic_increment(c, _ATTEND + _DONE)
                item = atomic_increment(c, _ATTEND + _TICKETS)
            if not _wait_for(c, _ATTEND + _DONE, num_items, flags):
                break
            row = atomic_increment(c, _MERGE + _TICKETS)
            while row < num_rows:
                merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out[layer], lse[layer])
                if atomic_increment(c, _MERGE + _DONE) + 1 == num_rows:  # the layer's last merge hands it back
                    times[layer + 1, 1] = cycle_counter()
                    store_release(gates[1], layer, 1)
                row = atomic_increment(c, _MERGE + _TICKETS)
    return 0 if load_acquire(gates[1], num_layers - 1) != 0 else ABANDONED
