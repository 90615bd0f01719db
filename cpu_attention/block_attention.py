"""One (block, kv head) of paged decode attention: its scores, the online softmax update, and its P x V.

Three ways to the same float32 sums, chosen per call by the queries' type and the switches (kernel_switches.py):
- widened value by value (block_scores_widened, block_values_widened): every cache dtype and head_dim;
- the word tiles (word_tiles.py): bfloat16 caches with head_dim a multiple of 32, the default there;
- vdpbf16ps (bf16_dot_tiles.py): bfloat16 with OFFLOAD_ENGINE_BF16_DOT=1 on CPUs that have AVX-512 BF16.
Every function prefetches the next run of K or V rows (next_block: a flat index into the cache) into L2 as it
goes, across the jumps between blocks that the hardware prefetcher cannot see.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from cpu_attention import bf16_dot_tiles, word_tiles
from cpu_attention.bf16_dot_tiles import BF16_LANES
from cpu_attention.kernel_switches import BF16_DOT, WORD_TILES
from cpu_attention.llvm_ops import prefer_wide_vectors, prefetch
from cpu_attention.numerics import FASTMATH, exp_nonpositive, widen
from cpu_attention.tile_ir import max_of
from cpu_attention.word_tiles import WORD_VALUES

CACHE_LINE_BYTES = 64


@njit(inline="always")
def prefetch_row(cache, row_start, step):
    for c in range(0, cache.shape[3], step):
        prefetch(cache, row_start + c)


@njit(nogil=True, fastmath=FASTMATH)
def block_scores_widened(q, h0, group, kb, n, scores, block_max, k_cache, next_block):
    """scores[g, t] = q[h0 + g] . k[t] for the n valid rows of one K block, and block_max[g] = max_t scores.

    Four rows at a time, the group's heads in quads, then a pair, then a single head: every widened K element
    feeds every head of the pass and every q element four rows, and the pass's reductions overlap. Group 2
    (Qwen3-0.6B) runs only the pair pass, group 1 only the single one. The tail rows (n % 4) take one _dot per
    head. The max is taken here, one step per four rows: a separate pass is a serial chain of compares.
    """
    prefer_wide_vectors()
    block_max[:] = -np.inf
    dim = kb.shape[1]
    step = CACHE_LINE_BYTES // kb.itemsize
    quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
    for t in range(0, n4, 4):
        for r in range(4):
            prefetch_row(k_cache, next_block + (t + r) * dim, step)
        for g in range(0, quads, 4):
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = np.float32(0.0)
            for d in range(dim):
                x0, x1, x2, x3 = widen(kb[t, d]), widen(kb[t + 1, d]), widen(kb[t + 2, d]), widen(kb[t + 3, d])
                q0, q1, q2, q3 = q[h0 + g, d], q[h0 + g + 1, d], q[h0 + g + 2, d], q[h0 + g + 3, d]
                a0 += q0 * x0
                a1 += q1 * x0
                a2 += q2 * x0
                a3 += q3 * x0
                b0 += q0 * x1
                b1 += q1 * x1
                b2 += q2 * x1
                b3 += q3 * x1
                c0 += q0 * x2
                c1 += q1 * x2
                c2 += q2 * x2
                c3 += q3 * x2
                e0 += q0 * x3
                e1 += q1 * x3
                e2 += q2 * x3
                e3 += q3 * x3
            scores[g, t], scores[g + 1, t], scores[g + 2, t], scores[g + 3, t] = a0, a1, a2, a3
            scores[g, t + 1], scores[g + 1, t + 1], scores[g + 2, t + 1], scores[g + 3, t + 1] = b0, b1, b2, b3
            scores[g, t + 2], scores[g + 1, t + 2], scores[g + 2, t + 2], scores[g + 3, t + 2] = c0, c1, c2, c3
            scores[g, t + 3], scores[g + 1, t + 3], scores[g + 2, t + 3], scores[g + 3, t + 3] = e0, e1, e2, e3
            block_max[g] = max(block_max[g], max(max(a0, b0), max(c0, e0)))
            block_max[g + 1] = max(block_max[g + 1], max(max(a1, b1), max(c1, e1)))
            block_max[g + 2] = max(block_max[g + 2], max(max(a2, b2), max(c2, e2)))
            block_max[g + 3] = max(block_max[g + 3], max(max(a3, b3), max(c3, e3)))
        for g in range(quads, pairs, 2):  # at most once: two heads x four rows, 8 sums
            a0 = a1 = b0 = b1 = c0 = c1 = e0 = e1 = np.float32(0.0)
            for d in range(dim):
                x0, x1, x2, x3 = widen(kb[t, d]), widen(kb[t + 1, d]), widen(kb[t + 2, d]), widen(kb[t + 3, d])
                q0, q1 = q[h0 + g, d], q[h0 + g + 1, d]
                a0 += q0 * x0
                a1 += q1 * x0
                b0 += q0 * x1
                b1 += q1 * x1
                c0 += q0 * x2
                c1 += q1 * x2
                e0 += q0 * x3
                e1 += q1 * x3
            scores[g, t], scores[g + 1, t] = a0, a1
            scores[g, t + 1], scores[g + 1, t + 1] = b0, b1
            scores[g, t + 2], scores[g + 1, t + 2] = c0, c1
            scores[g, t + 3], scores[g + 1, t + 3] = e0, e1
            block_max[g] = max(block_max[g], max(max(a0, b0), max(c0, e0)))
            block_max[g + 1] = max(block_max[g + 1], max(max(a1, b1), max(c1, e1)))
        for g in range(pairs, group):  # at most once (odd group): one head x four rows, 4 sums
            a = b = c = e = np.float32(0.0)
            for d in range(dim):
                q0 = q[h0 + g, d]
                a += q0 * widen(kb[t, d])
                b += q0 * widen(kb[t + 1, d])
                c += q0 * widen(kb[t + 2, d])
                e += q0 * widen(kb[t + 3, d])
            scores[g, t], scores[g, t + 1], scores[g, t + 2], scores[g, t + 3] = a, b, c, e
            block_max[g] = max(block_max[g], max(max(a, b), max(c, e)))
    for t in range(n4, n):
        prefetch_row(k_cache, next_block + t * dim, step)
        for g in range(group):
            scores[g, t] = _dot(q, h0 + g, kb, t)
            block_max[g] = max(block_max[g], scores[g, t])


@njit(inline="always", fastmath=FASTMATH)
def _dot(q, head, kb, t):
    s = np.float32(0.0)
    for d in range(kb.shape[1]):
        s += q[head, d] * widen(kb[t, d])
    return s


def bf16_dot_applies(q, dim):
    """Whether block_scores_bf16 serves these queries (numba-only: see the overload)."""
    raise NotImplementedError


@overload(bf16_dot_applies, inline="always")
def _bf16_dot_applies_impl(q, dim):
    if BF16_DOT and isinstance(q, types.Array) and q.dtype == types.uint16:
        return lambda q, dim: dim % BF16_LANES == 0
    return lambda q, dim: False


def _tiled_block_scores(tile_4x4, tile_2x4, tile_1x4, tile_1x1):
    """block_scores_widened on tiles (the vdpbf16ps or the word tiles' scores): scores[g, t] = scale * q[h0 + g] .
    k[t] in the same passes, then each head's max. q holds the queries each tile kind reads."""

    @njit(nogil=True)
    def block_scores(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
        dim = kb.shape[1]
        step = CACHE_LINE_BYTES // kb.itemsize
        quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
        q_step, k_step, s_step = q.strides[0], kb.strides[0], scores.strides[0]
        heads, rows, out = q.ctypes.data + h0 * q_step, kb.ctypes.data, scores.ctypes.data
        for t in range(0, n4, 4):
            for r in range(4):
                prefetch_row(k_cache, next_block + (t + r) * dim, step)
            k = rows + t * k_step
            for g in range(0, quads, 4):
                tile_4x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
            for g in range(quads, pairs, 2):
                tile_2x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
            for g in range(pairs, group):
                tile_1x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
        for t in range(n4, n):
            prefetch_row(k_cache, next_block + t * dim, step)
            for g in range(group):
                tile_1x1(heads + g * q_step, q_step, rows + t * k_step, k_step, out + g * s_step + 4 * t, s_step, dim,
                         scale)
        for g in range(group):
            block_max[g] = max_of(out + g * s_step, n)

    return block_scores


def _tiled_block_values(tile_4x8, tile_2x8, tile_1x8, tile_4x1, tile_2x1, tile_1x1):
    """block_values_widened on tiles (the vdpbf16ps or the word tiles' P x V): acc[g] += sum_t p[g, t] * v[t], eight
    rows a pass, heads in quads, a pair, a single; the last n % 8 rows one at a time. acc is in its tiles' order."""

    @njit(nogil=True)
    def block_values(vb, n, scores, acc, v_cache, next_block):
        group, dim = acc.shape
        step = CACHE_LINE_BYTES // vb.itemsize
        quads, pairs, n8 = group - group % 4, group - group % 2, n - n % 8
        v_step, p_step, a_step = vb.strides[0], scores.strides[0], acc.strides[0]
        rows, weights, sums = vb.ctypes.data, scores.ctypes.data, acc.ctypes.data
        for t in range(0, n8, 8):
            for r in range(8):
                prefetch_row(v_cache, next_block + (t + r) * dim, step)
            v = rows + t * v_step
            for g in range(0, quads, 4):
                tile_4x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(quads, pairs, 2):
                tile_2x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(pairs, group):
                tile_1x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
        for t in range(n8, n):
            prefetch_row(v_cache, next_block + t * dim, step)
            v = rows + t * v_step
            for g in range(0, quads, 4):
                tile_4x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(quads, pairs, 2):
                tile_2x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(pairs, group):
                tile_1x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)

    return block_values


# vdpbf16ps: unscaled bfloat16 queries as stored, P rounded to bfloat16 in pairs of V rows (_bf16_values_tile).
block_scores_bf16 = _tiled_block_scores(*bf16_dot_tiles.SCORE_TILES)
block_values_bf16 = _tiled_block_values(*bf16_dot_tiles.VALUE_TILES)
# Word tiles: unscaled float32 queries and the accumulators in even/odd order (split_pairs, join_pairs).
block_scores_words = _tiled_block_scores(*word_tiles.SCORE_TILES)
block_values_words = _tiled_block_values(*word_tiles.VALUE_TILES)


def values_bf16(vb, n, scores, acc, v_cache, next_block):
    """block_values_bf16 where the types allow it (numba-only: see the overload)."""
    raise NotImplementedError


@overload(values_bf16)
def _values_bf16_impl(vb, n, scores, acc, v_cache, next_block):
    if BF16_DOT and vb.dtype == types.uint16:
        return lambda vb, n, scores, acc, v_cache, next_block: block_values_bf16(vb, n, scores, acc, v_cache,
                                                                                  next_block)
    return lambda vb, n, scores, acc, v_cache, next_block: None  # never called, as scores_bf16's


def scores_bf16(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
    """block_scores_bf16 where the types allow it (numba-only: see the overload)."""
    raise NotImplementedError


@overload(scores_bf16)
def _scores_bf16_impl(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
    if BF16_DOT and q.dtype == types.uint16 and kb.dtype == types.uint16:
        return lambda q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale: block_scores_bf16(
            q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale)
    # Never called: bf16_dot_applies is False for these types. Typed all the same, as its branch's other side.
    return lambda q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale: None


def word_tiles_apply(q, dim):
    """Whether block_scores_words and block_values_words serve these queries (numba-only: see the overload)."""
    raise NotImplementedError


@overload(word_tiles_apply, inline="always")
def _word_tiles_apply_impl(q, dim):
    if WORD_TILES and not BF16_DOT and isinstance(q, types.Array) and q.dtype == types.uint16:
        return lambda q, dim: dim % WORD_VALUES == 0
    return lambda q, dim: False


@njit(nogil=True, fastmath=FASTMATH)
def softmax_update(scores, n, block_maxes, running_max, running_sum, acc):
    """Turns the block's scores into exp(score - new max) in place; rescales the history only when the max
    moved (exp(-inf) = 0 on the first block)."""
    prefer_wide_vectors()
    for g in range(scores.shape[0]):
        block_max = max(running_max[g], block_maxes[g])
        total = np.float32(0.0)
        for t in range(n):
            p = exp_nonpositive(scores[g, t] - block_max)
            scores[g, t] = p
            total += p
        if block_max > running_max[g]:
            alpha = np.float32(math.exp(running_max[g] - block_max))
            running_sum[g] *= alpha
            for d in range(acc.shape[1]):
                acc[g, d] *= alpha
            running_max[g] = block_max
        running_sum[g] += total


@njit(nogil=True, fastmath=FASTMATH)
def block_values_widened(vb, n, scores, acc, v_cache, next_block):
    """acc[g] += sum_t p[g, t] * v[t], four V rows a pass (each accumulator row loaded and stored once per four),
    the group's heads in quads, then a pair, then a single head; the tail rows (n % 4) one at a time."""
    prefer_wide_vectors()
    group, dim = acc.shape
    step = CACHE_LINE_BYTES // vb.itemsize
    quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
    for t in range(0, n4, 4):
        for r in range(4):
            prefetch_row(v_cache, next_block + (t + r) * dim, step)
        for g in range(0, quads, 4):
            a0, a1, a2, a3 = scores[g, t], scores[g + 1, t], scores[g + 2, t], scores[g + 3, t]
            b0, b1, b2, b3 = scores[g, t + 1], scores[g + 1, t + 1], scores[g + 2, t + 1], scores[g + 3, t + 1]
            c0, c1, c2, c3 = scores[g, t + 2], scores[g + 1, t + 2], scores[g + 2, t + 2], scores[g + 3, t + 2]
            e0, e1, e2, e3 = scores[g, t + 3], scores[g + 1, t + 3], scores[g + 2, t + 3], scores[g + 3, t + 3]
            for d in range(dim):
                x0, x1, x2, x3 = widen(vb[t, d]), widen(vb[t + 1, d]), widen(vb[t + 2, d]), widen(vb[t + 3, d])
                acc[g, d] += a0 * x0 + b0 * x1 + c0 * x2 + e0 * x3
                acc[g + 1, d] += a1 * x0 + b1 * x1 + c1 * x2 + e1 * x3
                acc[g + 2, d] += a2 * x0 + b2 * x1 + c2 * x2 + e2 * x3
                acc[g + 3, d] += a3 * x0 + b3 * x1 + c3 * x2 + e3 * x3
        for g in range(quads, pairs, 2):  # at most once
            a0, a1, b0, b1 = scores[g, t], scores[g + 1, t], scores[g, t + 1], scores[g + 1, t + 1]
            c0, c1, e0, e1 = scores[g, t + 2], scores[g + 1, t + 2], scores[g, t + 3], scores[g + 1, t + 3]
            for d in range(dim):
                x0, x1, x2, x3 = widen(vb[t, d]), widen(vb[t + 1, d]), widen(vb[t + 2, d]), widen(vb[t + 3, d])
                acc[g, d] += a0 * x0 + b0 * x1 + c0 * x2 + e0 * x3
                acc[g + 1, d] += a1 * x0 + b1 * x1 + c1 * x2 + e1 * x3
        for g in range(pairs, group):  # at most once (odd group)
            a, b, c, e = scores[g, t], scores[g, t + 1], scores[g, t + 2], scores[g, t + 3]
            for d in range(dim):
                acc[g, d] += a * widen(vb[t, d]) + b * widen(vb[t + 1, d]) + c * widen(vb[t + 2, d]) \
                    + e * widen(vb[t + 3, d])
    for t in range(n4, n):
        prefetch_row(v_cache, next_block + t * dim, step)
        for g in range(group):
            p = scores[g, t]
            for d in range(dim):
                acc[g, d] += p * widen(vb[t, d])
