"""Benchmark the host decode kernel (cpu_attention) in the hardware's terms, against ceilings measured in this run.

Decode is memory-bound: KV bytes read / time = achieved GB/s, next to
  (a) the host read ceiling: a numba parallel reduction over a large array (>= 4 GiB by default), all threads;
  (b) torch CPU scaled_dot_product_attention over the same KV laid out contiguously ([B, Hkv, L, D]), in the
      fastest of two GQA forms: enable_gqa=True with q [B, Hq, 1, D], or the group folded into the query length
      (q [B, Hkv, Hq/Hkv, D] against the same K/V: the same arithmetic with no KV expansion).
Shapes: 8 KV heads x D 128 (Qwen3-8B, Llama-3-8B), Hq 32, bf16, paged head-major caches with shuffled blocks.
Inputs rotate over a pool of at least --rotate-gb, so every timed run reads from DRAM, not from the L3.
With --paired N each case is also timed in N rounds, each against the ceiling read right before it (the median
ratio is what the shared hosts' drifting load moves least). A block-size sweep at one shape helps choose the
engine's cpu_block_size. Results: printed, and written to
benchmarks/results/cpu_attention_<tag>.json.

    python3 benchmarks/bench_cpu_attention.py [--quick] [--threads N] [--tag NAME]
"""
import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_attention import paged_decode_attention  # noqa: E402
from cpu_attention.decode import split_plan  # noqa: E402

GB = 1e9
CASES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (16, 32768), (32, 8192), (64, 1024),
         (64, 8192), (4, 131072)]
QUICK_CASES = [(1, 2048), (1, 8192), (4, 2048)]
SWEEP_BLOCK_SIZES = (16, 32, 64, 128, 256)


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _sum_all(a):
    total = np.float32(0.0)
    for i in prange(a.shape[0]):
        total += a[i]
    return total


