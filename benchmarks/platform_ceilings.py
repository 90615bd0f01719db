"""What the host's two paths to host-tier KV reach, alone and at once, on the cores and streams the engine uses.

- host_kernel_gbps: our CPU kernel (cpu_attention.paged_decode_attention) over a head-major paged pool larger than the
  LLC (blocks shuffled), run on a CpuAttentionExecutor with its default thread count, the engine's;
- stream_gbps: the device streaming other blocks of the same pinned pool over PCIe into a staging buffer
  (gpu_kernels.host_kv_stream.stream_host_blocks), on a CUDA stream of its own, through the pool's device alias
  (HostKVPool.device_stacked, as the engine addresses it); pinned_copy_gbps: torch's pinned copy_ (the copy
  engine), for reference;
- together: both for the same wall window, each one's rate while the other runs, their sum_gbps, and
  combined_over_kernel_alone = sum_gbps / host_kernel_gbps (what streaming can add to the host tier's reads);
- hbm_gbps: the device's copy bandwidth (bench_throughput.hbm_copy_gbps).
Rates are KV bytes read per second at the median call. The kernel and the stream read disjoint halves of the pool,
so neither finds the other's lines in a cache. Off CUDA only the kernel is measured; the stream parts are None.

    python -m benchmarks.platform_ceilings [--seconds 2] [--batch 4] [--tokens 32768]
"""
import argparse
import itertools
import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

GB = 1e9


@dataclass(frozen=True)
class PoolShape:
    """The kernel's case: batch rows of `tokens` tokens each, bf16, in host blocks of block_size."""

    batch: int = 4
    tokens: int = 32768
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 64

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def blocks(self) -> int:
        return self.batch * self.blocks_per_seq

    @property
    def block_bytes(self) -> int:
        """One block's K and V, bf16."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * 2

    @property
    def kv_bytes(self) -> int:
        """What one kernel call (all rows) or one stream call (as many blocks) reads."""
        return self.blocks * self.block_bytes


def timed_calls(fn, seconds: float, barrier: threading.Barrier | None = None, min_calls: int = 3) -> list[float]:
    """Durations of calls to fn made until `seconds` have passed (after the barrier, if any), at least min_calls.
    Calls that end past the window are dropped, so that with a partner loop on the same window each kept call ran
    while the other side was running too (all are kept if none ended inside)."""
    if barrier is not None:
        barrier.wait()
    began = time.perf_counter()
    deadline = began + seconds
    spans = []
    while time.perf_counter() < deadline or len(spans) < min_calls:
        start = time.perf_counter()
        fn()
        spans.append((start, time.perf_counter()))
    inside = [end - start for start, end in spans if end <= deadline]
    return inside or [end - start for start, end in spans]


def gbps(nbytes: int, durations: list[float]) -> float:
    return nbytes / statistics.median(durations) / GB


def kernel_call(pool, shape: PoolShape):
    """A call of the CPU kernel over the pool's first shape.blocks blocks, cycling over two shuffled tables."""
    from cpu_attention import paged_decode_attention

    k_cache, v_cache = pool.layers[0]
    tables = [torch.randperm(shape.blocks, dtype=torch.int32).view(shape.batch, shape.blocks_per_seq)
              for _ in range(2)]
    lens = torch.full((shape.batch,), shape.tokens, dtype=torch.int32)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim).to(torch.bfloat16)
    scale, order = 1 / math.sqrt(shape.head_dim), itertools.cycle(tables)
    return lambda: paged_decode_attention(q, k_cache, v_cache, next(order), lens, scale)


def stream_call(pool, shape: PoolShape, device: torch.device, stream: torch.cuda.Stream):
    """A call of the device's stream copy of the pool's second half (shuffled) into staging, synced."""
    from gpu_kernels.host_kv_stream import stream_host_blocks

    mapped = pool.device_stacked()
    if mapped is None:
        raise RuntimeError("the device cannot address the pinned pool by its host pointer (no device alias)")
    host_layer = mapped[0]
    staging = torch.empty((2, shape.blocks, shape.kv_heads, shape.block_size, shape.head_dim),
                          dtype=torch.bfloat16, device=device)
    blocks = (torch.randperm(shape.blocks) + shape.blocks).to(device)
    count = torch.tensor([shape.blocks], dtype=torch.int64, device=device)

    def call():
        with torch.cuda.stream(stream):
            stream_host_blocks(host_layer, blocks, count, staging)
        stream.synchronize()

    return call


