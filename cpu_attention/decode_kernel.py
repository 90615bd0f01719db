"""Numba kernel: paged decode attention over a head-major host KV cache.

Layout: k_cache / v_cache [num_blocks, Hkv, block_size, D]: one block's kv heads are one contiguous run, which an
item that takes them in order streams front to back. Elements are float32, or bfloat16 / float16 as uint16 / int16
patterns (numba has neither; the element type selects the widening, numerics.widen); all arithmetic is float32.

Contract: decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse)
- q [B, Hq, D] in the caches' element type, not scaled: scores are scale * q.k; Hq % Hkv == 0, query head h uses
  kv head h // (Hq / Hkv);
- block_tables int32 [B, max_blocks], -1 padded; entries past a context are never read;
- context_lens int32 [B]; a zero-length row gives out 0 and lse -inf;
- chunk_blocks: blocks per split (<= 0: plan_work's); num_threads: numba's thread count of the caller
  (numba.get_num_threads() inside the kernel would make it uncacheable);
- out float32 [B, Hq, D] and lse float32 [B, Hq] (natural log of sum exp(score)) are written;
- returns 0, or an ERRORS code before any KV is read.

Work: an item is (split: chunk_blocks consecutive blocks of one sequence, run of kv heads; plan_work), so one long
sequence still feeds every core. Each kv head of an item runs an online softmax block by block (block_attention.py),
its query heads sharing every K/V row loaded. Workers take items from an atomic counter, not prange's static
schedule: a core busy with the engine's thread must not hold up the step. Partials merge per (sequence, query
head) by log-sum-exp. decode_layers.py runs the same items for a whole host-lane step.
"""
import math

import numpy as np
from numba import njit, prange

from cpu_attention.block_attention import (CACHE_LINE_BYTES, bf16_dot_applies, block_scores_widened, block_scores_words,
                                           block_values_widened, block_values_words, scores_bf16, softmax_update,
                                           values_bf16, word_tiles_apply)
from cpu_attention.llvm_ops import atomic_increment, prefer_wide_vectors, prefetch
from cpu_attention.numerics import FASTMATH, widen
from cpu_attention.word_tiles import join_pairs, split_pairs

PREFETCH_ROWS = 64  # K/V rows fetched ahead of use: ~30 KiB at D=128 bf16, more than DRAM latency x bandwidth
ITEMS_PER_THREAD = 8  # enough items that the dynamic schedule ends evenly
MIN_ITEM_TOKENS = 256  # below this, an item's cold start and its merge cost more than its parallelism gains
ERRORS = {
    1: "a context length is negative or longer than its block table row",
    2: "a block table entry inside a context is outside the cache (negative or >= num_blocks)",
    3: "the step was abandoned before the device handed its layer over",
}
ABANDONED = 3


