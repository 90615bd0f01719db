"""Does the host kernel read faster from memory on transparent huge pages? One process, paired rounds.

The engine's host pool (cpu_attention/kv_pool.py) asks for huge pages (MADV_HUGEPAGE); bench_cpu_attention's
pools and its read ceiling come from torch.empty / np.ones, which get huge pages only where the host's THP mode is
"always". Each round times, back to back: the ceiling's streaming sum over 4 KB pages and over huge pages, then
the kernel over 1 x L (Hq 32 and 16, 8 KV heads, block 64, shuffled blocks) with its pool on either. Prints the
host's THP settings and how much of each buffer the kernel actually gave huge pages (AnonHugePages).

    python3 benchmarks/probe_hugepages.py [--threads 14] [--rounds 7] [--out PATH]
"""
import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_attention import GB, _sum_all, median_seconds  # noqa: E402
from cpu_attention import paged_decode_attention  # noqa: E402

KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 64


def huge_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory advised for huge pages before its first touch, as HostKVPool allocates it."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def tensor(shape, dtype, huge: bool) -> torch.Tensor:
    count = int(np.prod(shape))
    if not huge:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(huge_buffer(count * dtype.itemsize), dtype=dtype).view(shape)


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def kernel_case(length, q_heads, rotate_bytes, huge, rng):
    blocks = length // BLOCK
    block_bytes = 2 * KV_HEADS * BLOCK * HEAD_DIM * 2
    rotations = max(1, -(-rotate_bytes // (blocks * block_bytes)))
    shape = (blocks * rotations, KV_HEADS, BLOCK, HEAD_DIM)
    k_cache, v_cache = tensor(shape, torch.bfloat16, huge), tensor(shape, torch.bfloat16, huge)
    k_cache.uniform_(-1, 1)
    v_cache.uniform_(-1, 1)
    order = torch.from_numpy(rng.permutation(shape[0]).astype(np.int32))
    tables = [order[r * blocks:(r + 1) * blocks].view(1, blocks) for r in range(rotations)]
    lens = torch.tensor([length], dtype=torch.int32)
    q = torch.randn(1, q_heads, HEAD_DIM).to(torch.bfloat16)
    return [lambda t=t: paged_decode_attention(q, k_cache, v_cache, t, lens, HEAD_DIM ** -0.5) for t in tables]


def ceiling_gbps(array, repeats=2) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _sum_all(array)
        best = min(best, time.perf_counter() - start)
    return array.nbytes / best / GB


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=14)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--ceiling-gb", type=float, default=4.0)
    p.add_argument("--rotate-gb", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    thp = {name: Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
           for name in ("enabled", "defrag") if Path(f"/sys/kernel/mm/transparent_hugepage/{name}").exists()}
    print(f"THP {thp}", flush=True)
    rng = np.random.default_rng(0)
    count = int(args.ceiling_gb * GB) // 4
    before = anon_huge_kib()
    plain = np.ones(count, np.float32)
    after_plain = anon_huge_kib()
    huge = np.frombuffer(huge_buffer(count * 4), np.float32)
    huge[:] = 1.0
    after_huge = anon_huge_kib()
    print(f"AnonHugePages: +{(after_plain - before) / 2**20:.2f} GiB for the 4 KB-page array, "
          f"+{(after_huge - after_plain) / 2**20:.2f} GiB for the advised one", flush=True)
    for array in (plain, huge):  # compile, and fault every page in before the first timing
        _sum_all(array)
    nbytes = 2 * args.length * KV_HEADS * HEAD_DIM * 2
    cases = {}
    for q_heads in (32, 16):
        for name, flag in (("plain", False), ("huge", True)):
            mark = anon_huge_kib()
            cases[(q_heads, name)] = kernel_case(args.length, q_heads, int(args.rotate_gb * GB), flag, rng)
            print(f"Hq {q_heads} {name} pool: AnonHugePages +{(anon_huge_kib() - mark) / 2**20:.2f} GiB", flush=True)
    rounds = []
    for r in range(args.rounds):
        row = {"ceiling_plain": ceiling_gbps(plain), "ceiling_huge": ceiling_gbps(huge)}
        for (q_heads, name), fns in cases.items():
            row[f"hq{q_heads}_{name}"] = nbytes / median_seconds(fns, 3, warmup=1) / GB
        rounds.append(row)
        print(" ".join(f"{k} {v:6.1f}" for k, v in row.items()), flush=True)
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for q_heads in (32, 16):
        for name in ("plain", "huge"):
            ratios = [r[f"hq{q_heads}_{name}"] / r[f"ceiling_{name}"] for r in rounds]
            summary[f"hq{q_heads}_{name}_over_own_ceiling"] = statistics.median(ratios)
            ratios = [r[f"hq{q_heads}_{name}"] / max(r["ceiling_plain"], r["ceiling_huge"]) for r in rounds]
            summary[f"hq{q_heads}_{name}_over_best_ceiling"] = statistics.median(ratios)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"thp": thp, "threads": args.threads, "length": args.length,
                                              "anon_huge_gib": {"plain_array": (after_plain - before) / 2**20,
                                                                "advised_array": (after_huge - after_plain) / 2**20},
                                              "rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
