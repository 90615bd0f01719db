"""Probe (issue 11): the host decode kernel's two products on AMX tiles (tdpbf16ps), against decode_kernel.

decode_kernel's arithmetic runs at ~8-10 GB/s a core in L2 at Hq 32 and does not overlap its memory stalls, so
1 x 128k reads 0.6-0.77 of the host ceiling (benchmarks/NOTES.md, 2026-11-23). One tdpbf16ps multiplies a
16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums. This probe runs the same online softmax with
both products on tiles, over the same head-major paged cache, and times it beside decode_kernel in one process:

  q.K   A = 16 keys x 32 dims, loaded as they lie in the cache; B = the group's queries, transposed into pairs of
        dims once per item ("VNNI" order); C = 16 keys x group scores.
  P x V A = the group's probabilities, rounded to bfloat16 (as the vdpbf16ps path and flash-attention round P);
        B = 32 V rows x 16 dims, two rows interleaved value by value (staged per block as [32 row pairs, 128
        dims] uint32; a tile loads its 16 x 16 window with a 512-byte stride); C = the accumulator.

Scope: bfloat16, block size 64, head dim 128, contexts a multiple of 64, group 1-16. A probe, not the product:
if it pays, the tiles move into cpu_attention/decode_kernel.py. AMX_PROBE_EMULATE=1 replaces the three tile
instructions with plain loops over the same staged buffers, so the layouts are checked on any CPU (this is how
CPU CI, a Zen 3 without AMX, checked them). Linux grants AMX per process on request (arch_prctl).

Result (H100 host, 2026-11-23): correct on real AMX, and not faster than decode_kernel; --profile times a
block-head with each piece left out, which puts the time in the hand-offs between tiles and vector code
(benchmarks/NOTES.md, "the AMX probe run").

    python3 benchmarks/probe_amx_attention.py [--threads 14] [--profile] [--out FILE]
"""
import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_attention import read_ceiling_gbps  # noqa: E402
from benchmarks.profile_host_kernel_rate import paged_inputs, time_kernel, write_result  # noqa: E402
from cpu_attention.decode_kernel import decode_kernel, merge_splits, plan_work  # noqa: E402
from cpu_attention.llvm_ops import atomic_increment, prefer_wide_vectors, prefetch  # noqa: E402
from cpu_attention.numerics import exp_nonpositive  # noqa: E402
from tests.reference import attention_reference  # noqa: E402

EMULATE = os.environ.get("AMX_PROBE_EMULATE") == "1"
BLOCK, DIM = 64, 128
GB = 1e9


# ---- the three tile instructions, as LLVM's AMX intrinsics (LLVM configures the tiles itself: ldtilecfg) -----
class _Tile(ir.Type):
    """LLVM's x86_amx type, which llvmlite does not name."""

    def _to_string(self):
        return "x86_amx"

    def __eq__(self, other):
        return isinstance(other, _Tile)

    def __hash__(self):
        return hash("x86_amx")


_TILE, _I16, _I64, _BYTES = _Tile(), ir.IntType(16), ir.IntType(64), ir.IntType(8).as_pointer()


def _tile_codegen_setup(context, builder, signature, args):
    """What both tiles' codegen starts from: the four AMX intrinsics (load, zero, dot, store), the three address
    arguments as intp, and at(base, offset), a byte pointer."""
    module = builder.module
    load = cgutils.get_or_insert_function(module, ir.FunctionType(_TILE, [_I16, _I16, _BYTES, _I64]),
                                          "llvm.x86.tileloadd64.internal")
    zero = cgutils.get_or_insert_function(module, ir.FunctionType(_TILE, [_I16, _I16]), "llvm.x86.tilezero.internal")
    dot = cgutils.get_or_insert_function(module, ir.FunctionType(_TILE, [_I16, _I16, _I16, _TILE, _TILE, _TILE]),
                                         "llvm.x86.tdpbf16ps.internal")
    store = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [_I16, _I16, _BYTES, _I64, _TILE]),
                                           "llvm.x86.tilestored64.internal")
    addresses = [context.cast(builder, a, t, types.intp) for a, t in zip(args, signature.args)]
    at = lambda base, offset: builder.inttoptr(builder.add(base, _I64(offset)), _BYTES)
    return (load, zero, dot, store), addresses, at


