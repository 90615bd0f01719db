"""The kernel contract in plain torch, on any device, on the token-major `[num_blocks, block_size, Hkv, D]` layout:
the engine's path in CI (device="cpu") and the Triton backend's reference, not meant to be fast. Float32 with explicit
masks, so stale or NaN slots past a context never leak into the result."""
import math

import torch

_QUERY_CHUNK = 1024  # bounds the [chunk, Hq, keys] score matrix of long prefills


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_keys = block_tables.shape[1] * block_size
    tables = block_tables.clamp_min(0).long()
    k = k_cache[tables].reshape(batch, num_keys, num_kv_heads, head_dim).float()
    v = v_cache[tables].reshape(batch, num_keys, num_kv_heads, head_dim).float()
    valid = torch.arange(num_keys, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)  # [B, L]
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    out, lse = _softmax_values(scores, v, "bhgl,blhd->bhgd")
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype), lse.reshape(batch, num_q_heads)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q):
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, num_keys in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        if num_keys == 0 or first == last:
            continue
        blocks = block_tables[b, : math.ceil(num_keys / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:num_keys].float()
        v = v_cache[blocks].flatten(0, 1)[:num_keys].float()
        first_position = num_keys - (last - first)
        for lo in range(first, last, _QUERY_CHUNK):
            hi = min(lo + _QUERY_CHUNK, last)
            positions = torch.arange(lo - first, hi - first, device=q.device) + first_position
            out[lo:hi], lse[lo:hi] = _causal_attention(q[lo:hi], k, v, positions, scale)
    return out, lse


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    # exp(-inf - -inf) is NaN: an empty partial, or two, weigh nothing.
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    out = weight_a * out_a.float() + weight_b * out_b.float()
    return out.to(out_a.dtype), lse


def _causal_attention(q, k, v, positions, scale):
    """q [M, Hq, D] at `positions` against k/v [N, Hkv, D]; returns (out [M, Hq, D], lse [M, Hq])."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.float().view(num_q, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum("mhgd,nhd->mhgn", qg, k) * scale
    visible = torch.arange(k.shape[0], device=q.device).unsqueeze(0) <= positions.unsqueeze(1)  # [M, N]
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    out, lse = _softmax_values(scores, v, "mhgn,nhd->mhgd")
    return out.reshape(num_q, num_q_heads, head_dim).to(q.dtype), lse.reshape(num_q, num_q_heads)


def _softmax_values(scores, v, equation):
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum(equation, probs, v), lse
