"""Attention on the host tier: numba kernels over head-major paged KV caches, and the worker that runs them.

Caches are [num_blocks, Hkv, block_size, D] torch CPU tensors (pinned when CUDA is present), read and written
in place through zero-copy numpy views. See DESIGN.md, "Kernel contracts".
"""
from cpu_attention.decode import paged_decode_attention, split_plan
from cpu_attention.executor import CpuAttentionExecutor, warmup
from cpu_attention.store import store_kvcache

__all__ = ["paged_decode_attention", "store_kvcache", "CpuAttentionExecutor", "warmup", "split_plan"]
