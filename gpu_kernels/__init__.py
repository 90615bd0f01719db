"""Triton GPU kernels for the device KV tier (token-major `[num_blocks, block_size, Hkv, D]` caches), and the moves
of KV between it and the host tier's blocks (gather_host_blocks, scatter_host_blocks, write_host_blocks_whole).

Each follows the attention contract of docs/design.md, "Kernel contracts", and stays launchable inside a CUDA
graph: grids and tile choices depend on shapes only, never on tensor values.
"""
from .host_block_copies import gather_host_blocks, scatter_host_blocks, write_host_blocks_whole
from .merge_attn_states import merge_attn_states
from .paged_decode import paged_decode_attention
from .paged_prefill import paged_prefill_attention
from .rms_norm import rms_norm
from .rotary import KVStore, norm_rope
from .sample import sample_tokens
from .silu_and_mul import silu_and_mul
from .skinny_gemm import skinny_linear
from .store_kvcache import store_kvcache

__all__ = ["store_kvcache", "paged_decode_attention", "paged_prefill_attention", "merge_attn_states", "rms_norm",
           "norm_rope", "KVStore", "sample_tokens", "silu_and_mul", "skinny_linear", "gather_host_blocks",
           "scatter_host_blocks", "write_host_blocks_whole"]
