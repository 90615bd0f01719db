"""One sequence's causal prefill over a contiguous token-major cache, through torch's scaled_dot_product_attention
(its flash kernel on CUDA in 16-bit): prefill segments' chunks, which attend their staging cache whole.

Contract: q [M, Hq, D] holds the last M of num_keys positions; k_cache/v_cache [blocks, block_size, Hkv, D] hold
token t at flat index t (a staging cache). Query i sees keys 0..num_keys - M + i (causal, aligned lower right).
Returns out [M, Hq, D] in q's dtype, no log-sum-exp (a segment's chunk has no other partial to merge). On a 262k
prompt's chunks it runs at SDPA's flash rate, above our Triton kernel's (docs/decisions/device-kernels.md).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def contiguous_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_keys: int,
                                 scale: float) -> torch.Tensor:
    num_queries, _, head_dim = q.shape
    if not 0 < num_queries <= num_keys <= k_cache.shape[0] * k_cache.shape[1]:
        raise ValueError(f"need 0 < queries ({num_queries}) <= num_keys ({num_keys}) <= the cache's tokens")
    keys, values = (cache.view(-1, *cache.shape[2:])[:num_keys].transpose(0, 1)[None] for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                         attn_mask=causal_lower_right(num_queries, num_keys), scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
