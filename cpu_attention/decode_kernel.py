"""Numba kernel: paged decode attention over a head-major host KV cache.

Memory layout: k_cache / v_cache are [num_blocks, Hkv, block_size, D]. One block's kv heads are one contiguous
run of Hkv * block_size * D values, so a work item that takes a block's heads in order streams it front to
back; software prefetch runs PREFETCH_ROWS rows ahead (into L2) across the jumps between blocks that the hardware
prefetcher cannot see.

Element types: float32 arrays are used as they are. numba has neither bfloat16 nor float16, so both arrive as
16-bit patterns: bfloat16 as uint16, float16 as int16. The array's element type alone selects the widening to
float32, so one kernel source serves the three dtypes; all arithmetic is float32.

Contract: decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out,
lse)
- q [B, Hq, D] in the caches' element type, not scaled: scores are scale * q.k; Hq % Hkv == 0, query head h uses
  kv head h // (Hq / Hkv);
- block_tables int32 [B, max_blocks], -1 padded; entries past a context are never read;
- context_lens int32 [B]; a zero-length row gives out 0 and lse -inf;
- chunk_blocks: blocks per split (<= 0: plan_work's); num_threads: numba's thread count of the caller
  (numba.get_num_threads() inside the kernel would make it uncacheable);
- out float32 [B, Hq, D] and lse float32 [B, Hq] (natural log of sum exp(score)) are written;
- returns 0, or an ERRORS code before any KV is read.

Work split: an item is (sequence, split, run of kv heads); a split is chunk_blocks consecutive blocks of one
sequence, so one long sequence still feeds every core (split-K), and the run is all of a block's kv heads where
that leaves enough items (plan_work). Each (kv head) of an item runs an online softmax block by block: scores
of the whole block first, then max/exp, then the V accumulation; the group's query heads share every K/V row
they load (GQA). Each item widens its group's queries once and every K and V element as it is loaded; bfloat16
caches whose head_dim is a multiple of 32 are read as 32-bit words, two values a lane (the word tiles). With
OFFLOAD_ENGINE_BF16_DOT=1 on CPUs that have AVX-512 BF16, the products come from `vdpbf16ps` on the bit patterns
as stored instead (`_block_scores_bf16`, `_block_values_bf16`): 32 exact products an instruction, nothing
widened; it no longer measures faster (_use_bf16_dot). Workers take items from an atomic counter: numba's
OpenMP layer schedules prange statically, and one core busy with the engine's main thread must not hold up the
whole step. Partial results are merged per (sequence, query head) by log-sum-exp.

Everything this kernel inlines lives in this file on purpose: numba's on-disk cache is keyed on the source
file of the cached function alone, so a helper edited in another file would be served stale from the cache.
"""
import math
import os
import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# reassoc lets LLVM vectorize the dot-product and sum reductions, contract fuses multiply-adds. No nnan/ninf:
# -inf is a real value here (empty rows, the running max before the first block).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
CACHE_LINE_BYTES = 64
PREFETCH_ROWS = 64  # K/V rows fetched ahead of use: ~30 KiB at D=128 bf16, more than DRAM latency x bandwidth
ITEMS_PER_THREAD = 8  # enough items that the dynamic schedule ends evenly
MIN_ITEM_TOKENS = 256  # below this, an item's cold start and its merge cost more than its parallelism gains
ERRORS = {
    1: "a context length is negative or longer than its block table row",
    2: "a block table entry inside a context is outside the cache (negative or >= num_blocks)",
    3: "the step was abandoned before the device handed its layer over",
}
ABANDONED = 3


# ---- widening 16-bit patterns to float32 -------------------------------------------------------------------
def widen(x):
    """float32 value of one cache element (float32, bfloat16 pattern as uint16, float16 pattern as int16)."""
    raise NotImplementedError  # numba-only: see the overload below


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:  # bfloat16 is the top half of a float32
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if x == types.int16:
        return lambda x: _half_to_float(np.uint32(np.uint16(x)))
    return None


@njit(inline="always", fastmath=FASTMATH)
def _half_to_float(h):
    """float16 bits -> float32 with integer masks only (no per-element branch), so the loop vectorizes.

    Normals rebias the exponent (15 -> 127) and move the mantissa up 13 bits; inf/nan keep an all-ones
    exponent; zero and subnormals are m * 2**-24, exact in float32 and a normal float32 (immune to
    flush-to-zero modes).
    """
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = (h >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = h & np.uint32(0x3FF)
    normal = ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))
    special = np.uint32(0x7F800000) | (mantissa << np.uint32(13))
    small = np.float32(np.float32(mantissa) * np.float32(5.9604644775390625e-08)).view(np.uint32)
    special_mask = np.uint32(0) - np.uint32(exponent == np.uint32(31))
    small_mask = np.uint32(0) - np.uint32(exponent == np.uint32(0))
    bits = (normal & ~special_mask) | (special & special_mask)
    bits = (bits & ~small_mask) | (small & small_mask)
    return np.uint32(bits | sign).view(np.float32)