class ReadCeiling:
    """The host read ceiling: best read bandwidth of a streaming parallel sum over every thread numba has, over
    one array held for re-reading (--paired reads it again before every round)."""

    def __init__(self, gigabytes: float, array: np.ndarray | None = None):
        """Over a new array of `gigabytes`, or over `array` as given (float32 ones), e.g. memory of another kind."""
        self.array = np.ones(int(gigabytes * GB) // 4, np.float32) if array is None else array
        _sum_all(self.array)

    def gbps(self, repeats: int) -> float:
        return max(self.array.nbytes / _timed(lambda: _sum_all(self.array)) for _ in range(repeats)) / GB


def read_ceiling_gbps(gigabytes: float, repeats: int = 5) -> float:
    """One reading of the ceiling (GB/s), the array freed after."""
    return ReadCeiling(gigabytes).gbps(repeats)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fns, repeats: int, warmup: int = 2) -> float:
    """Median over `repeats` runs, cycling through `fns` (the same work on different memory)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    return statistics.median(_timed(fns[i % len(fns)]) for i in range(repeats))


def kv_bytes(batch, length, args, itemsize=2) -> int:
    return 2 * batch * length * args.kv_heads * args.head_dim * itemsize


def paged_case(batch, length, block_size, args, empty=torch.empty):
    """A head-major paged pool holding at least --rotate-gb, and one shuffled block table per rotation. `empty`
    allocates the K and V caches (shape, dtype=...), as torch.empty does."""
    blocks_per_seq = math.ceil(length / block_size)
    case_blocks = batch * blocks_per_seq
    block_bytes = 2 * args.kv_heads * block_size * args.head_dim * 2
    rotations = max(1, math.ceil(args.rotate_gb * GB / (case_blocks * block_bytes)))
    shape = (case_blocks * rotations, args.kv_heads, block_size, args.head_dim)
    k_cache = empty(shape, dtype=torch.bfloat16).uniform_(-1, 1)
    v_cache = empty(shape, dtype=torch.bfloat16).uniform_(-1, 1)
    order = torch.randperm(shape[0], dtype=torch.int32)
    tables = [order[r * case_blocks:(r + 1) * case_blocks].view(batch, blocks_per_seq) for r in range(rotations)]
    lens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch, args.q_heads, args.head_dim).to(torch.bfloat16)
    scale = 1 / math.sqrt(args.head_dim)
    return [lambda t=t: paged_decode_attention(q, k_cache, v_cache, t, lens, scale) for t in tables]


def sdpa_case(batch, length, args):
    """Contiguous [B, Hkv, L, D] copies (enough to rotate out of cache) and both GQA forms of SDPA."""
    group = args.q_heads // args.kv_heads
    copies = max(1, math.ceil(args.rotate_gb * GB / kv_bytes(batch, length, args)))
    shape = (batch, args.kv_heads, length, args.head_dim)
    kvs = [(torch.empty(shape, dtype=torch.bfloat16).uniform_(-1, 1),
            torch.empty(shape, dtype=torch.bfloat16).uniform_(-1, 1)) for _ in range(copies)]
    q = torch.randn(batch, args.q_heads, 1, args.head_dim).to(torch.bfloat16)
    folded = q.view(batch, args.kv_heads, group, args.head_dim)
    forms = {
        "enable_gqa": [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in kvs],
        "group_as_query_rows": [lambda k=k, v=v: F.scaled_dot_product_attention(folded, k, v) for k, v in kvs],
    }
    return forms


def check_against_sdpa(args) -> float:
    """Relative error of our kernel (and of the folded SDPA form) against torch SDPA in float32, on one
    shuffled paged case with three context lengths."""
    batch, length, block_size = 3, 1000, 64
    blocks = math.ceil(length / block_size)
    k = torch.randn(batch, args.kv_heads, blocks * block_size, args.head_dim).to(torch.bfloat16)
    v = torch.randn_like(k, dtype=torch.float32).to(torch.bfloat16)
    q = torch.randn(batch, args.q_heads, args.head_dim).to(torch.bfloat16)
    order = torch.randperm(batch * blocks, dtype=torch.int32).view(batch, blocks)
    k_cache = torch.empty(batch * blocks, args.kv_heads, block_size, args.head_dim, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[order.flatten().long()] = k.view(batch, args.kv_heads, blocks, block_size, args.head_dim) \
        .transpose(1, 2).reshape(-1, args.kv_heads, block_size, args.head_dim)
    v_cache[order.flatten().long()] = v.view(batch, args.kv_heads, blocks, block_size, args.head_dim) \
        .transpose(1, 2).reshape(-1, args.kv_heads, block_size, args.head_dim)
    lens = torch.tensor([length, length - 37, 1], dtype=torch.int32)
    out, _ = paged_decode_attention(q, k_cache, v_cache, order, lens, 1 / math.sqrt(args.head_dim))
    errors = []
    for b in range(batch):
        n = int(lens[b])
        qb, kb, vb = q[b:b + 1, :, None].float(), k[b:b + 1, :, :n].float(), v[b:b + 1, :, :n].float()
        ref = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)[:, :, 0]
        folded = F.scaled_dot_product_attention(qb.view(1, args.kv_heads, -1, args.head_dim), kb, vb)
        errors.append(((out[b:b + 1].float() - ref).norm() / ref.norm()).item())
        errors.append(((folded.reshape(ref.shape) - ref).norm() / ref.norm()).item())  # the form we time is exact
    return max(errors)


def paired_ratios(fns, nbytes, ceiling: ReadCeiling, rounds: int) -> list:
    """Our GB/s over the ceiling read right before it, round by round. The shared GPU hosts' memory load drifts
    within one process (one reading 71, others that hour 90-129 GB/s), so two readings minutes apart give a
    ratio that moves with the drift, not with the kernel."""
    ratios = []
    for _ in range(rounds):
        read = ceiling.gbps(2)
        ratios.append(nbytes / median_seconds(fns, 3, warmup=1) / GB / read)
    return ratios


def run_case(batch, length, args, ceiling, with_sdpa=True, block_size=None, paired_ceiling=None):
    block_size = block_size or args.block_size
    nbytes = kv_bytes(batch, length, args)
    fns = paged_case(batch, length, block_size, args)
    ours = median_seconds(fns, args.repeats)
    row = {"batch": batch, "context": length, "block_size": block_size, "kv_bytes": nbytes,
           "splits_per_seq": int(split_plan([length] * batch, block_size, args.kv_heads)[0]),
           "ours_ms": ours * 1e3, "ours_gbps": nbytes / ours / GB}
    row["ours_over_ceiling"] = row["ours_gbps"] / ceiling
    if paired_ceiling is not None:
        row["paired_ratios"] = paired_ratios(fns, nbytes, paired_ceiling, args.paired)
        row["ours_over_ceiling_paired"] = statistics.median(row["paired_ratios"])
    del fns
    if with_sdpa:
        timings = {name: median_seconds(fns, args.repeats) for name, fns in sdpa_case(batch, length, args).items()}
        form = min(timings, key=timings.get)
        row.update(sdpa_form=form, sdpa_ms=timings[form] * 1e3, sdpa_gbps=nbytes / timings[form] / GB,
                   sdpa_all_ms={k: t * 1e3 for k, t in timings.items()}, ours_over_sdpa=timings[form] / ours)
    return row


def print_row(row):
    text = (f"B={row['batch']:>3} L={row['context']:>6} bs={row['block_size']:>3} KV {row['kv_bytes'] / GB:6.2f} GB"
            f" | ours {row['ours_ms']:8.2f} ms {row['ours_gbps']:6.1f} GB/s ({row['ours_over_ceiling']:.2f} of "
            f"ceiling, {row['splits_per_seq']} splits/seq)")
    if "paired_ratios" in row:
        ratios = row["paired_ratios"]
        text += (f" | paired: median {row['ours_over_ceiling_paired']:.2f} of the ceiling read just before"
                 f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)")
    if "sdpa_ms" in row:
        text += (f" | SDPA {row['sdpa_ms']:8.2f} ms {row['sdpa_gbps']:6.1f} GB/s [{row['sdpa_form']}]"
                 f" | ours/SDPA {row['ours_over_sdpa']:.2f}x")
    print(text, flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny grid for a smoke run (< 1 min on 2 cores)")
    p.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: all cores)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64, help="cpu block size of the main grid")
    p.add_argument("--sweep-shape", default=None, help="B,L of the block-size sweep (default 8,32768)")
    p.add_argument("--ceiling-gb", type=float, default=None, help="size of the ceiling read (default 4)")
    p.add_argument("--rotate-gb", type=float, default=None, help="rotate inputs over this much memory (default 1)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--cases", default=None, help="BxL,BxL,... instead of the default grid (e.g. 1x131072)")
    p.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="also time each case in ROUNDS rounds, each against the ceiling read right before it")
    p.add_argument("--tag", default=socket.gethostname())
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu_attention_<tag>.json)")
    args = p.parse_args()
    quick = args.quick
    if args.cases:
        args.cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    else:
        args.cases = QUICK_CASES if quick else CASES
    args.sweep_shape = tuple(int(x) for x in (args.sweep_shape or ("2,4096" if quick else "8,32768")).split(","))
    args.ceiling_gb = args.ceiling_gb or (0.5 if quick else 4.0)
    args.rotate_gb = args.rotate_gb or (0.25 if quick else 1.0)
    args.repeats = args.repeats or (3 if quick else 7)
    return args


def main():
    args = parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    paired_ceiling = ReadCeiling(args.ceiling_gb) if args.paired else None
    ceiling = paired_ceiling.gbps(5) if paired_ceiling else read_ceiling_gbps(args.ceiling_gb)
    error = check_against_sdpa(args)
    config = {"host": socket.gethostname(), "tag": args.tag, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "numba_threads": numba.get_num_threads(),
              "torch_threads": torch.get_num_threads(),
              "threading_layer": numba.threading_layer(), "numba": numba.__version__, "torch": torch.__version__,
              "kv_heads": args.kv_heads, "q_heads": args.q_heads, "head_dim": args.head_dim, "dtype": "bfloat16",
              "ceiling_gb": args.ceiling_gb, "rotate_gb": args.rotate_gb, "repeats": args.repeats,
              "paired_rounds": args.paired}
    print(f"{config['cores']} cores, numba {config['numba_threads']} threads ({config['threading_layer']}), torch "
          f"{config['torch_threads']} threads | read ceiling {ceiling:.1f} GB/s | check vs SDPA: rel err {error:.1e}")
    if error > 1e-2:
        raise SystemExit(f"the kernel disagrees with torch SDPA (relative error {error:.2e}); not timing it")
    cases = []
    for batch, length in args.cases:
        cases.append(run_case(batch, length, args, ceiling, with_sdpa=not args.no_sdpa,
                              paired_ceiling=paired_ceiling))
        print_row(cases[-1])
    if not args.no_sweep:
        print(f"block-size sweep at B={args.sweep_shape[0]} L={args.sweep_shape[1]}:")
    sweep = []
    for block_size in () if args.no_sweep else SWEEP_BLOCK_SIZES:
        sweep.append(run_case(*args.sweep_shape, args, ceiling, with_sdpa=False, block_size=block_size))
        print_row(sweep[-1])
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"cpu_attention_{args.tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "ceiling_gbps": ceiling, "check_rel_error": error, "cases": cases,
                               "block_size_sweep": sweep}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