def _scores_tile(group, chains):
    """tile(k, q_pairs, s): s[t, g] = k[t] . q[g] for one block-head: k [64, 128] bf16 (row stride 256 bytes),
    q_pairs [4, 16, 2 * group] bf16 (dims 32c + 2r, 32c + 2r + 1 of query g at [c, r, 2g], [c, r, 2g + 1]),
    s [64, group] float32. Four 16-key tiles, each four 32-dim steps; `chains` of them at a time, so that many
    independent dot chains overlap (tdpbf16ps has a long latency) and share each queries tile."""

    @intrinsic
    def tile(typingctx, k, q_pairs, s):
        def codegen(context, builder, signature, args):
            (load, zero, dot, store), (k_addr, q_addr, s_addr), at = _tile_codegen_setup(context, builder,
                                                                                        signature, args)
            width = _I16(4 * group)  # bytes of a score row, and of a q_pairs row
            for first in range(0, 4, chains):
                tiles = range(first, first + chains)
                sums = {t: builder.call(zero, [_I16(16), width]) for t in tiles}
                for c in range(4):
                    queries = builder.call(load, [_I16(16), width, at(q_addr, c * 16 * 4 * group), _I64(4 * group)])
                    for t in tiles:
                        key_rows = at(k_addr, t * 16 * 2 * DIM + 64 * c)
                        keys = builder.call(load, [_I16(16), _I16(64), key_rows, _I64(2 * DIM)])
                        sums[t] = builder.call(dot, [_I16(16), width, _I16(64), sums[t], keys, queries])
                for t in tiles:
                    builder.call(store, [_I16(16), width, at(s_addr, t * 16 * 4 * group), _I64(4 * group), sums[t]])
            return context.get_dummy_value()

        if not all(isinstance(a, types.Integer) for a in (k, q_pairs, s)):
            return None
        return types.void(k, q_pairs, s), codegen

    return tile


def _values_tile(group, chains):
    """tile(acc, p, v_pairs): acc[g] += sum_t p[g, t] * v[t] for one block-head: acc [group, 128] float32,
    p [group, 64] bf16, v_pairs [32, 128] uint32 (row pair i: v[2i, d] low, v[2i + 1, d] high). Eight 16-dim
    accumulator tiles, each two 32-row steps; `chains` accumulators at a time share each weights tile."""

    @intrinsic
    def tile(typingctx, acc, p, v_pairs):
        def codegen(context, builder, signature, args):
            (load, _, dot, store), (a_addr, p_addr, v_addr), at = _tile_codegen_setup(context, builder, signature,
                                                                                     args)
            rows = _I16(group)
            for first in range(0, 8, chains):
                tiles = range(first, first + chains)
                sums = {e: builder.call(load, [rows, _I16(64), at(a_addr, 64 * e), _I64(4 * DIM)]) for e in tiles}
                for h in range(2):
                    weights = builder.call(load, [rows, _I16(64), at(p_addr, 64 * h), _I64(2 * BLOCK)])
                    for e in tiles:
                        values = builder.call(load, [_I16(16), _I16(64), at(v_addr, h * 16 * 4 * DIM + 64 * e),
                                                     _I64(4 * DIM)])
                        sums[e] = builder.call(dot, [rows, _I16(64), _I16(64), sums[e], weights, values])
                for e in tiles:
                    builder.call(store, [rows, _I16(64), at(a_addr, 64 * e), _I64(4 * DIM), sums[e]])
            return context.get_dummy_value()

        if not all(isinstance(a, types.Integer) for a in (acc, p, v_pairs)):
            return None
        return types.void(acc, p, v_pairs), codegen

    return tile


@njit(inline="always")
def _bf16(bits):
    return np.float32(np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32))


