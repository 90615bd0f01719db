"""Does a promotion's read across PCIe hold up the device lane's step that runs beside it, and does the way it
reads matter? (issue 10; CUDA only.)

A promotion's KV is gathered from the pinned host pool by the device itself (kv_promotion.read_mapped, through a
CUDA alias of the pinned memory) on the low-priority "moves" stream, beside the device lane's CUDA graph on its
high-priority stream. Until 2026-11-24 that gather was torch's index_select. Step traces of 8B, 32 x (4096 + 512) at 3,296 blocks (H100 host,
2026-11-24) show each 632 MB promotion lengthening the device steps beside it by ~17 ms, about the whole transfer:
no overlap. This probe reproduces that with a stand-in step (a graph of bf16 GEMMs over ~15 GB of weights at 12
rows, HBM-bound like the 8B step) and times the step alone and beside three readers of the same 4,352 tokens
x 36 layers (8 KV heads x 128, host blocks of 64 tokens, scattered):
  index_select  the engine's way (all the SMs its grid asks for);
  triton_<n>    kernels.gather_host_blocks on n programs (n SMs at most), token-major into the device slots;
  dma           one cudaMemcpyAsync per host block and layer (copy engines, no SMs) into a staging buffer.
Each reader is also timed alone. Prints a table; --out writes JSON.

With --direction demote, the same for a demotion's writes of those tokens from the device slots into the host
blocks (kv_demotion.write_mapped):
  index_copy    the engine's way until 2026-11-24 (a gather on the device, then torch's index_copy_ into the
                mapped pool, all the SMs its grid asks for);
  triton_<n>    kernels.scatter_host_blocks on n programs;
  dma_runs      a gather on the device into host-block layout, then one cudaMemcpyAsync per layer, K/V and run
                of consecutive host blocks (copy engines, no SMs; the blocks made consecutive for it).

    python3 benchmarks/probe_promotion_overlap.py [--direction demote] [--out FILE]
"""
import argparse
import json
import statistics

import torch

from cpu_attention.kv_pool import cuda_alias
from kernels.host_block_copies import gather_host_blocks, scatter_host_blocks

