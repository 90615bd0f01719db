"""flash-attn behind our kernel contract, imported only where flash_attn is installed. It reads the token-major paged
layout directly but needs block sizes that are multiples of 256: other caches (staged host prefixes) use Triton.
"""
import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

import kernels
from kernels import merge_attn_states, store_kvcache  # noqa: F401  (part of the backend interface)

_PAGE_MULTIPLE = 256


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    if k_cache.shape[1] % _PAGE_MULTIPLE:
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    out, lse = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens, block_table=block_tables.clamp_min(0),
        softmax_scale=scale, causal=True, return_softmax_lse=True,
    )
    return out.squeeze(1), lse.squeeze(-1).float()


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q):
    if k_cache.shape[1] % _PAGE_MULTIPLE:
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q)
    cu_seqlens_k = torch.nn.functional.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=k_cache.shape[1] * block_tables.shape[1], softmax_scale=scale, causal=True,
        block_table=block_tables.clamp_min(0), return_attn_probs=True,
    )
    return out, lse.transpose(0, 1).float()  # flash-attn's varlen lse is [H, T]