def pinned_copy_call(shape: PoolShape, device: torch.device, stream: torch.cuda.Stream):
    """A call of torch's pinned-host-to-device copy_ of shape.kv_bytes, synced."""
    source = torch.empty(shape.kv_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    target = torch.empty_like(source, device=device)

    def call():
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        stream.synchronize()

    return call


def together(executor, kernel, stream, nbytes: int, seconds: float) -> dict:
    """The kernel (on the executor's thread) and the stream (on this one) over the same wall window."""
    barrier = threading.Barrier(2, timeout=120)
    future = executor.submit(timed_calls, kernel, seconds, barrier)
    try:
        stream_durations = timed_calls(stream, seconds, barrier)
    except BaseException:
        barrier.abort()
        raise
    kernel_gbps, stream_gbps = gbps(nbytes, future.result()), gbps(nbytes, stream_durations)
    return {"kernel_gbps": kernel_gbps, "stream_gbps": stream_gbps, "sum_gbps": kernel_gbps + stream_gbps}


def measure_ceilings(seconds: float = 2.0, batch: int = 4, tokens: int = 32768, q_heads: int = 32, kv_heads: int = 8,
                     head_dim: int = 128, block_size: int = 64) -> dict:
    """The ceilings of the module docstring, each measured for about `seconds`; smaller shapes for CI."""
    from benchmarks.bench_throughput import hbm_copy_gbps
    from cpu_attention.executor import CpuAttentionExecutor
    from cpu_attention.kv_pool import HostKVPool

    shape = PoolShape(batch, tokens, q_heads, kv_heads, head_dim, block_size)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    # On CUDA the pool holds the kernel's blocks and, after them, as many for the stream.
    pool = HostKVPool(1, shape.blocks * (2 if cuda else 1), kv_heads, block_size, head_dim, torch.bfloat16,
                      pin_device=device)
    executor = CpuAttentionExecutor(dtypes=(torch.bfloat16,))
    result = {"shape": asdict(shape), "kv_bytes_per_call": shape.kv_bytes, "host_threads": executor.num_threads,
              "seconds": seconds, "pinned": False, "host_kernel_gbps": None, "stream_gbps": None,
              "pinned_copy_gbps": None, "together": None, "combined_over_kernel_alone": None, "hbm_gbps": None,
              "stream_error": None}
    try:
        pool.wait_pinned()
        result["pinned"] = pool.pinned
        pool.stacked.uniform_(-1, 1)
        executor.warmup()
        kernel = kernel_call(pool, shape)
        executor.submit(kernel).result()  # the first call plans and allocates: not timed
        result["host_kernel_gbps"] = gbps(shape.kv_bytes, executor.submit(timed_calls, kernel, seconds).result())
        if cuda:
            result.update(_device_parts(executor, pool, shape, device, kernel, seconds, result["host_kernel_gbps"]))
            result["hbm_gbps"] = hbm_copy_gbps()
    finally:
        executor.shutdown()
        pool.close()
        if cuda:
            torch.cuda.empty_cache()
    return result


def _device_parts(executor, pool, shape: PoolShape, device, kernel, seconds: float, kernel_alone: float) -> dict:
    """stream_gbps, pinned_copy_gbps, together and combined_over_kernel_alone; a stream that cannot run leaves
    the stream parts None and says why in stream_error (the copy engine's rate is still measured)."""
    parts, stream = {}, torch.cuda.Stream(device)
    copy = pinned_copy_call(shape, device, stream)
    copy()
    parts["pinned_copy_gbps"] = gbps(shape.kv_bytes, timed_calls(copy, seconds))
    del copy
    try:
        streamed = stream_call(pool, shape, device, stream)
        streamed()  # compiles the kernel
    except Exception as error:  # noqa: BLE001 (a kernel that cannot run here is a result, not a crash)
        return {**parts, "stream_error": f"{type(error).__name__}: {str(error)[:300]}"}
    parts["stream_gbps"] = gbps(shape.kv_bytes, timed_calls(streamed, seconds))
    parts["together"] = together(executor, kernel, streamed, shape.kv_bytes, seconds)
    parts["combined_over_kernel_alone"] = parts["together"]["sum_gbps"] / kernel_alone
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure_ceilings(args.seconds, args.batch, args.tokens)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
