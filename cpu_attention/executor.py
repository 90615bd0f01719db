"""The host tier's worker: one thread that runs every CPU attention call, in submission order.

One thread because numba's `workqueue` threading layer aborts the process when two threads launch parallel work at
once (which layer numba picks depends on the host); it also keeps a layer's K/V write ordered before the decode
that reads it. The kernels release the GIL, so the engine's main thread keeps driving the GPU meanwhile.
"""
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numba
import torch

from cpu_attention.decode import CACHE_DTYPES, paged_decode_attention
from cpu_attention.gather import gather_blocks, scatter_blocks
from cpu_attention.layer_loop import warm_decode_layers
from cpu_attention.store import PARALLEL_MIN_TOKENS, store_kvcache


class CpuAttentionExecutor:
    """submit(fn, *args, **kwargs) -> Future on the single worker thread "cpu-attention"."""

    def __init__(self, num_threads: int | None = None, warm: bool = True, dtypes: tuple = CACHE_DTYPES):
        """num_threads: numba threads for the kernels; by default all cores but two (host_threads). warm: compile
        (or load from numba's on-disk cache) the kernels for `dtypes` (the caches' element types in use) on the
        worker now: a first-ever compile takes tens of seconds a dtype, so the engine asks for its own dtype only
        and starts this before it loads the weights (docs/decisions/host-kernel.md, "One executor thread, all
        cores but two")."""
        cores = numba.config.NUMBA_NUM_THREADS
        if num_threads is None:
            num_threads = host_threads()
        if not 1 <= num_threads <= cores:
            raise ValueError(f"CpuAttentionExecutor: num_threads must be in 1..{cores} (NUMBA_NUM_THREADS), got "
                             f"{num_threads}")
        self.num_threads = num_threads
        # numba's thread count is per calling thread: set it on the worker. (A bound method as initializer
        # would let the worker thread keep this object alive until shutdown.)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attention",
                                        initializer=numba.set_num_threads, initargs=(num_threads,))
        self._warm = self._pool.submit(_timed, warmup, dtypes) if warm else None

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def warmup(self) -> float:
        """Blocks until the kernels are compiled (the constructor already started it when warm=True); returns
        the seconds the compile (or the load from numba's cache) took on the worker."""
        return (self._warm or self._pool.submit(_timed, warmup)).result()

    def drain(self) -> None:
        """Blocks until every call submitted so far has run (they run in order on one thread)."""
        self._pool.submit(lambda: None).result()

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def host_threads(ranks: int = 1) -> int:
    """Kernel threads of one executor: all cores but two, split evenly between the executors of `ranks`
    tensor-parallel ranks on this host. The two stay free for the engine's main and host-lane threads: a kernel
    thread that loses its core to either holds up the whole kernel."""
    return max(1, (numba.config.NUMBA_NUM_THREADS - 2) // ranks)


def _timed(fn, *args) -> float:
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


def warmup(dtypes=CACHE_DTYPES, head_dim: int = 8, block_size: int = 4) -> None:
    """Compiles every kernel the engine calls, on tiny inputs, for each cache dtype. The compiled code does not
    depend on shapes, so this covers all models; with numba's on-disk cache a later process only loads it."""
    for dtype in dtypes:
        k_cache = torch.zeros(2, 1, block_size, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        key = torch.ones(1, 1, head_dim, dtype=dtype)
        for slot_dtype in (torch.int32, torch.int64):
            store_kvcache(key, key, k_cache, v_cache, torch.zeros(1, dtype=slot_dtype))
        # The parallel store (prefill-sized writes): every slot -1, so it compiles without writing.
        many = PARALLEL_MIN_TOKENS
        store_kvcache(key.expand(many, 1, head_dim).contiguous(), key.expand(many, 1, head_dim).contiguous(),
                      k_cache, v_cache, torch.full((many,), -1, dtype=torch.int64))
        q = torch.ones(1, 2, head_dim, dtype=dtype)
        paged_decode_attention(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0)
        warm_decode_layers(dtype, head_dim, block_size)
        gather_blocks(k_cache, torch.zeros(1, dtype=torch.int64), torch.empty_like(k_cache[:1]))
        scatter_blocks(torch.empty_like(k_cache[:1]), torch.zeros(1, dtype=torch.int64), k_cache)
