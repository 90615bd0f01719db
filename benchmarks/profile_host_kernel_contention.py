"""Does a busy device lane slow the host tier's CPU attention kernel, and why? (GPU host)

    python benchmarks/profile_host_kernel_contention.py --out contention.json

In the engine (profile_host_lane.py) the kernel read a host step's KV 2.4x slower while the device lane ran.
This times the same kernel, on the executor as the engine runs it, over a Qwen3-0.6B-shaped host pool (28
layers of 32 rows x 1,040 tokens, blocks scattered as the allocator leaves them), under:
- quiet: nothing else running;
- cuda_sync_loop: another Python thread launching small GPU work and synchronizing, as the device lane does;
- python_loop: another thread running pure Python (holding the GIL between switch intervals), at Python's
  default switch interval (5 ms) and at 0.2 ms;
- sleep_loop: another thread waking every 0.1 ms;
at several numba thread counts. Prints GB/s per case, the host's CPU topology and numba's threading layer.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numba
import torch

from cpu_attention import CpuAttentionExecutor, paged_decode_attention
from cpu_attention.kv_pool import HostKVPool

LAYERS, ROWS, TOKENS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 28, 32, 1040, 8, 16, 128, 64


def busy_thread(kind: str, stop: threading.Event) -> threading.Thread:
    def cuda_sync_loop():
        x = torch.randn(4096, 4096, device="cuda")
        while not stop.is_set():
            for _ in range(20):
                x.mul_(1.0)
            x.sum().item()

    def python_loop():
        n = 0
        while not stop.is_set():
            n += 1

    def sleep_loop():
        while not stop.is_set():
            time.sleep(1e-4)

    thread = threading.Thread(target={"cuda_sync_loop": cuda_sync_loop, "python_loop": python_loop,
                                      "sleep_loop": sleep_loop}[kind], daemon=True)
    thread.start()
    return thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="14,12,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    topology = subprocess.run("lscpu | grep -E 'Thread|Core|Socket|NUMA|Model name'", shell=True,
                              capture_output=True, text=True).stdout
    print(topology)
    blocks_per_row = -(-TOKENS // BLOCK)
    num_blocks = ROWS * blocks_per_row + 64
    pool = HostKVPool(LAYERS, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16,
                      pin_device=torch.device("cuda") if torch.cuda.is_available() else None)
    pool.wait_pinned()
    for k, v in pool.layers:
        k.copy_(torch.randn_like(k, dtype=torch.float32).to(torch.bfloat16))
        v.copy_(torch.randn_like(v, dtype=torch.float32).to(torch.bfloat16))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: ROWS * blocks_per_row]
    tables = order.view(ROWS, blocks_per_row).to(torch.int32)
    lens = torch.full((ROWS,), TOKENS, dtype=torch.int32)
    q = torch.randn(ROWS, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    kv_bytes = LAYERS * ROWS * TOKENS * KV_HEADS * HEAD_DIM * 2 * 2
    results = {"topology": topology, "threading_layer": None, "cases": []}
    for threads in map(int, args.threads.split(",")):
        executor = CpuAttentionExecutor(num_threads=threads, dtypes=(torch.bfloat16,))
        executor.warmup()

        def step():
            for k, v in pool.layers:
                executor.submit(paged_decode_attention, q, k, v, tables, lens, 0.088).result()

        step()
        results["threading_layer"] = executor.submit(numba.threading_layer).result()
        for kind in ("quiet", "cuda_sync_loop", "python_loop", "python_loop_0.2ms", "sleep_loop"):
            sys.setswitchinterval(0.0002 if kind.endswith("0.2ms") else 0.005)
            kind = kind.removesuffix("_0.2ms") if kind.endswith("0.2ms") else kind
            label = kind if sys.getswitchinterval() == 0.005 else f"{kind} (switch 0.2 ms)"
            stop = threading.Event()
            thread = busy_thread(kind, stop) if kind != "quiet" else None
            time.sleep(0.05)
            times = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                step()
                times.append(time.perf_counter() - began)
            stop.set()
            if thread:
                thread.join()
            best, median = min(times), sorted(times)[len(times) // 2]
            case = {"numba_threads": threads, "load": label, "step_ms_median": 1e3 * median,
                    "gb_s_median": kv_bytes / median / 1e9, "gb_s_best": kv_bytes / best / 1e9}
            results["cases"].append(case)
            print(f"numba threads {threads:>2}, {label:<30}: {case['step_ms_median']:7.1f} ms a step "
                  f"({case['gb_s_median']:.1f} GB/s, best {case['gb_s_best']:.1f})", flush=True)
        executor.shutdown()
    print("threading layer:", results["threading_layer"], "| cores:", os.cpu_count())
    pool.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
