"""Probe (issue 11): the host decode kernel's two products on AMX tiles (tdpbf16ps), against decode_kernel.

decode_kernel's arithmetic runs at ~8-10 GB/s a core in L2 at Hq 32 and does not overlap its memory stalls, so
1 x 128k reads 0.6-0.77 of the host ceiling (benchmarks/NOTES.md, 2026-11-23). One tdpbf16ps multiplies a
16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums. This probe runs the same online softmax with
both products on tiles, over the same head-major paged cache, and times it beside decode_kernel in one process:

  q.K   A = 16 keys x 32 dims, loaded as they lie in the cache; B = the group's queries, transposed into pairs of
        dims once per item ("VNNI" order); C = 16 keys x group scores.
  P x V A = the group's probabilities, rounded to bfloat16 (as the vdpbf16ps path and flash-attention round P);
        B = 32 V rows x 16 dims, two rows interleaved value by value (staged per block); C = the accumulator.

Scope: bfloat16, block size 64, head dim 128, contexts a multiple of 64, group 1-16. A probe, not the product:
if it pays, the tiles move into cpu_attention/decode_kernel.py. AMX_PROBE_EMULATE=1 replaces the three tile
instructions with plain loops over the same staged buffers, so the layouts are checked on any CPU (this is how
CPU CI, a Zen 3 without AMX, checked them). Linux grants AMX per process on request (arch_prctl).

    python3 benchmarks/probe_amx_attention.py [--threads 14] [--out FILE]
"""
import argparse
import ctypes
import json
import math
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
from benchmarks.profile_host_kernel_rate import paged_inputs, time_kernel  # noqa: E402
from cpu_attention.decode_kernel import (_count, _exp_nonpositive, _merge_splits,  # noqa: E402
                                        _prefer_wide_vectors, _prefetch, decode_kernel, plan_work)
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


def _scores_tile(group):
    """tile(k, q_pairs, s): s[t, g] = k[t] . q[g] for one block-head: k [64, 128] bf16 (row stride 256 bytes),
    q_pairs [4, 16, 2 * group] bf16 (dims 32c + 2r, 32c + 2r + 1 of query g at [c, r, 2g], [c, r, 2g + 1]),
    s [64, group] float32. Four 16-key tiles, each four 32-dim steps."""

    @intrinsic
    def tile(typingctx, k, q_pairs, s):
        def codegen(context, builder, signature, args):
            (load, zero, dot, store), (k_addr, q_addr, s_addr), at = _tile_codegen_setup(context, builder,
                                                                                        signature, args)
            width = _I16(4 * group)  # bytes of a score row, and of a q_pairs row
            for t in range(4):
                sums = builder.call(zero, [_I16(16), width])
                for c in range(4):
                    key_rows = at(k_addr, t * 16 * 2 * DIM + 64 * c)
                    keys = builder.call(load, [_I16(16), _I16(64), key_rows, _I64(2 * DIM)])
                    queries = builder.call(load, [_I16(16), width, at(q_addr, c * 16 * 4 * group), _I64(4 * group)])
                    sums = builder.call(dot, [_I16(16), width, _I16(64), sums, keys, queries])
                builder.call(store, [_I16(16), width, at(s_addr, t * 16 * 4 * group), _I64(4 * group), sums])
            return context.get_dummy_value()

        if not all(isinstance(a, types.Integer) for a in (k, q_pairs, s)):
            return None
        return types.void(k, q_pairs, s), codegen

    return tile


def _values_tile(group):
    """tile(acc, p, v_pairs): acc[g] += sum_t p[g, t] * v[t] for one block-head: acc [group, 128] float32,
    p [group, 64] bf16, v_pairs [2, 8, 16, 32] bf16 (rows 32h + 2r and 32h + 2r + 1, dims 16e..16e+15, value by
    value at [h, e, r]). Eight 16-dim accumulator tiles, each two 32-row steps."""

    @intrinsic
    def tile(typingctx, acc, p, v_pairs):
        def codegen(context, builder, signature, args):
            (load, _, dot, store), (a_addr, p_addr, v_addr), at = _tile_codegen_setup(context, builder, signature,
                                                                                     args)
            rows = _I16(group)
            for e in range(8):
                sums = builder.call(load, [rows, _I16(64), at(a_addr, 64 * e), _I64(4 * DIM)])
                for h in range(2):
                    weights = builder.call(load, [rows, _I16(64), at(p_addr, 64 * h), _I64(2 * BLOCK)])
                    values = builder.call(load, [_I16(16), _I16(64), at(v_addr, (h * 8 + e) * 1024), _I64(64)])
                    sums = builder.call(dot, [rows, _I16(64), _I16(64), sums, weights, values])
                builder.call(store, [rows, _I16(64), at(a_addr, 64 * e), _I64(4 * DIM), sums])
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


@njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _stage_values(vb, v_pairs32):
    """v_pairs (as uint32 [2, 8, 16, 16]): rows 32h + 2r (low half) and 32h + 2r + 1 (high half), dim 16e + j."""
    _prefer_wide_vectors()
    for h in range(2):
        for r in range(16):
            t = 32 * h + 2 * r
            for e in range(8):
                for j in range(16):
                    d = 16 * e + j
                    v_pairs32[h, e, r, j] = np.uint32(vb[t, d]) | (np.uint32(vb[t + 1, d]) << np.uint32(16))