@njit(inline="always")
def _round_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even (x finite)."""
    bits = np.float32(x).view(np.uint32)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, inline="always")
def _stage_values(vb, v_pairs32):
    """v_pairs32 [32, 128]: row pair i holds v[2i, d] in the low half and v[2i + 1, d] in the high half.

    Whole rows, one pair at a time: LLVM vectorizes this at ~0.3 us a block-head on a Zen 3. The tile-ordered
    layout ([2, 8, 16, 16], one tile's window contiguous) took ~1.9 us, more than both products together."""
    prefer_wide_vectors()
    for i in range(BLOCK // 2):
        low, high, pairs = vb[2 * i], vb[2 * i + 1], v_pairs32[i]
        for d in range(DIM):
            pairs[d] = np.uint32(low[d]) | (np.uint32(high[d]) << np.uint32(16))


PIECES = ("prefetch", "scores", "softmax", "stage", "values")


def _build(group, chains, leave_out=()):
    """The probe's kernel for one group size. Each tile's shape is fixed in the instruction stream, and LLVM gives
    every tile register one shape for a whole function, so one function over all group sizes ran out of tile
    registers: each group gets functions of its own.

    Everything in the block loop is inlined and free of reference counts (_nrt=False): LLVM reloads the tile
    configuration (ldtilecfg) after every call, and the first run on a Sapphire Rapids host made three calls a
    block-head (NRT_decref, libm's expf, the softmax). Two dot chains at a time in each tile: four in both needed
    11 tile registers of the 8, since a register keeps one shape for the whole function."""
    scores_tile, values_tile = _scores_tile(group, chains), _values_tile(group, chains)
    # What --profile leaves out, one piece at a time (closure constants: numba drops the dead branches).
    do_prefetch, do_scores, do_softmax, do_stage, do_values = (piece not in leave_out for piece in PIECES)

    @njit(nogil=True)
    def block_scores(kb, q_pairs, s):
        if EMULATE:
            s[:] = 0.0
            for t in range(BLOCK):
                for c in range(4):
                    for r in range(16):
                        for g in range(group):
                            s[t, g] += _bf16(kb[t, 32 * c + 2 * r]) * _bf16(q_pairs[c, r, 2 * g]) \
                                + _bf16(kb[t, 32 * c + 2 * r + 1]) * _bf16(q_pairs[c, r, 2 * g + 1])
        else:
            scores_tile(kb.ctypes.data, q_pairs.ctypes.data, s.ctypes.data)

    @njit(nogil=True)
    def block_values(acc, p, v_pairs):
        if EMULATE:
            for g in range(group):
                for i in range(BLOCK // 2):
                    for d in range(DIM):
                        acc[g, d] += _bf16(p[g, 2 * i]) * _bf16(v_pairs[i, 2 * d]) \
                            + _bf16(p[g, 2 * i + 1]) * _bf16(v_pairs[i, 2 * d + 1])
        else:
            values_tile(acc.ctypes.data, p.ctypes.data, v_pairs.ctypes.data)

    @njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, inline="always")
    def _softmax_block(s, scale, st, p, acc, run_max, run_sum):
        """One block-head's online-softmax step. The tile's scores [key, query] are turned to [query, key] (st)
        first, so every loop below runs along keys at full vector width; strided along s they were scalar,
        ~1.2 us a block-head at group 4 on a Zen 3 against ~0.4 us this way."""
        prefer_wide_vectors()
        for t in range(BLOCK):
            for g in range(group):
                st[g, t] = s[t, g] * scale
        for g in range(group):
            scores, probs = st[g], p[g]
            top = run_max[g]
            for t in range(BLOCK):
                top = max(top, scores[t])
            alpha = exp_nonpositive(run_max[g] - top)  # no libm call: a call makes LLVM reload the tile config
            total = np.float32(0.0)
            for t in range(BLOCK):
                x = exp_nonpositive(scores[t] - top)
                total += x
                probs[t] = _round_bf16(x)
            if alpha != 1.0:
                row = acc[g]
                for d in range(DIM):
                    row[d] *= alpha
            run_sum[g] = run_sum[g] * alpha + total
            run_max[g] = top

    @njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, _nrt=False)
    def attend(q_pairs, scale, k_cache, v_cache, table, first, last, acc, run_max, run_sum, s, st, p, v_pairs32):
        """Online softmax of blocks first..last-1 of one sequence, all kv heads, block by block and head by head
        (the cache's order). acc [Hkv, group, D], run_max/run_sum [Hkv, group]."""
        num_kv_heads = k_cache.shape[1]
        v_pairs = v_pairs32.view(np.uint16).reshape((BLOCK // 2, 2 * DIM))
        run_max[:] = -np.inf
        run_sum[:] = 0.0
        acc[:] = 0.0
        line = 32  # bf16 values a cache line
        for j in range(first, last):
            block = table[j]
            for h in range(num_kv_heads):
                ahead = (table[j + 1] if h == num_kv_heads - 1 and j + 1 < last else block) * num_kv_heads \
                    + (h + 1) % num_kv_heads
                if do_prefetch:
                    for c in range(0, BLOCK * DIM, line):
                        prefetch(k_cache, ahead * BLOCK * DIM + c)
                        prefetch(v_cache, ahead * BLOCK * DIM + c)
                if do_scores:
                    block_scores(k_cache[block, h], q_pairs[h], s)
                if do_softmax:
                    _softmax_block(s, scale, st, p, acc[h], run_max[h], run_sum[h])
                if do_stage:
                    _stage_values(v_cache[block, h], v_pairs32)
                if do_values:
                    block_values(acc[h], p, v_pairs)

    @njit(parallel=True, nogil=True)
    def amx_decode(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse):
        """decode_kernel's contract, within this probe's scope; items are (sequence, split), all kv heads each."""
        batch, num_q_heads, _ = q.shape
        num_kv_heads = k_cache.shape[1]
        if chunk_blocks <= 0:
            chunk_blocks = plan_work(context_lens, BLOCK, num_kv_heads, num_threads)[0]
        splits = np.empty(batch + 1, np.int64)
        splits[0] = 0
        for b in range(batch):
            splits[b + 1] = splits[b] + (context_lens[b] // BLOCK + chunk_blocks - 1) // chunk_blocks
        num_items = splits[batch]
        part_acc = np.empty((num_items, num_kv_heads, group, DIM), np.float32)
        part_max = np.empty((num_items, num_kv_heads, group), np.float32)
        part_sum = np.empty((num_items, num_kv_heads, group), np.float32)
        # Per worker: the queries in pairs of dims, scores, probabilities, staged V (one 4 KiB-aligned slab each).
        q_pairs = np.empty((num_threads, num_kv_heads, 4, 16, 2 * group), np.uint16)
        s = np.empty((num_threads, BLOCK, group), np.float32)
        p = np.empty((num_threads, group, BLOCK), np.uint16)
        st = np.empty((num_threads, group, BLOCK), np.float32)
        v_pairs32 = np.empty((num_threads, BLOCK // 2, DIM), np.uint32)
        tickets = np.zeros(1, np.int64)
        for w in prange(num_threads):
            item = atomic_increment(tickets, 0)
            while item < num_items:
                b = 0
                while splits[b + 1] <= item:
                    b += 1
                for h in range(num_kv_heads):
                    for c in range(4):
                        for r in range(16):
                            for g in range(group):
                                q_pairs[w, h, c, r, 2 * g] = q[b, h * group + g, 32 * c + 2 * r]
                                q_pairs[w, h, c, r, 2 * g + 1] = q[b, h * group + g, 32 * c + 2 * r + 1]
                first = (item - splits[b]) * chunk_blocks
                last = min(first + chunk_blocks, context_lens[b] // BLOCK)
                attend(q_pairs[w], np.float32(scale), k_cache, v_cache, block_tables[b], first, last,
                       part_acc[item], part_max[item], part_sum[item], s[w], st[w], p[w], v_pairs32[w])
                item = atomic_increment(tickets, 0)
        # Partial item * Hkv + h, as decode_kernel lays its partials out: its own merge serves.
        parts = num_items * num_kv_heads
        flat_acc = part_acc.reshape((parts, group, DIM))
        flat_max, flat_sum = part_max.reshape((parts, group)), part_sum.reshape((parts, group))
        for row in prange(batch * num_q_heads):
            b, hq = row // num_q_heads, row % num_q_heads
            h, g = hq // group, hq % group
            lse[b, hq] = merge_splits(flat_acc, flat_max, flat_sum, splits[b] * num_kv_heads + h,
                                      splits[b + 1] * num_kv_heads, num_kv_heads, g, out[b, hq])
        return 0

    return amx_decode


_KERNELS = {}


def amx_decode(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse,
               chains=2, leave_out=()):
    """decode_kernel's contract, within this probe's scope (the group's kernel, compiled on first use)."""
    key = (q.shape[1] // k_cache.shape[1], chains, tuple(leave_out))
    if key not in _KERNELS:
        _KERNELS[key] = _build(*key)
    return _KERNELS[key](q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out,
                         lse)


def amx_decode_one_chain(*args):
    """The tiles one dot chain at a time (as the first device run had them), for the in-cache comparison."""
    return amx_decode(*args, chains=1)


# ---- the run ---------------------------------------------------------------------------------------------------
def request_amx() -> bool:
    """Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); False if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0


def reference(q, k_cache, v_cache, tables, lens, scale):
    """tests.reference's float64 attention over each sequence's gathered context: out [B, Hq, D], lse [B, Hq]."""
    import torch

    widen = lambda bits: torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32))
    outs, lses = [], []
    for b in range(q.shape[0]):
        blocks = tables[b, :lens[b] // BLOCK]
        gather = lambda cache: widen(cache[blocks]).transpose(1, 2).reshape(-1, cache.shape[1], DIM)  # [L, Hkv, D]
        out, lse = attention_reference(widen(q[b:b + 1]), gather(k_cache), gather(v_cache), scale)
        outs.append(out[0].numpy())
        lses.append(lse[0].numpy())
    return np.stack(outs), np.stack(lses)


def check(threads: int) -> dict:
    """Both kernels against float64 on a small case per group: relative error of out, max error of lse."""
    import numba

    numba.set_num_threads(threads)
    rng = np.random.default_rng(3)
    result = {}
    for q_heads in (8, 16, 32):
        q, k_cache, v_cache, tables, lens = paged_inputs(64 * 37, 8, q_heads, 0, rng, batch=3)
        lens = np.array([64 * 37, 64, 64 * 5], np.int32)
        ref, ref_lse = reference(q, k_cache, v_cache, tables[0], lens, 0.088)
        for name, kernel in (("amx", amx_decode), ("kernel", decode_kernel)):
            out = np.empty(q.shape, np.float32)
            lse = np.empty(q.shape[:2], np.float32)
            kernel(q, k_cache, v_cache, tables[0], lens, 0.088, 0, threads, out, lse)
            result[f"hq{q_heads}_{name}_rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            result[f"hq{q_heads}_{name}_lse_err"] = float(np.abs(lse - ref_lse).max())
    return result


def in_cache_case(q_heads: int, length: int, rng):
    """One kv head of q_heads // 8 query heads over 16 blocks, read again and again to `length` tokens: they stay
    in L2, so one thread's time is the arithmetic's. (q, k_cache, v_cache, table, lens)"""
    q, k_cache, v_cache, tables, _ = paged_inputs(16 * BLOCK, 1, q_heads // 8, 0, rng)
    return q, k_cache, v_cache, np.tile(tables[0], (1, length // BLOCK // 16)), np.array([length], np.int32)


def timings(threads: int, length: int, rotate_gb: float, batches) -> dict:
    """ms and GB/s of both kernels on 1 x length (all threads, one thread, one thread in L2) and on batches."""
    import numba

    rng = np.random.default_rng(0)
    result = {}
    for q_heads in (16, 32):
        cases = [(1, length)] + list(batches)
        for batch, context in cases:
            numba.set_num_threads(threads)
            case = paged_inputs(context, 8, q_heads, int(rotate_gb * GB), rng, batch)
            nbytes = 2 * batch * context * 8 * DIM * 2
            for name, kernel in (("amx", amx_decode), ("kernel", decode_kernel)):
                key = f"hq{q_heads}_{batch}x{context}_{name}"
                ms = time_kernel(kernel, *case, threads, 7) * 1e3
                result[key] = {"ms": ms, "gbps": nbytes / ms / 1e6}
                if batch == 1:
                    numba.set_num_threads(1)
                    ms1 = time_kernel(kernel, *case, 1, 3) * 1e3
                    result[key]["one_thread_gbps"] = nbytes / ms1 / 1e6
                    numba.set_num_threads(threads)
            del case
        # One thread, one kv head, 16 blocks over and over: they stay in L2 (the arithmetic rate).
        numba.set_num_threads(1)
        q, k_cache, v_cache, table, lens = in_cache_case(q_heads, length, rng)
        for name, kernel in (("amx", amx_decode), ("amx_one_chain", amx_decode_one_chain), ("kernel", decode_kernel)):
            ms = time_kernel(kernel, q, k_cache, v_cache, [table], lens, 1, 5) * 1e3
            result[f"hq{q_heads}_in_cache_{name}_gbps"] = 2 * length * DIM * 2 / ms / 1e6
    return result


def profile(length: int) -> dict:
    """Where a block-head's time goes: one thread in L2 (as timings' in_cache rows), whole and with each piece
    left out. The results are wrong without a piece; only the time counts."""
    import numba

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    result = {}
    for q_heads in (16, 32):
        q, k_cache, v_cache, table, lens = in_cache_case(q_heads, length, rng)
        for piece in ("none",) + PIECES:
            leave_out = () if piece == "none" else (piece,)
            kernel = lambda *args: amx_decode(*args, leave_out=leave_out)
            seconds = time_kernel(kernel, q, k_cache, v_cache, [table], lens, 1, 5)
            result[f"hq{q_heads}_without_{piece}_ns_per_block_head"] = seconds / (length // BLOCK) * 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--rotate-gb", type=float, default=1.0)
    parser.add_argument("--batches", default="32x2048", help="more BxL cases, all threads")
    parser.add_argument("--check-only", action="store_true", help="only the float64 check (what CPU CI can run)")
    parser.add_argument("--profile", action="store_true", help="also time one thread in L2 without each piece")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not EMULATE and not request_amx():
        raise SystemExit("Linux refused the AMX tile state (arch_prctl): this CPU or kernel has no AMX; "
                         "AMX_PROBE_EMULATE=1 runs the layouts without it")
    start = time.perf_counter()
    result = {"emulated": EMULATE, "threads": args.threads, **check(min(args.threads, os.cpu_count() or 1))}
    print(f"check ({time.perf_counter() - start:.0f} s with compiling): " + ", ".join(
        f"{k} {v:.1e}" for k, v in result.items() if k.endswith("err")), flush=True)
    if not args.check_only:
        result["read_ceiling_gbps"] = ceiling = read_ceiling_gbps(2.0, repeats=3)
        batches = [tuple(int(x) for x in case.split("x")) for case in args.batches.split(",") if case]
        rates = timings(args.threads, args.length, args.rotate_gb, batches)
        result.update(rates)
        print(f"read ceiling {ceiling:.1f} GB/s on {args.threads} threads")
        for key, row in rates.items():
            if isinstance(row, dict):
                extra = f", one thread {row['one_thread_gbps']:.1f} GB/s" if "one_thread_gbps" in row else ""
                print(f"{key:>28}: {row['ms']:8.2f} ms {row['gbps']:6.1f} GB/s ({row['gbps'] / ceiling:.2f} of "
                      f"ceiling){extra}")
            else:
                print(f"{key:>28}: {row:6.1f} GB/s")
    if args.profile:
        rows = profile(args.length)
        result.update(rows)
        for key, ns in rows.items():
            print(f"{key:>44}: {ns:7.0f} ns")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