@njit(inline="always", fastmath=FASTMATH)
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (a score minus its running max), vectorizable; relative error ~2e-7.

    libm's expf is a scalar call per score and costs as much as the dot product; this is 2**(x*log2 e) as a
    power of two from the exponent bits times a degree-6 polynomial on [-0.5, 0.5]. Results below 2**-126
    clamp to 2**-126, which no sum that contains its own maximum (exp(0) = 1) can notice.
    """
    t = max(x * np.float32(1.4426950408889634), np.float32(-126.0))
    n = np.floor(t + np.float32(0.5))
    f = t - n
    p = np.float32(1.5353362e-4)
    p = p * f + np.float32(1.3398874e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022651e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    return np.int32(np.float32(p).view(np.int32) + (np.int32(n) << np.int32(23))).view(np.float32)


# ---- two LLVM instructions numba does not expose -----------------------------------------------------------
@intrinsic
def _prefetch(typingctx, arr, flat_index):
    """Cache hint for arr.ravel()[flat_index] (read, into L2); never faults, so any index is safe."""
    if not isinstance(arr, types.Array) or not isinstance(flat_index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        pointer = builder.bitcast(builder.gep(array.data, [index]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [pointer, i32(0), i32(2), i32(1)])  # locality 2: into L2, L1 stays for the block
        return context.get_dummy_value()

    return types.void(arr, flat_index), codegen


@intrinsic
def _count(typingctx, counters, index):
    """Atomic counters[index] += 1 with acquire-release order, returning the old value. As a ticket it hands out
    work items; as a tally of finished items, whoever reads the total (with acquire) sees every item's writes."""
    if not (isinstance(counters, types.Array) and counters.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", builder.gep(array.data, [index_value]), one, "acq_rel")

    return types.int64(counters, index), codegen


@intrinsic
def _prefer_wide_vectors(typingctx):
    """Lets LLVM vectorize the calling function's loops at the full AVX-512 width (16 float32 lanes).

    LLVM tunes Intel's AVX-512 server cores (skylake-avx512 up to sapphirerapids) to prefer 256-bit vectors, so
    every loop of this kernel came out at 8 lanes on the GPU hosts (Xeon, 2026-11-22), and the kernel was bound
    by its arithmetic at half what the cores can do. The function attribute "prefer-vector-width"="512"
    overrides that tuning for this function alone (and what it inlines); llvmlite's attribute set knows only
    flag attributes, hence set.add. On CPUs without AVX-512 the attribute changes nothing."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


# ---- AVX-512 BF16: dot products on bfloat16 bit patterns ------------------------------------------------------
def _host_has_bf16_dot() -> bool:
    """Whether this CPU has vdpbf16ps (AVX-512 BF16: Sapphire Rapids and later Xeons, Zen 4 and later)."""
    import llvmlite.binding as llvm

    return platform.machine().lower() in ("x86_64", "amd64") and bool(llvm.get_host_cpu_features().get("avx512bf16"))


def _use_bf16_dot() -> bool:
    """Whether bfloat16 caches take the vdpbf16ps path: only where OFFLOAD_ENGINE_BF16_DOT=1 and the CPU has it.

    Widening is the default. Since an item takes all of a block's kv heads (41aa389), widening led inside the host
    lane, the engine's path, in same-run comparisons on three calls on the H100 host's Xeon (decode_layers,
    36 x 32 x 2,048, Hq 32, of the read ceiling: 0.88 against 0.73 / 0.68, 0.71 against 0.65 / 0.49, 0.83 against
    0.71, where widening's repeat read 0.68). decode_kernel alone over 1 x 128k is a draw within the hosts' noise (benchmarks/
    NOTES.md, 2026-11-23). vdpbf16ps had led by 0-21% in the lane with one kv head an item. numba's cache keys the
    compiled kernel on the CPU, not on this variable, so a process that sets it needs its own NUMBA_CACHE_DIR."""
    return os.environ.get("OFFLOAD_ENGINE_BF16_DOT", "0") == "1" and _host_has_bf16_dot()


BF16_DOT = _use_bf16_dot()  # frozen into the compiled kernel, which numba caches per CPU model and features
BF16_LANES = 32  # bfloat16 values per vdpbf16ps operand: head_dim must be a multiple of this for the bf16 path


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat type, which llvmlite does not name: only ever a bitcast target for 16-bit patterns."""
    null = "0xR0000"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        return "0xR0000"


_BFloat._create_instance()
_FLOATS = ir.VectorType(ir.FloatType(), 16)  # a vdpbf16ps accumulator
_HALVES = ir.VectorType(ir.IntType(16), BF16_LANES)  # 32 bfloat16 patterns as loaded
_BFLOATS = ir.VectorType(_BFloat(), BF16_LANES)  # the same bits as vdpbf16ps takes them


def _tile_addresses(context, builder, signature, args):
    """LLVM's intp and a tile's seven integer arguments as intp (addresses, row strides in bytes, dim)."""
    return context.get_value_type(types.intp), [context.cast(builder, args[i], signature.args[i], types.intp)
                                                for i in range(7)]


def _tile_setup(context, builder, signature, args):
    """What every vdpbf16ps tile's codegen starts from: _tile_addresses and the vdpbf16ps intrinsic."""
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS, _BFLOATS, _BFLOATS]),
                                         "llvm.x86.avx512bf16.dpbf16ps.512")
    return (*_tile_addresses(context, builder, signature, args), dot)


def _store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, scale):
    """scores[i, j] = scale (an LLVM float) times the total of vectors[i * num_rows + j], rows of num_rows float32
    at s_addr + i * s_step: one _reduce_across for the whole tile, then one store a head."""
    lanes, owner = _reduce_across(builder, vectors)
    lanes = builder.fmul(lanes, _splat(builder, scale, 16))
    for i in range(num_heads):
        address = builder.add(s_addr, builder.mul(s_step, intp(i)))
        if num_rows == 1:
            value = builder.extract_element(lanes, ir.IntType(32)(owner.index(i)))
            builder.store(value, builder.inttoptr(address, ir.FloatType().as_pointer()))
            continue
        row = builder.shuffle_vector(lanes, lanes, ir.Constant(
            ir.VectorType(ir.IntType(32), num_rows), [owner.index(i * num_rows + j) for j in range(num_rows)]))
        builder.store(row, builder.inttoptr(address, ir.VectorType(ir.FloatType(), num_rows).as_pointer()), align=4)


def _bf16_tile(num_heads, num_rows):
    """An intrinsic tile(q, q_row, k, k_row, scores, score_row, dim, scale), on addresses and row strides in bytes
    (ints): scores[i, j] = scale * q[i] . k[j] for i < num_heads, j < num_rows, where q and k hold uint16 bfloat16
    patterns, rows of `dim` values (a multiple of BF16_LANES), and scores float32.

    Every 32-value stretch of a query row and a K row is one vdpbf16ps into a float32 accumulator per (head,
    row): each product is exact in float32 and the sums are float32, as in the widening path, in another order.
    The heads x rows accumulators share each load, as the widening path's sums do. Addresses, not arrays: numba
    increments and decrements an array argument's reference count around every call, atomically, on one cache
    line that every worker shares (that made this path slower than widening)."""

    @intrinsic
    def tile(typingctx, q, q_row, k, k_row, scores, score_row, dim, scale):
        def codegen(context, builder, signature, args):
            intp, (q_addr, q_step, k_addr, k_step, s_addr, s_step, length), dot = _tile_setup(
                context, builder, signature, args)
            sums = [[cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, None)) for _ in range(num_rows)]
                    for _ in range(num_heads)]

            def load(address):
                pointer = builder.inttoptr(address, _HALVES.as_pointer())
                return builder.bitcast(builder.load(pointer, align=2), _BFLOATS)

            with cgutils.for_range(builder, builder.udiv(length, intp(BF16_LANES))) as loop:
                offset = builder.mul(loop.index, intp(2 * BF16_LANES))  # bytes
                qs = [load(builder.add(builder.add(q_addr, builder.mul(q_step, intp(i))), offset))
                      for i in range(num_heads)]
                ks = [load(builder.add(builder.add(k_addr, builder.mul(k_step, intp(j))), offset))
                      for j in range(num_rows)]
                for i in range(num_heads):
                    for j in range(num_rows):
                        builder.store(builder.call(dot, [builder.load(sums[i][j]), qs[i], ks[j]]), sums[i][j])
            vectors = [builder.load(sums[i][j]) for i in range(num_heads) for j in range(num_rows)]
            _store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, args[7])
            return context.get_dummy_value()

        integers = (q, q_row, k, k_row, scores, score_row, dim)
        if not (all(isinstance(a, types.Integer) for a in integers) and scale == types.float32):
            return None
        return types.void(q, q_row, k, k_row, scores, score_row, dim, scale), codegen

    return tile


