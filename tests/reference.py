"""Plain float64 references for the attention contracts, slow on purpose.

Both kernel families (`cpu_attention`, head-major caches, and `gpu_kernels`, token-major caches) are checked
against the same per-sequence reference: attention over one sequence's contiguous K/V, computed in float64.
"""
import math

import torch

from tests.conftest import TEST_DEVICE

LAYOUTS = ("token_major", "head_major")


def attention_reference(q, k, v, scale, first_query_position=None):
    """q [M, Hq, D], k/v [N, Hkv, D] -> (out [M, Hq, D], lse [M, Hq]) in float64.

    With `first_query_position=p`, query i sits at position p + i and sees keys 0..p+i (causal);
    without it every query sees every key. An empty key set gives out 0 and lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.zeros(num_q, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_q, num_q_heads), -math.inf, dtype=torch.float64)
    for i in range(num_q):
        visible = k.shape[0] if first_query_position is None else min(first_query_position + i + 1, k.shape[0])
        if visible <= 0:  # a query before position 0 (a masked row of the other tier) sees nothing
            continue
        for h in range(num_q_heads):
            scores = (k[:visible, h // group] @ q[i, h]) * scale
            lse[i, h] = torch.logsumexp(scores, dim=0)
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, h // group]
    return out, lse


def random_paged_kv(context_lens, num_kv_heads, head_dim, block_size, dtype, layout, extra_blocks=3, seed=0):
    """Random K/V for each sequence, scattered over a shuffled paged cache in the given layout.

    Returns (k_cache, v_cache, block_tables, keys, values): block_tables int32 [B, max_blocks] padded with -1;
    keys[b]/values[b] are the sequence's contiguous [L, Hkv, D] tensors (already rounded to `dtype`).
    Slots no sequence owns hold NaN, so a kernel that reads past a context length fails loudly.
    """
    assert layout in LAYOUTS
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(max(blocks_per_seq, default=0), 1) + 1  # one spare column of -1 padding
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    token_major = torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan, dtype=torch.float32)
    k_cache, v_cache = token_major.clone(), token_major.clone()
    keys, values = [], []
    for b, n in enumerate(context_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        for j in range(blocks_per_seq[b]):
            block = order.pop()
            block_tables[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, n))
            width = rows.stop - rows.start
            k_cache[block, :width] = k[rows].float()
            v_cache[block, :width] = v[rows].float()
    if layout == "head_major":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache.contiguous().to(dtype), v_cache.contiguous().to(dtype), block_tables, keys, values


def paged_decode_reference(q, keys, values, scale):
    """One query per sequence against that sequence's whole context: out [B, Hq, D], lse [B, Hq] (float64)."""
    outs, lses = zip(*(attention_reference(q[b : b + 1], keys[b], values[b], scale) for b in range(q.shape[0])))
    return torch.cat(outs), torch.cat(lses)


def relative_error(out, ref):
    """||out - ref|| / ||ref||, the figure every kernel test bounds."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def on_test_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Kernel inputs made on the CPU, moved to TEST_DEVICE (the same tensors when that is the CPU)."""
    return [t.to(TEST_DEVICE) for t in tensors]