def _build(group):
    """The probe's kernel for one group size. Each tile's shape is fixed in the instruction stream, and LLVM gives
    every tile register one shape for a whole function, so one function over all group sizes ran out of tile
    registers: each group gets functions of its own."""
    scores_tile, values_tile = _scores_tile(group), _values_tile(group)

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
                for h in range(2):
                    for e in range(8):
                        for r in range(16):
                            for j in range(16):
                                acc[g, 16 * e + j] += _bf16(p[g, 32 * h + 2 * r]) * _bf16(v_pairs[h, e, r, 2 * j]) \
                                    + _bf16(p[g, 32 * h + 2 * r + 1]) * _bf16(v_pairs[h, e, r, 2 * j + 1])
        else:
            values_tile(acc.ctypes.data, p.ctypes.data, v_pairs.ctypes.data)

    @njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
    def attend(q_pairs, scale, k_cache, v_cache, table, first, last, acc, run_max, run_sum, s, p, v_pairs32):
        """Online softmax of blocks first..last-1 of one sequence, all kv heads, block by block and head by head
        (the cache's order). acc [Hkv, group, D], run_max/run_sum [Hkv, group]."""
        num_kv_heads = k_cache.shape[1]
        v_pairs = v_pairs32.view(np.uint16).reshape((2, 8, 16, 32))
        run_max[:] = -np.inf
        run_sum[:] = 0.0
        acc[:] = 0.0
        line = 32  # bf16 values a cache line
        for j in range(first, last):
            block = table[j]
            for h in range(num_kv_heads):
                ahead = (table[j + 1] if h == num_kv_heads - 1 and j + 1 < last else block) * num_kv_heads \
                    + (h + 1) % num_kv_heads
                for c in range(0, BLOCK * DIM, line):
                    _prefetch(k_cache, ahead * BLOCK * DIM + c)
                    _prefetch(v_cache, ahead * BLOCK * DIM + c)
                block_scores(k_cache[block, h], q_pairs[h], s)
                for g in range(group):
                    top = run_max[h, g]
                    for t in range(BLOCK):
                        top = max(top, s[t, g] * scale)
                    alpha = np.float32(math.exp(run_max[h, g] - top))
                    total = np.float32(0.0)
                    for t in range(BLOCK):
                        x = _exp_nonpositive(s[t, g] * scale - top)
                        total += x
                        p[g, t] = _round_bf16(x)
                    if alpha != 1.0:
                        for d in range(DIM):
                            acc[h, g, d] *= alpha
                    run_sum[h, g] = run_sum[h, g] * alpha + total
                    run_max[h, g] = top
                _stage_values(v_cache[block, h], v_pairs32)
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
        v_pairs32 = np.empty((num_threads, 2, 8, 16, 16), np.uint32)
        tickets = np.zeros(1, np.int64)
        for w in prange(num_threads):
            item = _count(tickets, 0)
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
                       part_acc[item], part_max[item], part_sum[item], s[w], p[w], v_pairs32[w])
                item = _count(tickets, 0)
        # Partial item * Hkv + h, as decode_kernel lays its partials out: its own merge serves.
        parts = num_items * num_kv_heads
        flat_acc = part_acc.reshape((parts, group, DIM))
        flat_max, flat_sum = part_max.reshape((parts, group)), part_sum.reshape((parts, group))
        for row in prange(batch * num_q_heads):
            b, hq = row // num_q_heads, row % num_q_heads
            h, g = hq // group, hq % group
            lse[b, hq] = _merge_splits(flat_acc, flat_max, flat_sum, splits[b] * num_kv_heads + h,
                                       splits[b + 1] * num_kv_heads, num_kv_heads, g, out[b, hq])
        return 0

    return amx_decode


_KERNELS = {}


def amx_decode(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out, lse):
    """decode_kernel's contract, within this probe's scope (the group's kernel, compiled on first use)."""
    group = q.shape[1] // k_cache.shape[1]
    if group not in _KERNELS:
        _KERNELS[group] = _build(group)
    return _KERNELS[group](q, k_cache, v_cache, block_tables, context_lens, scale, chunk_blocks, num_threads, out,
                           lse)


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
        q, k_cache, v_cache, tables, _ = paged_inputs(16 * BLOCK, 1, q_heads // 8, 0, rng)
        table = np.tile(tables[0], (1, length // BLOCK // 16))
        lens = np.array([length], np.int32)
        for name, kernel in (("amx", amx_decode), ("kernel", decode_kernel)):
            ms = time_kernel(kernel, q, k_cache, v_cache, [table], lens, 1, 5) * 1e3
            result[f"hq{q_heads}_in_cache_{name}_gbps"] = 2 * length * DIM * 2 / ms / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--rotate-gb", type=float, default=1.0)
    parser.add_argument("--batches", default="32x2048", help="more BxL cases, all threads")
    parser.add_argument("--check-only", action="store_true", help="only the float64 check (what CPU CI can run)")
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
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
