"""Attention on the host tier: numba kernels over head-major paged KV caches, and the worker that runs them.

Caches are [num_blocks, Hkv, block_size, D] torch CPU tensors (pinned when CUDA is present), read and written
in place through zero-copy numpy views. Contract: docs/design.md, "Kernel contracts"; measurements and the
designs weighed: docs/decisions/host-kernel.md.
"""
import os

from cpu_attention.kernel_switches import cache_tag
from cpu_attention.numba_cache import cache_across_files

# Before any kernel module is imported: numba picks a function's cache locator when it is decorated.
cache_across_files(os.path.dirname(os.path.abspath(__file__)), tag=cache_tag)

from cpu_attention.decode import paged_decode_attention, split_plan  # noqa: E402
from cpu_attention.executor import CpuAttentionExecutor, warmup  # noqa: E402
from cpu_attention.store import store_kvcache  # noqa: E402

__all__ = ["paged_decode_attention", "store_kvcache", "CpuAttentionExecutor", "warmup", "split_plan"]