LAYERS, HKV, HBS, D = 36, 8, 64, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4352)
    parser.add_argument("--weights-gb", type=float, default=15.0)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--direction", choices=("promote", "demote"), default="promote")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    blocks = -(-args.tokens // HBS)
    pool_blocks = 4 * blocks
    host = torch.empty((LAYERS, 2, pool_blocks, HKV, HBS, D), dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).random_(-16000, 16000)
    mapped = cuda_alias(host, torch.cuda.current_device()).view(host.shape)  # as HostKVPool.device_stacked
    block_ids = torch.randperm(pool_blocks)[:blocks]
    device_slots = torch.randperm(4 * args.tokens)[:args.tokens]
    pool = torch.zeros((LAYERS, 2, 4 * args.tokens, HKV, D), dtype=torch.bfloat16, device="cuda")
    reference = host[:, :, block_ids].transpose(3, 4).reshape(LAYERS, 2, -1, HKV, D)[:, :, :args.tokens]

    # The stand-in device step: GEMMs of `rows` rows over ~weights_gb of bf16 weights, captured once.
    mats = max(1, int(args.weights_gb * 1e9 / (14336 * 4096 * 2)))
    weights = torch.randn(mats, 14336, 4096, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(args.rows, 4096, dtype=torch.bfloat16, device="cuda")
    lane, moves, capture = (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0),
                            torch.cuda.Stream(priority=0))
    out = torch.empty(args.rows, 14336, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(capture):
        for i in range(mats):  # warm cuBLAS on this stream before capture
            torch.matmul(x, weights[i].T, out=out)
    capture.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        for i in range(mats):
            torch.matmul(x, weights[i].T, out=out)

    slots_dev = device_slots.cuda()
    ids_dev = block_ids.cuda()
    rows_in_gather = torch.arange(args.tokens, device="cuda")
    staging = torch.empty((LAYERS, 2, blocks, HKV, HBS, D), dtype=torch.bfloat16, device="cuda")
    host_blocks = block_ids.tolist()

    def index_select():
        gathered = mapped.index_select(2, ids_dev)
        tokens = gathered.transpose(3, 4).reshape(LAYERS, 2, -1, HKV, D).index_select(2, rows_in_gather)
        pool.index_copy_(2, slots_dev, tokens)

    def triton_reader(programs):
        return lambda: gather_host_blocks(mapped, pool, ids_dev, rows_in_gather, slots_dev, programs=programs)

    def dma():
        for layer in range(LAYERS):
            for kv in range(2):
                for j, block in enumerate(host_blocks):
                    staging[layer, kv, j].copy_(host[layer, kv, block], non_blocking=True)
        tokens = staging.transpose(3, 4).reshape(LAYERS, 2, -1, HKV, D)[:, :, :args.tokens]
        pool.index_copy_(2, slots_dev, tokens)

    readers = {"index_select": index_select, "dma": dma,
               **{f"triton_{n}": triton_reader(n) for n in (8, 16, 32, 132)}}
    if args.direction == "demote":  # the device pool holds the tokens; they go to the host blocks
        run = torch.arange(pool_blocks - blocks, pool_blocks)  # consecutive host blocks, for dma_runs
        pool[:, :, slots_dev] = reference.cuda()
        readers = _demotion_writers(mapped, host, pool, ids_dev, rows_in_gather, slots_dev, run, staging,
                                    args.tokens)

    def timed(stream, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            fn()
            end.record()
        return start, end

    results = {"tokens": args.tokens, "bytes": 2 * LAYERS * args.tokens * HKV * D * 2, "device": torch.cuda.get_device_name()}
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    alone = []
    for _ in range(args.repeats):
        s, e = timed(lane, graph.replay)
        torch.cuda.synchronize()
        alone.append(s.elapsed_time(e))
    results["step_alone_ms"] = statistics.median(alone)
    for name, read in readers.items():
        if args.direction == "demote":
            host.zero_()
            read()
            torch.cuda.synchronize()
            ids = run if name == "dma_runs" else block_ids
            written = host[:, :, ids].transpose(3, 4).reshape(LAYERS, 2, -1, HKV, D)[:, :, :args.tokens]
            correct = bool(torch.equal(written.view(torch.int16), reference.view(torch.int16)))
        else:
            pool.zero_()
            read()
            torch.cuda.synchronize()
            # Bit patterns, not values: random 16-bit patterns include NaNs, which never compare equal.
            correct = bool(torch.equal(pool[:, :, device_slots.cuda()].cpu().view(torch.int16),
                                       reference.view(torch.int16)))
        times = {"read_alone": [], "step_after_read": [], "step_before_read": [], "read_after_step": []}
        for _ in range(args.repeats):
            rs, re_ = timed(moves, read)
            torch.cuda.synchronize()
            times["read_alone"].append(rs.elapsed_time(re_))
            timed(moves, read)  # the read queued first, the step right behind it, as after a promotion
            ss, se = timed(lane, graph.replay)
            torch.cuda.synchronize()
            times["step_after_read"].append(ss.elapsed_time(se))
            ss, se = timed(lane, graph.replay)  # the step first, the read beside it
            rs, re_ = timed(moves, read)
            torch.cuda.synchronize()
            times["step_before_read"].append(ss.elapsed_time(se))
            times["read_after_step"].append(rs.elapsed_time(re_))
        row = {"correct": correct, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
        row["read_alone_gbps"] = results["bytes"] / row["read_alone_ms"] / 1e6
        results[name] = row
        print(f"{name:>13}: exact {correct} | read alone {row['read_alone_ms']:6.2f} ms ({row['read_alone_gbps']:5.1f} "
              f"GB/s) | step after the read {row['step_after_read_ms']:6.2f} ms, before it "
              f"{row['step_before_read_ms']:6.2f} (read {row['read_after_step_ms']:6.2f})", flush=True)
    print(f"step alone {results['step_alone_ms']:.2f} ms ({mats} GEMMs, {args.rows} rows)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def _demotion_writers(mapped, host, pool, ids_dev, rows, slots_dev, run, staging, tokens):
    """The ways a demotion can write the tokens at slots_dev into the host blocks ids_dev (dma_runs: into `run`)."""
    layers, two, blocks, hkv, hbs, d = staging.shape

    def in_host_layout():
        tokens_ = pool.index_select(2, slots_dev)  # [L, 2, tokens, Hkv, D]
        padded = torch.zeros((layers, two, blocks * hbs, hkv, d), dtype=pool.dtype, device=pool.device)
        padded[:, :, :tokens] = tokens_
        return padded.view(layers, two, blocks, hbs, hkv, d).transpose(3, 4)

    def index_copy():
        mapped.index_copy_(2, ids_dev, in_host_layout().contiguous())

    def dma_runs():
        staging.copy_(in_host_layout())
        first = int(run[0])
        for layer in range(layers):
            for kv in range(two):
                host[layer, kv, first:first + blocks].copy_(staging[layer, kv], non_blocking=True)

    return {"index_copy": index_copy, "dma_runs": dma_runs,
            **{f"triton_{n}": (lambda n=n: scatter_host_blocks(mapped, pool, ids_dev, rows, slots_dev, programs=n))
               for n in (4, 8, 16, 32)}}


if __name__ == "__main__":
    main()