def _splat(builder, value, count):
    """<count x float> with every lane `value`."""
    vector = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), count), None), value, ir.IntType(32)(0))
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(ir.IntType(32), count), [0] * count))


def _reduce_across(builder, vectors):
    """Sums each of n <16 x float> vectors (n a power of two <= 16) into one vector of 16 lanes: returns (vector,
    owner), owner[lane] = which input's total the lane holds (every input owns at least one lane).

    One horizontal sum per vector costs four shuffles and four adds, 64 of each for the 16 sums of a 4 x 4 tile,
    more than its dot products. Here each step adds pairs of vectors after two shuffles that put the two halves
    of every partial sum side by side, so the partial sums of two inputs share one vector: 15 adds and 30
    shuffles for 16 inputs. Fewer inputs finish by folding the vector onto itself."""
    index = lambda values: ir.Constant(ir.VectorType(ir.IntType(32), 16), values)
    owners = [[k] * 16 for k in range(len(vectors))]
    half = 8
    while half >= 1:
        paired = len(vectors) > 1
        nxt, nxt_owners = [], []
        for m in range(0, len(vectors), 2 if paired else 1):
            a, b = vectors[m], vectors[m + 1] if paired else vectors[m]
            oa, ob = owners[m], owners[m + 1] if paired else owners[m]
            lo, hi, owner = [], [], []
            for p in range(16):
                first = (p // half) % 2 == 0 or not paired
                lane = (p // (2 * half)) * 2 * half + p % half
                offset = 0 if first else 16
                lo.append(lane + offset)
                hi.append(lane + half + offset)
                owner.append((oa if first else ob)[lane])
            nxt.append(builder.fadd(builder.shuffle_vector(a, b, index(lo)), builder.shuffle_vector(a, b, index(hi))))
            nxt_owners.append(owner)
        vectors, owners = nxt, nxt_owners
        half //= 2
    return vectors[0], owners[0]


def _bf16_values_tile(num_heads, num_rows):
    """An intrinsic tile(v, v_row, p, p_row, acc, acc_row, dim), on addresses and row strides in bytes (ints):
    acc[i] += sum_j p[i, j] * v[j] for i < num_heads, j < num_rows, where v holds uint16 bfloat16 patterns (rows
    of `dim` values, a multiple of BF16_LANES), p and acc float32.

    vdpbf16ps multiplies pairs: two V rows are interleaved value by value (one shuffle per 32 values), and the two
    rows' probabilities, rounded to bfloat16 (as flash-attention rounds P before its P x V product), are
    broadcast as one pair. Each product is exact in float32 and the sums are float32. An odd last row pairs with
    zeros. Eight rows a tile: each accumulator row is loaded and stored once per eight V rows."""

    @intrinsic
    def tile(typingctx, v, v_row, p, p_row, acc, acc_row, dim):
        def codegen(context, builder, signature, args):
            intp, (v_addr, v_step, p_addr, p_step, a_addr, a_step, length), dot = _tile_setup(
                context, builder, signature, args)
            i32 = ir.IntType(32)
            at = lambda address, kind: builder.inttoptr(address, kind.as_pointer())
            pairs = (num_rows + 1) // 2
            weights = []  # [head][pair]: the pair's two probabilities in bfloat16, in every lane
            for i in range(num_heads):
                row = builder.add(p_addr, builder.mul(p_step, intp(i)))
                weights.append([])
                for k in range(pairs):
                    pair = ir.Constant(ir.VectorType(_BFloat(), 2), None)
                    for r in range(2):
                        if 2 * k + r < num_rows:
                            value = builder.load(at(builder.add(row, intp(4 * (2 * k + r))), ir.FloatType()), align=4)
                            pair = builder.insert_element(pair, builder.fptrunc(value, _BFloat()), i32(r))
                    bits = builder.bitcast(pair, i32)
                    splat = builder.insert_element(ir.Constant(ir.VectorType(i32, 16), None), bits, i32(0))
                    splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(i32, 16), [0] * 16))
                    weights[i].append(builder.bitcast(splat, _BFLOATS))
            low = ir.Constant(ir.VectorType(i32, BF16_LANES), [w // 2 + (w % 2) * BF16_LANES for w in range(BF16_LANES)])
            high = ir.Constant(ir.VectorType(i32, BF16_LANES), [16 + w // 2 + (w % 2) * BF16_LANES for w in range(BF16_LANES)])
            zeros = ir.Constant(_HALVES, None)
            with cgutils.for_range(builder, builder.udiv(length, intp(BF16_LANES))) as loop:
                offset = builder.mul(loop.index, intp(2 * BF16_LANES))  # bytes into a V row
                rows = [builder.load(at(builder.add(builder.add(v_addr, builder.mul(v_step, intp(j))), offset), _HALVES),
                                     align=2) for j in range(num_rows)]
                # Values 0-15 of the pair's rows interleaved, then values 16-31: the float32 lanes stay in order.
                mixed = []
                for k in range(pairs):
                    first, second = rows[2 * k], rows[2 * k + 1] if 2 * k + 1 < num_rows else zeros
                    mixed.append((builder.bitcast(builder.shuffle_vector(first, second, low), _BFLOATS),
                                  builder.bitcast(builder.shuffle_vector(first, second, high), _BFLOATS)))
                for i in range(num_heads):
                    base = builder.add(builder.add(a_addr, builder.mul(a_step, intp(i))), builder.add(offset, offset))
                    halves_at = (at(base, _FLOATS), at(builder.add(base, intp(64)), _FLOATS))
                    for h in range(2):
                        total = builder.load(halves_at[h], align=4)
                        for k in range(pairs):
                            total = builder.call(dot, [total, weights[i][k], mixed[k][h]])
                        builder.store(total, halves_at[h], align=4)
            return context.get_dummy_value()

        if not all(isinstance(a, types.Integer) for a in (v, v_row, p, p_row, acc, acc_row, dim)):
            return None
        return types.void(v, v_row, p, p_row, acc, acc_row, dim), codegen

    return tile


_vtile_4x8, _vtile_2x8, _vtile_1x8 = _bf16_values_tile(4, 8), _bf16_values_tile(2, 8), _bf16_values_tile(1, 8)
_vtile_4x1, _vtile_2x1, _vtile_1x1 = _bf16_values_tile(4, 1), _bf16_values_tile(2, 1), _bf16_values_tile(1, 1)

_tile_4x4, _tile_2x4, _tile_1x4, _tile_1x1 = _bf16_tile(4, 4), _bf16_tile(2, 4), _bf16_tile(1, 4), _bf16_tile(1, 1)


# ---- bfloat16 as 32-bit words: two values widened per lane ---------------------------------------------------
# Widening value by value costs two instructions per 16 bfloat16 values (zero-extend, shift), and each (head, row)
# dot product ends in a horizontal sum of its own: on the GPU hosts' Xeons the arithmetic, not the memory, set
# the kernel's rate over one long sequence (benchmarks/NOTES.md, 2026-11-23). Loaded as 16 32-bit words, 32 values
# are one vector: shifted up 16 bits, each word's low half (the even value; x86 and ARM are little-endian) is its
# float32, and masked, the high half (the odd value) is. Two instructions per 32 values; the products and sums
# run on even and odd values apart, so queries and accumulators are held in that order within every stretch of
# 32 (_split_pairs, undone by _join_pairs), and a tile's dot products are summed by one _reduce_across. The
# products are the widening path's, exact in float32; only the order of the float32 sums differs.
# OFFLOAD_ENGINE_WORD_TILES=0 turns the path off (value by value, as before); like OFFLOAD_ENGINE_BF16_DOT, frozen
# into the compiled kernel, so a process that sets it needs its own NUMBA_CACHE_DIR.
WORD_TILES = sys.byteorder == "little" and os.environ.get("OFFLOAD_ENGINE_WORD_TILES", "1") != "0"
WORD_VALUES = 32  # bfloat16 values per word vector: head_dim must be a multiple of this
_WORDS = ir.VectorType(ir.IntType(32), 16)


def _load_at(builder, address, kind, align):
    return builder.load(builder.inttoptr(address, kind.as_pointer()), align=align)


def _store_at(builder, value, address, align):
    builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=align)


def _word_halves(builder, words):
    """(even, odd): the float32 values of the 32 bfloat16 patterns in 16 words."""
    even = builder.bitcast(builder.shl(words, ir.Constant(_WORDS, [16] * 16)), _FLOATS)
    odd = builder.bitcast(builder.and_(words, ir.Constant(_WORDS, [-65536] * 16)), _FLOATS)  # 0xFFFF0000
    return even, odd


def _multiply_add(builder):
    """llvm.fmuladd on 16 float32 lanes: a * b + c, fused where the CPU has FMA."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS] * 3),
                                          "llvm.fmuladd.v16f32")


def _word_scores_tile(num_heads, num_rows):
    """An intrinsic tile(q, q_row, k, k_row, scores, score_row, dim, scale), on addresses and row strides in bytes
    (ints): scores[i, j] = scale * q[i] . k[j] for i < num_heads, j < num_rows, where k holds bfloat16 patterns in
    rows of `dim` (a multiple of WORD_VALUES) and q float32 queries in even/odd order (_split_pairs).

    Tiles of fewer than eight (head, row) pairs keep even and odd sums apart, so that at least eight chains of
    multiply-adds are in flight."""
    apart = num_heads * num_rows < 8

    @intrinsic
    def tile(typingctx, q, q_row, k, k_row, scores, score_row, dim, scale):
        def codegen(context, builder, signature, args):
            intp, (q_addr, q_step, k_addr, k_step, s_addr, s_step, length) = _tile_addresses(
                context, builder, signature, args)
            fma = _multiply_add(builder)
            sums = [[[cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, None)) for _ in range(1 + apart)]
                     for _ in range(num_rows)] for _ in range(num_heads)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                k_offset = builder.mul(loop.index, intp(2 * WORD_VALUES))  # bytes into a K row
                q_offset = builder.mul(loop.index, intp(4 * WORD_VALUES))  # bytes into a query row
                halves = [_word_halves(builder, _load_at(
                    builder, builder.add(builder.add(k_addr, builder.mul(k_step, intp(j))), k_offset), _WORDS, 2))
                    for j in range(num_rows)]
                for i in range(num_heads):
                    base = builder.add(builder.add(q_addr, builder.mul(q_step, intp(i))), q_offset)
                    queries = (_load_at(builder, base, _FLOATS, 4),
                               _load_at(builder, builder.add(base, intp(64)), _FLOATS, 4))
                    for j in range(num_rows):
                        for half in range(2):
                            total = sums[i][j][half if apart else 0]
                            builder.store(builder.call(fma, [queries[half], halves[j][half], builder.load(total)]),
                                          total)
            vectors = []
            for i in range(num_heads):
                for j in range(num_rows):
                    total = builder.load(sums[i][j][0])
                    vectors.append(builder.fadd(total, builder.load(sums[i][j][1])) if apart else total)
            _store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, args[7])
            return context.get_dummy_value()

        integers = (q, q_row, k, k_row, scores, score_row, dim)
        if not (all(isinstance(a, types.Integer) for a in integers) and scale == types.float32):
            return None
        return types.void(*integers, scale), codegen

    return tile


def _word_values_tile(num_heads, num_rows):
    """An intrinsic tile(v, v_row, p, p_row, acc, acc_row, dim), on addresses and row strides in bytes (ints):
    acc[i] += sum_j p[i, j] * v[j] for i < num_heads, j < num_rows, where v holds bfloat16 patterns in rows of
    `dim` (a multiple of WORD_VALUES), p is float32 and acc float32 rows in even/odd order (_join_pairs puts them
    back). Each accumulator row is loaded and stored once per tile, and each probability broadcast once."""

    @intrinsic
    def tile(typingctx, v, v_row, p, p_row, acc, acc_row, dim):
        def codegen(context, builder, signature, args):
            intp, (v_addr, v_step, p_addr, p_step, a_addr, a_step, length) = _tile_addresses(
                context, builder, signature, args)
            fma = _multiply_add(builder)
            weights = [[_splat(builder, _load_at(builder, builder.add(builder.add(p_addr, builder.mul(p_step, intp(i))),
                                                                      intp(4 * j)), ir.FloatType(), 4), 16)
                        for j in range(num_rows)] for i in range(num_heads)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                v_offset = builder.mul(loop.index, intp(2 * WORD_VALUES))  # bytes into a V row
                a_offset = builder.mul(loop.index, intp(4 * WORD_VALUES))  # bytes into an accumulator row
                halves = [_word_halves(builder, _load_at(
                    builder, builder.add(builder.add(v_addr, builder.mul(v_step, intp(j))), v_offset), _WORDS, 2))
                    for j in range(num_rows)]
                for i in range(num_heads):
                    base = builder.add(builder.add(a_addr, builder.mul(a_step, intp(i))), a_offset)
                    for half in range(2):
                        address = builder.add(base, intp(64 * half))
                        total = _load_at(builder, address, _FLOATS, 4)
                        for j in range(num_rows):
                            total = builder.call(fma, [weights[i][j], halves[j][half], total])
                        _store_at(builder, total, address, 4)
            return context.get_dummy_value()

        integers = (v, v_row, p, p_row, acc, acc_row, dim)
        if not all(isinstance(a, types.Integer) for a in integers):
            return None
        return types.void(*integers), codegen

    return tile


def _row_shuffle(first_half, second_half, doc):
    """An intrinsic shuffle(address, dim) rearranging a float32 row of `dim` values (a multiple of WORD_VALUES) in
    place, 32 at a time: the stretch's two 16-lane vectors a, b become shuffle(a, b, first_half) and shuffle(a, b,
    second_half)."""

    @intrinsic
    def shuffle(typingctx, address, dim):
        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)
            start, length = (context.cast(builder, args[i], signature.args[i], types.intp) for i in range(2))
            masks = [ir.Constant(ir.VectorType(ir.IntType(32), 16), half) for half in (first_half, second_half)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                base = builder.add(start, builder.mul(loop.index, intp(4 * WORD_VALUES)))
                a = _load_at(builder, base, _FLOATS, 4)
                b = _load_at(builder, builder.add(base, intp(64)), _FLOATS, 4)
                for half, mask in enumerate(masks):
                    _store_at(builder, builder.shuffle_vector(a, b, mask), builder.add(base, intp(64 * half)), 4)
            return context.get_dummy_value()

        if not (isinstance(address, types.Integer) and isinstance(dim, types.Integer)):
            return None
        return types.void(address, dim), codegen

    shuffle.__doc__ = doc
    return shuffle


_split_pairs = _row_shuffle(list(range(0, 32, 2)), list(range(1, 32, 2)),
                            "A row into even/odd order: in each stretch of 32, the even-indexed values, then the odd.")
_join_pairs = _row_shuffle([w // 2 + (w % 2) * 16 for w in range(16)], [8 + w // 2 + (w % 2) * 16 for w in range(16)],
                           "_split_pairs undone.")


@intrinsic
def _max_of(typingctx, address, count):
    """The largest of `count` float32 values at `address` (count >= 1, none NaN): 16 lanes at a time, then a fold
    across the lanes and the rest one by one. numba's max() does not vectorize as a reduction, and a scalar chain of
    compares over a block's scores costs as much as a tile of its dot products."""
    if not (isinstance(address, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        start, length = (context.cast(builder, args[i], signature.args[i], types.intp) for i in range(2))

        def larger(a, b):
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        top = cgutils.alloca_once_value(builder, _splat(builder, ir.Constant(ir.FloatType(), -math.inf), 16))
        whole = builder.udiv(length, intp(16))
        with cgutils.for_range(builder, whole) as loop:
            vector = _load_at(builder, builder.add(start, builder.mul(loop.index, intp(64))), _FLOATS, 4)
            builder.store(larger(vector, builder.load(top)), top)
        vector = builder.load(top)
        for half in (8, 4, 2, 1):
            rotated = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                                          [(p + half) % 16 for p in range(16)]))
            vector = larger(rotated, vector)
        best = cgutils.alloca_once_value(builder, builder.extract_element(vector, ir.IntType(32)(0)))
        with cgutils.for_range_slice(builder, builder.mul(whole, intp(16)), length, intp(1)) as (index, _):
            value = _load_at(builder, builder.add(start, builder.mul(index, intp(4))), ir.FloatType(), 4)
            builder.store(larger(value, builder.load(best)), best)
        return builder.load(best)

    return types.float32(address, count), codegen


_wtile_4x4, _wtile_2x4, _wtile_1x4, _wtile_1x1 = (_word_scores_tile(4, 4), _word_scores_tile(2, 4),
                                                  _word_scores_tile(1, 4), _word_scores_tile(1, 1))
_wvtile_4x8, _wvtile_2x8, _wvtile_1x8 = _word_values_tile(4, 8), _word_values_tile(2, 8), _word_values_tile(1, 8)
_wvtile_4x1, _wvtile_2x1, _wvtile_1x1 = _word_values_tile(4, 1), _word_values_tile(2, 1), _word_values_tile(1, 1)


# ---- the split plan ----------------------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def plan_work(context_lens, block_size, num_kv_heads, num_threads):
    """(chunk_blocks, item_heads): a work item is up to chunk_blocks consecutive blocks of one sequence (a split)
    for item_heads consecutive kv heads. About ITEMS_PER_THREAD items a thread over all (block, kv head) pairs,
    no split shorter than MIN_ITEM_TOKENS (or one block), and as many heads an item as that leaves room for.

    Why whole heads: a block's kv heads lie side by side in the cache, so an item that takes them all streams
    one run of num_kv_heads x block_size rows, where one head a block reads block_size rows and jumps. Measured
    on the H100 host, 1 x 128k at Hq 32 on 14 threads: 9.09 -> 7.46 and 9.47 -> 7.87 ms, 7.55 -> 7.49 in a
    third call (benchmarks/NOTES.md). A plain sum over the same pages read alike in either order, so the gain is
    in how the kernel's prefetch and arithmetic overlap along the longer runs, not in the memory system alone."""
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
def _check_tables(block_tables, context_lens, num_blocks, block_size):
    for b in range(context_lens.shape[0]):
        n = context_lens[b]
        if n < 0 or n > block_tables.shape[1] * block_size:
            return 1
        for j in range((n + block_size - 1) // block_size):
            if block_tables[b, j] < 0 or block_tables[b, j] >= num_blocks:
                return 2
    return 0


# ---- one block: scores, softmax update, values --------------------------------------------------------------
@njit(inline="always")
def _prefetch_row(cache, row_start, step):
    for c in range(0, cache.shape[3], step):
        _prefetch(cache, row_start + c)


@njit(nogil=True, fastmath=FASTMATH)
def _block_scores(q, h0, group, kb, n, scores, block_max, k_cache, next_block):
    """scores[g, t] = q[h0 + g] . k[t] for the n valid rows of one K block, and block_max[g] = max_t scores.

    Four rows at a time, the group's heads in quads, then a pair, then a single head (the group's remainder
    mod 4 is 0-3 heads): every widened K element feeds every head of the pass (the GQA group shares the load)
    and every q element four rows, and the pass's sums' horizontal reductions overlap each other. The pair and
    single passes are not rare leftovers: group 2 (Qwen3-0.6B, 16/8 heads) runs only the pair pass, group 1
    only the single one, and one dot per row would be a chain of loads and reductions that never overlap.
    The tail rows (n % 4) take one _dot per head. The max is taken here, one step per four rows, because a
    separate pass is a serial chain of compares.
    """
    _prefer_wide_vectors()
    block_max[:] = -np.inf
    dim = kb.shape[1]
    step = CACHE_LINE_BYTES // kb.itemsize
    quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
    for t in range(0, n4, 4):
        for r in range(4):
            _prefetch_row(k_cache, next_block + (t + r) * dim, step)
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
        _prefetch_row(k_cache, next_block + t * dim, step)
        for g in range(group):
            scores[g, t] = _dot(q, h0 + g, kb, t)
            block_max[g] = max(block_max[g], scores[g, t])


@njit(inline="always", fastmath=FASTMATH)
def _dot(q, head, kb, t):
    s = np.float32(0.0)
    for d in range(kb.shape[1]):
        s += q[head, d] * widen(kb[t, d])
    return s


def _bf16_dot_applies(q, dim):
    """Whether _block_scores_bf16 serves these queries (numba-only: see the overload)."""
    raise NotImplementedError


@overload(_bf16_dot_applies, inline="always")
def _bf16_dot_applies_impl(q, dim):
    if BF16_DOT and isinstance(q, types.Array) and q.dtype == types.uint16:
        return lambda q, dim: dim % BF16_LANES == 0
    return lambda q, dim: False


def _tiled_block_scores(tile_4x4, tile_2x4, tile_1x4, tile_1x1):
    """_block_scores on tiles (the vdpbf16ps or the word tiles' scores): scores[g, t] = scale * q[h0 + g] . k[t]
    for the n valid rows of one K block, the same passes (four rows by a quad, a pair or a single head of the
    group, then the tail rows one by one), then each head's max. q holds the queries each tile kind reads."""

    @njit(nogil=True)
    def block_scores(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
        dim = kb.shape[1]
        step = CACHE_LINE_BYTES // kb.itemsize
        quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
        q_step, k_step, s_step = q.strides[0], kb.strides[0], scores.strides[0]
        heads, rows, out = q.ctypes.data + h0 * q_step, kb.ctypes.data, scores.ctypes.data
        for t in range(0, n4, 4):
            for r in range(4):
                _prefetch_row(k_cache, next_block + (t + r) * dim, step)
            k = rows + t * k_step
            for g in range(0, quads, 4):
                tile_4x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
            for g in range(quads, pairs, 2):
                tile_2x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
            for g in range(pairs, group):
                tile_1x4(heads + g * q_step, q_step, k, k_step, out + g * s_step + 4 * t, s_step, dim, scale)
        for t in range(n4, n):
            _prefetch_row(k_cache, next_block + t * dim, step)
            for g in range(group):
                tile_1x1(heads + g * q_step, q_step, rows + t * k_step, k_step, out + g * s_step + 4 * t, s_step, dim,
                         scale)
        for g in range(group):
            block_max[g] = _max_of(out + g * s_step, n)

    return block_scores


def _tiled_block_values(tile_4x8, tile_2x8, tile_1x8, tile_4x1, tile_2x1, tile_1x1):
    """_block_values on tiles (the vdpbf16ps or the word tiles' P x V): acc[g] += sum_t p[g, t] * v[t], eight rows
    a pass, the group's heads in quads, then a pair, then a single head; the last n % 8 rows (a partial last block
    only, at the host tier's block sizes) one at a time. acc is in the order its tile kind keeps."""

    @njit(nogil=True)
    def block_values(vb, n, scores, acc, v_cache, next_block):
        group, dim = acc.shape
        step = CACHE_LINE_BYTES // vb.itemsize
        quads, pairs, n8 = group - group % 4, group - group % 2, n - n % 8
        v_step, p_step, a_step = vb.strides[0], scores.strides[0], acc.strides[0]
        rows, weights, sums = vb.ctypes.data, scores.ctypes.data, acc.ctypes.data
        for t in range(0, n8, 8):
            for r in range(8):
                _prefetch_row(v_cache, next_block + (t + r) * dim, step)
            v = rows + t * v_step
            for g in range(0, quads, 4):
                tile_4x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(quads, pairs, 2):
                tile_2x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(pairs, group):
                tile_1x8(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
        for t in range(n8, n):
            _prefetch_row(v_cache, next_block + t * dim, step)
            v = rows + t * v_step
            for g in range(0, quads, 4):
                tile_4x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(quads, pairs, 2):
                tile_2x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)
            for g in range(pairs, group):
                tile_1x1(v, v_step, weights + g * p_step + 4 * t, p_step, sums + g * a_step, a_step, dim)

    return block_values


# vdpbf16ps: unscaled bfloat16 queries as stored, P rounded to bfloat16 in pairs of V rows (_bf16_values_tile).
_block_scores_bf16 = _tiled_block_scores(_tile_4x4, _tile_2x4, _tile_1x4, _tile_1x1)
_block_values_bf16 = _tiled_block_values(_vtile_4x8, _vtile_2x8, _vtile_1x8, _vtile_4x1, _vtile_2x1, _vtile_1x1)
# Word tiles: unscaled float32 queries and the accumulators in even/odd order (_split_pairs, _join_pairs).
_block_scores_words = _tiled_block_scores(_wtile_4x4, _wtile_2x4, _wtile_1x4, _wtile_1x1)
_block_values_words = _tiled_block_values(_wvtile_4x8, _wvtile_2x8, _wvtile_1x8, _wvtile_4x1, _wvtile_2x1,
                                          _wvtile_1x1)


def _values_bf16(vb, n, scores, acc, v_cache, next_block):
    """_block_values_bf16 where the types allow it (numba-only: see the overload)."""
    raise NotImplementedError


@overload(_values_bf16)
def _values_bf16_impl(vb, n, scores, acc, v_cache, next_block):
    if BF16_DOT and vb.dtype == types.uint16:
        return lambda vb, n, scores, acc, v_cache, next_block: _block_values_bf16(vb, n, scores, acc, v_cache,
                                                                                  next_block)
    return lambda vb, n, scores, acc, v_cache, next_block: None  # never called, as _scores_bf16's


def _scores_bf16(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
    """_block_scores_bf16 where the types allow it (numba-only: see the overload)."""
    raise NotImplementedError


@overload(_scores_bf16)
def _scores_bf16_impl(q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale):
    if BF16_DOT and q.dtype == types.uint16 and kb.dtype == types.uint16:
        return lambda q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale: _block_scores_bf16(
            q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale)
    # Never called: _bf16_dot_applies is False for these types. Typed all the same, as its branch's other side.
    return lambda q, h0, group, kb, n, scores, block_max, k_cache, next_block, scale: None


def _word_tiles_apply(q, dim):
    """Whether _block_scores_words and _block_values_words serve these queries (numba-only: see the overload)."""
    raise NotImplementedError


@overload(_word_tiles_apply, inline="always")
def _word_tiles_apply_impl(q, dim):
    if WORD_TILES and not BF16_DOT and isinstance(q, types.Array) and q.dtype == types.uint16:
        return lambda q, dim: dim % WORD_VALUES == 0
    return lambda q, dim: False


@njit(nogil=True, fastmath=FASTMATH)
def _softmax_update(scores, n, block_maxes, running_max, running_sum, acc):
    """Turns the block's scores into exp(score - new max) in place; rescales the history only when the max
    moved (exp(-inf) = 0 on the first block)."""
    _prefer_wide_vectors()
    for g in range(scores.shape[0]):
        block_max = max(running_max[g], block_maxes[g])
        total = np.float32(0.0)
        for t in range(n):
            p = _exp_nonpositive(scores[g, t] - block_max)
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
def _block_values(vb, n, scores, acc, v_cache, next_block):
    """acc[g] += sum_t p[g, t] * v[t], four V rows per pass, so each accumulator row is loaded and stored once
    per four V rows instead of once per row: the group's heads in quads, then a pair (group 2 runs only this
    one), then a single head, so that every widened V element feeds as many heads as the group has left. The
    tail rows (n % 4) go one row at a time."""
    _prefer_wide_vectors()
    group, dim = acc.shape
    step = CACHE_LINE_BYTES // vb.itemsize
    quads, pairs, n4 = group - group % 4, group - group % 2, n - n % 4
    for t in range(0, n4, 4):
        for r in range(4):
            _prefetch_row(v_cache, next_block + (t + r) * dim, step)
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
        _prefetch_row(v_cache, next_block + t * dim, step)
        for g in range(group):
            p = scores[g, t]
            for d in range(dim):
                acc[g, d] += p * widen(vb[t, d])


# ---- one work item and the merge ---------------------------------------------------------------------------
@njit(nogil=True, fastmath=FASTMATH)
def _attend_split(q, scale, wide_q, k_cache, v_cache, table_row, context_len, h0, heads, first, last, accs, stats,
                  scores):
    """Online softmax of one sequence's kv heads h0..h0+heads-1 over blocks first..last-1 of its table row, in
    the cache's order: block by block, and within a block head by head. q [Hq, D] is the sequence's query as
    given; wide_q [Hq, D] is the worker's scratch for the heads' queries widened and scaled, where the scores do
    not come from bfloat16 dot products (in even/odd order and unscaled where the word tiles apply: they scale
    their sums). accs[i] [group, D]
    accumulates head h0 + i (in even/odd order on the word tiles until the end); stats is the worker's scratch:
    row 0 the block max, rows 1 + 2i and 2 + 2i head h0 + i's running max and sum."""
    _prefer_wide_vectors()
    group, dim = accs.shape[1], accs.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    bf16, words = _bf16_dot_applies(q, dim), _word_tiles_apply(q, dim)
    if not bf16:
        factor = np.float32(1.0) if words else scale  # the word tiles scale their sums, as the vdpbf16ps tiles do
        for g in range(h0 * group, (h0 + heads) * group):
            for d in range(dim):
                wide_q[g, d] = widen(q[g, d]) * factor
            if words:
                _split_pairs(wide_q.ctypes.data + g * wide_q.strides[0], dim)
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
            _prefetch(k_cache, start + c)
            _prefetch(v_cache, start + c)
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
            _scores_bf16(q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run, scale)
        elif words:
            _block_scores_words(wide_q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run,
                                scale)
        else:
            _block_scores(wide_q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, next_run)
        _softmax_update(scores, n, block_max, running_max, running_sum, accs[i])
        if bf16:
            _values_bf16(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
        elif words:
            _block_values_words(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
        else:
            _block_values(v_cache[block, h], n, scores, accs[i], v_cache, next_run)
    if words:  # the accumulators back in natural order for the merge
        for i in range(heads):
            for g in range(group):
                _join_pairs(accs.ctypes.data + i * accs.strides[0] + g * accs.strides[1], dim)


@njit(nogil=True, fastmath=FASTMATH)
def _merge_splits(part_acc, part_max, part_sum, first, stop, stride, g, out_row):
    """out_row = softmax-weighted merge of items range(first, stop, stride) for query head g; returns the lse."""
    _prefer_wide_vectors()
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
def _work_plan(context_lens, block_size, num_kv_heads, group, dim, chunk_blocks, num_threads):
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
def _worker_scratch(num_workers, block_size, group, num_kv_heads):
    """Per worker: scores [group, block_size], then the block max, then a running max and sum per kv head, then
    an unused row, rows padded to 64 bytes, so no two workers ever write into one cache line."""
    stride = (max(block_size, group) + 15) // 16 * 16
    return np.empty((num_workers, group + 2 + 2 * num_kv_heads, stride), np.float32)


@njit(nogil=True, cache=True)
def _worker_queries(num_workers, num_q_heads, dim):
    """Per worker: its item's queries, widened and scaled [Hq, D] (C-contiguous, so the dot products
    vectorize)."""
    return np.empty((num_workers, num_q_heads, dim), np.float32)


@njit(nogil=True, fastmath=FASTMATH)
def _attend_item(item, q, scale, wide_q, k_cache, v_cache, block_tables, context_lens, split_seq, offsets,
                 chunk_blocks, item_heads, part_acc, part_max, part_sum, scores, stats):
    """Work item `item` = (split, run of item_heads kv heads) into its partials p = split * Hkv + h: part_acc[p],
    part_max[p], part_sum[p]. wide_q, scores and stats are the worker's scratch (see _attend_split)."""
    _prefer_wide_vectors()  # LLVM inlines the block loops here: the attribute must be on this function too
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
def _merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out, lse):
    """Output row `row` = (sequence, query head) from its sequence's partials: out[b, hq] and lse[b, hq]."""
    _prefer_wide_vectors()
    num_q_heads = out.shape[1]
    group = num_q_heads // num_kv_heads
    b, hq = row // num_q_heads, row % num_q_heads
    h, g = hq // group, hq % group
    lse[b, hq] = _merge_splits(part_acc, part_max, part_sum, offsets[b] * num_kv_heads + h,
                               offsets[b + 1] * num_kv_heads, num_kv_heads, g, out[b, hq])


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse):
    batch, num_q_heads, dim = q.shape
    num_blocks, num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    error = _check_tables(block_tables, context_lens, num_blocks, block_size)
    if error:
        return error
    chunk_blocks, item_heads, num_items, offsets, split_seq, part_acc, part_max, part_sum = _work_plan(
        context_lens, block_size, num_kv_heads, group, dim, chunk_blocks, num_threads)
    tickets = np.zeros(1, np.int64)
    num_workers = min(num_threads, num_items)
    scratch = _worker_scratch(num_workers, block_size, group, num_kv_heads)
    queries = _worker_queries(num_workers, num_q_heads, dim)
    scale32 = np.float32(scale)
    for w in prange(num_workers):
        scores, stats = scratch[w, :group], scratch[w, group:]  # whole rows keep them C-contiguous
        item = _count(tickets, 0)
        while item < num_items:
            _attend_item(item, q, scale32, queries[w], k_cache, v_cache, block_tables, context_lens, split_seq,
                         offsets, chunk_blocks, item_heads, part_acc, part_max, part_sum, scores, stats)
            item = _count(tickets, 0)
    for row in prange(batch * num_q_heads):
        _merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out, lse)
    return 0


# ---- a whole host-lane step: every layer as the device hands it over ----------------------------------------
# Gates: int32 [2, num_layers] in pinned memory that the device reads and writes by DMA. gates[0, l] = 1 once the
# device has put layer l's q/k/v into host memory; the loop sets gates[1, l] = 1 once layer l's output is there.
@intrinsic
def _load_acquire(typingctx, arr, index):
    """arr[index] read atomically with acquire order: a flag another agent (the GPU's DMA) writes."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int32, types.int64)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        pointer = builder.gep(array.data, [index_value])
        return builder.load_atomic(pointer, "acquire", arr.dtype.bitwidth // 8)

    return arr.dtype(arr, index), codegen


@intrinsic
def _store_release(typingctx, arr, index, value):
    """arr[index] = value, atomically with release order: every write before it is visible first."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int32, types.int64)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        stored = context.cast(builder, args[2], signature.args[2], arr.dtype)
        builder.store_atomic(stored, builder.gep(array.data, [index_value]), "release", arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter (rdtsc on x86; constant-rate on every x86 host this runs on): times the loop's
    waits and kernels from inside the native call, where no Python clock can be read."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def _spin_pause(typingctx):
    """x86 `pause` in a spin loop (nothing elsewhere): the spinning core yields its pipeline to its sibling
    hyperthread and leaves the loop without a memory-order flush once the flag changes."""

    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True)
def cycles():
    """The cycle counter from Python (layer_loop.py calibrates it against perf_counter)."""
    return _cycles()


@njit(inline="always")
def _wait_for(flags_or_counts, index, target, abandon):
    """Spins until flags_or_counts[index] >= target; False if the lane abandoned the step (abandon[1] != 0)."""
    while _load_acquire(flags_or_counts, index) < target:
        if _load_acquire(abandon, 1) != 0:
            return False
        _spin_pause()
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
    (the device rounds it); lse float32 [L, rows, Hq], each layer's log-sum-exp (merged with a split row's device part). flags int64 [2]: the loop sets flags[0] once it
    runs (without the GIL); flags[1] != 0 from the lane abandons a step whose device never hands a layer over.
    times int64 [L + 1, 2]: cycle counts, row 0 the entry (twice), row l + 1 when layer l's gate 0 was seen open
    and when its gate 1 was opened: the device's turnaround between layers against the host's work on each.
    It never returns before its last gate is open (layer_loop.py says why). Maps the kernel refuses open every
    gate and return the error before any work, so the device's step still ends (its output is thrown away).

    One parallel region spans the whole step: num_threads workers wait on each layer's gate 0 together and take
    its items from shared counters, and a phase starts once the tally of the one before is complete. A region
    per layer (decode_kernel's two) cost ~1 ms a layer on the GPU hosts, whatever the context: once torch has
    started an OpenMP team of its own in the process, libgomp counts more threads than cores and lets idle
    workers spin only ~100 times before they sleep, so every region woke 13 sleeping threads (an empty region:
    2 us -> 67 us on 2 cores). Waiting on tallies, not on each other, keeps it correct with fewer threads than
    num_threads: a worker that comes late finds its layers done.
    """
    _store_release(flags, 0, 1)
    times[0, 0] = times[0, 1] = _cycles()
    num_layers, num_q_heads, dim = q.shape[0], q.shape[2], q.shape[3]
    num_blocks, num_kv_heads, block_size = pools.shape[2], pools.shape[3], pools.shape[4]
    group = num_q_heads // num_kv_heads
    error = _check_tables(block_tables, context_lens, num_blocks, block_size)
    if error or batch == 0:
        for layer in range(num_layers):
            if not error and not _wait_for(gates[0], layer, 1, flags):
                return ABANDONED
            _store_release(gates[1], layer, 1)
        return error
    chunk_blocks, item_heads, num_items, offsets, split_seq, part_acc, part_max, part_sum = _work_plan(
        context_lens, block_size, num_kv_heads, group, dim, 0, num_threads)
    num_rows = batch * num_q_heads
    counts = np.zeros((num_layers, 6 * _LINE), np.int64)
    scratch = _worker_scratch(num_threads, block_size, group, num_kv_heads)
    queries = _worker_queries(num_threads, num_q_heads, dim)
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
            b = _count(c, _ROWS_IN + _TICKETS)
            while b < batch:
                if b == 0:
                    times[layer + 1, 0] = _cycles()
                _take_in_row(k_new[layer, b], v_new[layer, b], k_cache, v_cache, slots[b])
                _count(c, _ROWS_IN + _DONE)
                b = _count(c, _ROWS_IN + _TICKETS)
            if not _wait_for(c, _ROWS_IN + _DONE, batch, flags):
                break
            item = _count(c, _ATTEND + _TICKETS)
            while item < num_items:
                _attend_item(item, q[layer], scale32, queries[w], k_cache, v_cache, block_tables,
                             context_lens, split_seq, offsets, chunk_blocks, item_heads, part_acc, part_max,
                             part_sum, scores, stats)
                _count(c, _ATTEND + _DONE)
                item = _count(c, _ATTEND + _TICKETS)
            if not _wait_for(c, _ATTEND + _DONE, num_items, flags):
                break
            row = _count(c, _MERGE + _TICKETS)
            while row < num_rows:
                _merge_row(row, part_acc, part_max, part_sum, offsets, num_kv_heads, out[layer], lse[layer])
                if _count(c, _MERGE + _DONE) + 1 == num_rows:  # the layer's last merge hands it back
                    times[layer + 1, 1] = _cycles()
                    _store_release(gates[1], layer, 1)
                row = _count(c, _MERGE + _TICKETS)
    return 0 if _load_acquire(gates[1], num_layers - 1) != 0 else ABANDONED
