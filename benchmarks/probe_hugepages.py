"""Does the host kernel read faster from memory on transparent huge pages? One process, paired rounds.

The engine's host pool (cpu_attention/kv_pool.py) asks for huge pages (MADV_HUGEPAGE); bench_cpu_attention's
pools come from torch.empty, which gets them only where the host's THP mode is "always". Each round times, back to
back: the read ceiling (bench_cpu_attention's ReadCeiling) over its own np.ones array and over one advised here,
then the kernel over 1 x L (Hq 32 and 16, 8 KV heads, block 64, shuffled blocks: bench_cpu_attention's paged_case)
with its pool from torch.empty or on advised memory. Prints the host's THP settings and how much of each buffer the
kernel actually gave huge pages (AnonHugePages): numpy advises its large arrays itself, so both ceilings may read
huge pages (they did on the H100 host, 2026-11-23).

    python3 benchmarks/probe_hugepages.py [--threads 14] [--rounds 7] [--out PATH]
"""
import argparse
import json
import mmap
import statistics
import sys
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_attention import GB, ReadCeiling, median_seconds, paged_case  # noqa: E402
from benchmarks.profile_host_kernel_rate import write_result  # noqa: E402

KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 64


def huge_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory advised for huge pages before its first touch, as HostKVPool allocates it."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def huge_empty(shape, dtype) -> torch.Tensor:
    """torch.empty's contract (paged_case's allocator) on memory advised for huge pages."""
    return torch.frombuffer(huge_buffer(int(np.prod(shape)) * dtype.itemsize), dtype=dtype).view(shape)


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


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
    count = int(args.ceiling_gb * GB) // 4
    before = anon_huge_kib()
    plain = ReadCeiling(args.ceiling_gb)  # (its first sum compiles and faults every page in)
    after_plain = anon_huge_kib()
    advised = np.frombuffer(huge_buffer(count * 4), np.float32)
    advised[:] = 1.0
    huge = ReadCeiling(args.ceiling_gb, advised)
    after_huge = anon_huge_kib()
    print(f"AnonHugePages: +{(after_plain - before) / 2**20:.2f} GiB for np.ones' array, "
          f"+{(after_huge - after_plain) / 2**20:.2f} GiB for the advised one", flush=True)
    nbytes = 2 * args.length * KV_HEADS * HEAD_DIM * 2
    cases = {}
    for q_heads in (32, 16):
        for name, flag in (("plain", False), ("huge", True)):
            mark = anon_huge_kib()
            dims = argparse.Namespace(kv_heads=KV_HEADS, q_heads=q_heads, head_dim=HEAD_DIM, rotate_gb=args.rotate_gb)
            cases[(q_heads, name)] = paged_case(1, args.length, BLOCK, dims, huge_empty if flag else torch.empty)
            print(f"Hq {q_heads} {name} pool: AnonHugePages +{(anon_huge_kib() - mark) / 2**20:.2f} GiB", flush=True)
    rounds = []
    for _ in range(args.rounds):
        row = {"ceiling_plain": plain.gbps(2), "ceiling_huge": huge.gbps(2)}
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
    write_result(args.out, {"thp": thp, "threads": args.threads, "length": args.length,
                            "anon_huge_gib": {"plain_array": (after_plain - before) / 2**20,
                                              "advised_array": (after_huge - after_plain) / 2**20},
                            "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