# ---- the split plan ----------------------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def plan_work(context_lens, block_size, num_kv_heads, num_threads):
    """(chunk_blocks, item_heads): a work item is up to chunk_blocks consecutive blocks of one sequence (a split)
    for item_heads consecutive kv heads. About ITEMS_PER_THREAD items a thread, no split shorter than
    MIN_ITEM_TOKENS (or one block), and as many heads an item as that leaves room for (why whole heads:
    docs/decisions/host-kernel.md, "Items of whole block-heads")."""
    total_blocks = 0
    for b in range(context_lens.shape[0]):
        total_blocks += (max(context_lens[b], 0) + block_size - 1) // block_size
    target_items = max(num_threads, 1) * ITEMS_PER_THREAD
    min_blocks = (MIN_ITEM_TOKENS + block_size - 1) // block_size
    per_item = max(1, min_blocks, (total_blocks * num_kv_heads + target_items - 1) // target_items)  # block-heads
    heads = num_kv_heads
    while heads > 1 and (num_kv_heads % heads != 0 or heads * min_blocks > per_item):
        heads -= 1
    return max(1, min_blocks, (per_item + heads - 1) // heads), heads


@njit(nogil=True, cache=True)
def plan_split_offsets(context_lens, block_size, chunk_blocks):
    """offsets[b]..offsets[b+1] are sequence b's splits (an empty sequence keeps one, empty, split)."""
    offsets = np.zeros(context_lens.shape[0] + 1, np.int64)
    for b in range(context_lens.shape[0]):
        num_blocks = (context_lens[b] + block_size - 1) // block_size
        offsets[b + 1] = offsets[b] + max(1, (num_blocks + chunk_blocks - 1) // chunk_blocks)
    return offsets


@njit(nogil=True, cache=True)
def check_tables(block_tables, context_lens, num_blocks, block_size):
    for b in range(context_lens.shape[0]):
        n = context_lens[b]
        if n < 0 or n > block_tables.shape[1] * block_size:
            return 1
        for j in range((n + block_size - 1) // block_size):
            if block_tables[b, j] < 0 or block_tables[b, j] >= num_blocks:
                return 2
    return 0


# ---- one work item and the merge ---------------------------------------------------------------------------
@njit(nogil=True, fastmath=FASTMATH)
def _attend_split(q, scale, wide_q, k_cache, v_cache, table_row, context_len, h0, heads, first, last, accs, stats,
                  scores):
    """Online softmax of one sequence's kv heads h0..h0+heads-1 over blocks first..last-1 of its table row, in
    the cache's order: block by block, and within a block head by head. q [Hq, D] is the sequence's query as
    given; wide_q [Hq, D] is the worker's scratch for the heads' queries widened and scaled, where the scores do
    not come from vdpbf16ps (unscaled and in even/odd order on the word tiles, which scale their sums). accs[i]
    [group, D] accumulates head h0 + i (in even/odd order on the word tiles until the end); stats is the worker's
    scratch: row 0 the block max, rows 1 + 2i and 2 + 2i head h0 + i's running max and sum."""
    prefer_wide_vectors()
    group, dim = accs.shape[1], accs.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    bf16, words = bf16_dot_applies(q, dim), word_tiles_apply(q, dim)
    if not bf16:
        factor = np.float32(1.0) if words else scale  # the word tiles scale their sums, as the vdpbf16ps tiles do
        for g in range(h0 * group, (h0 + heads) * group):
            for d in range(dim):
                wide_q[g, d] = widen(q[g, d]) * factor
            if words:
                split_pairs(wide_q.ctypes.data + g * wide_q.strides[0], dim)
    for i in range(heads):
        stats[1 + 2 * i, :group] = -np.inf
        stats[2 + 2 * i, :group] = 0.0
        accs[i] = 0.0
    # Runs of block_size rows in reading order: run r is block first + r // heads, head h0 + r % heads. Software
    # prefetch runs PREFETCH_ROWS rows ahead (whole runs), the first stretch in one burst.
    runs = (last - first) * heads
    distance = (PREFETCH_ROWS + block_size - 1) // block_size
    for r in range(min(distance, runs)):
        start = (table_row[first + r // heads] * num_kv_heads + h0 + r % heads) * block_size * dim
        for c in range(0, block_size * dim, CACHE_LINE_BYTES // k_cache.itemsize):
            prefetch(k_cache, start + c)
            prefetch(v_cache, start + c)
    for r in range(runs):
        j, i = first + r // heads, r % heads
        h, block = h0 + i, table_row[j]
        n = min(block_size, context_len - j * block_size)
        a = r + distance
        if a < runs:
            ahead = table_row[first + a // heads] * num_kv_heads + h0 + a % heads
        else:
            ahead = block * num_kv_heads + h
        next_run = ahead * block_size * dim
        block_max, running_max, running_sum = stats[0], stats[1 + 2 * i], stats[2 + 2 * i]
        if bf16:
            scores_bf16(q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run, scale)
        elif words:
            block_scores_words(wide_q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run,
                                scale)
        else:
            block_scores_widened(wide_q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run)
        softmax_update(scores, n, block_max, running_max, running_sum, accs[i])
        if bf16:
            values_bf16(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
        elif words:
            block_values_words(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
        else:
            block_values_widened(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
    if words:  # the accumulators back in natural order for the merge
        for i in range(heads):
            for g in range(group):
                join_pairs(accs.ctypes.data + i * accs.strides[0] + g * accs.strides[1], dim)


@njit(nogil=True, fastmath=FASTMATH)
def merge_splits(part_acc, part_max, part_sum, first, stop, stride, g, out_row):
    """out_row = softmax-weighted merge of items range(first, stop, stride) for query head g; returns the lse."""
    prefer_wide_vectors()
    top = -np.inf
    for i in range(first, stop, stride):
        top = max(top, part_max[i, g])
    out_row[:] = 0.0
    if top == -np.inf:
        return -np.inf
    total = np.float32(0.0)
    for i in range(first, stop, stride):
        w = np.float32(math.exp(part_max[i, g] - top))
        total += w * part_sum[i, g]
        for d in range(out_row.shape[0]):
            out_row[d] += w * part_acc[i, g, d]
    inv = np.float32(1.0) / total
    for d in range(out_row.shape[0]):
        out_row[d] *= inv
    return top + math.log(total)


@njit(nogil=True, cache=True)
def work_plan(context_lens, block_size, num_kv_heads, group, dim, chunk_blocks, num_threads):
    """The items of one kernel call and room for their partials: (chunk_blocks, item_heads, num_items, offsets,
    split_seq, part_acc, part_max, part_sum). split_seq[s] is the sequence split s belongs to; an item is (split,
    run of item_heads kv heads); partial p is (split p // num_kv_heads, kv head p % num_kv_heads)."""
    planned, item_heads = plan_work(context_lens, block_size, num_kv_heads, num_threads)
    if chunk_blocks <= 0:
        chunk_blocks = planned
    batch = context_lens.shape[0]
    offsets = plan_split_offsets(context_lens, block_size, chunk_blocks)
    split_seq = np.empty(offsets[batch], np.int64)
    for b in range(batch):
        split_seq[offsets[b]:offsets[b + 1]] = b
    num_parts = offsets[batch] * num_kv_heads
    part_acc = np.empty((num_parts, group, dim), np.float32)
    part_max = np.empty((num_parts, group), np.float32)
    part_sum = np.empty((num_parts, group), np.float32)
    num_items = offsets[batch] * (num_kv_heads // item_heads)
    return chunk_blocks, item_heads, num_items, offsets, split_seq, part_acc, part_max, part_sum


@njit(nogil=True, cache=True)
def worker_scratch(num_workers, block_size, group, num_kv_heads):
    """Per worker: scores [group, block_size], then the block max, then a running max and sum per kv head, then
    an unused row, rows padded to 64 bytes, so no two workers ever write into one cache line."""
    stride = (max(block_size, group) + 15) // 16 * 16
    return np.empty((num_workers, group + 2 + 2 * num_kv_heads, stride), np.float32)


@njit(nogil=True, cache=True)
def worker_queries(num_workers, num_q_heads, dim):
    """Per worker: its item's queries, widened and scaled [Hq, D] (C-contiguous, so the dot products vectorize)."""
    return np.empty((num_workers, num_q_heads, dim), np.float32)


@njit(nogil=True, fastmath=FASTMATH)
def attend_item(item, q, scale, wide_q, k_cache, v_cache, block_tables, context_lens, split_seq, offsets,
                 chunk_blocks, item_heads, part_acc, part_max, part_sum, scores, stats):
    """Work item `item` = (split, run of item_heads kv heads) into its partials p = split * Hkv + h: part_acc[p],
    part_max[p], part_sum[p]. wide_q, scores and stats are the worker's scratch (see _attend_split)."""
    prefer_wide_vectors()  # LLVM inlines the block loops here: the attribute must be on this function too
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    runs_per_split = num_kv_heads // item_heads
    split, h0 = item // runs_per_split, item % runs_per_split * item_heads
    b = split_seq[split]
    last_block = (context_lens[b] + block_size - 1) // block_size
    first = min((split - offsets[b]) * chunk_blocks, last_block)
    last = min(first + chunk_blocks, last_block)
    base = split * num_kv_heads + h0
    _attend_split(q[b], scale, wide_q, k_cache, v_cache, block_tables[b], context_lens[b], h0, item_heads, first,
                  last, part_acc[base:base + item_heads], stats, scores)
    for i in range(item_heads):
        for g in range(part_max.shape[1]):
            part_max[base + i, g], part_sum[base + i, g] = stats[1 + 2 * i, g], stats[2 + 2 * i, g]


@njit(nogil=True, fastmath=FASTMATH)
def merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out, lse):
    """Output row `row` = (sequence, query head) from its sequence's partials: out[b, hq] and lse[b, hq]."""
    prefer_wide_vectors()
    num_q_heads = out.shape[1]
    group = num_q_heads // num_kv_heads
    b, hq = row // num_q_heads, row % num_q_heads
    h, g = hq // group, hq % group
    lse[b, hq] = merge_splits(part_acc, part_max, part_sum, offsets[b] * num_kv_heads + h,
                               offsets[b + 1] * num_kv_heads, num_kv_heads, g, out[b, hq])


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse):
    batch, num_q_heads, dim = q.shape
    num_blocks, num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    error = check_tables(block_tables, context_lens, num_blocks, block_size)
    if error:
        return error
    chunk_blocks, item_heads, num_items, offsets, split_seq, part_acc, part_max, part_sum = work_plan(
        context_lens, block_size, num_kv_heads, group, dim, chunk_blocks, num_threads)
    tickets = np.zeros(1, np.int64)
    num_workers = min(num_threads, num_items)
    scratch = worker_scratch(num_workers, block_size, group, num_kv_heads)
    queries = worker_queries(num_workers, num_q_heads, dim)
    scale32 = np.float32(scale)
    for w in prange(num_workers):
        scores, stats = scratch[w, :group], scratch[w, group:]  # whole rows keep them C-contiguous
        item = atomic_increment(tickets, 0)
        while item < num_items:
            attend_item(item, q, scale32, queries[w], k_cache, v_cache, block_tables, context_lens, split_seq,
                         offsets, chunk_blocks, item_heads, part_acc, part_max, part_sum, scores, stats)
            item = atomic_increment(tickets, 0)
    for row in prange(batch * num_q_heads):
        merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out, lse)
    return 0
