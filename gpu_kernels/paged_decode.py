"""paged_decode_attention: one new query per sequence against its paged KV (flash-decoding).

Layout: k_cache/v_cache token-major `[num_blocks, block_size, Hkv, D]`; block_tables int32
`[B, max_blocks]` padded with -1 (entries past a row's context are never read); context_lens int32 `[B]`.
q `[B, Hq, D]`; query head h reads kv head h // (Hq // Hkv).
Returns out `[B, Hq, D]` in q's dtype and lse float32 `[B, Hq]` (natural log); a row with context 0 gives
out 0 and lse -inf.

Decode is memory-bound, so the design is about streaming each K/V byte once with enough programs in flight:
- one program per (kv head, split, sequence) handles all `group` query heads of that kv head, so each K/V
  tile is loaded once; the [group, D] x [D, BLOCK_N] product is a tl.dot with the group padded to 16
  rows (the tensor cores have plenty of slack in a memory-bound kernel);
- split-K: the number of splits comes from shapes only (batch, kv heads, max_blocks, SM count), so the
  launch is CUDA-graph safe; inside the kernel each row's *actual* context is divided evenly over the splits,
  so short rows in a wide block table still use every split, and splits past a short context are empty;
- a second small kernel merges the per-split partials by log-sum-exp (skipped when there is one split).
"""
import torch
import triton
import triton.language as tl

from ._common import (check_int_tensor, check_paged_cache, check_queries, dot, exp2_scale, ieee_dot, interpreted,
                      next_power_of_2, on_device, padded_head_dim, sm_count)

_LN2 = tl.constexpr(0.6931471805599453)
MAX_SPLITS = 64  # bounds the reduction tile [splits, D] and the partial buffers
PROGRAMS_PER_SM = 8  # programs of one launch per SM, at most: more splits leave a tail (choose_num_splits)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    qk_scale, num_splits,
    stride_q_b, stride_q_h, stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head, stride_table_b,
    stride_out_b, stride_out_h, stride_out_split, stride_lse_b, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    FINAL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    context = tl.load(context_lens_ptr + seq)
    # Tiles stay BLOCK_N-aligned within a split so only each split's last tile is partial.
    chunk = tl.cdiv(tl.cdiv(context, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, context)

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_table_b
    k_base = k_ptr + kv_head * stride_k_head
    v_base = v_ptr + kv_head * stride_v_head
    for tile in range(start, end, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        valid = toks < end
        # Masked table reads: -1 padding past the context is never dereferenced.
        block = tl.load(table + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = toks % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_base + (block * stride_k_block + offset * stride_k_tok)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)
        scores = dot(q, tl.trans(k), IEEE, UPCAST) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite and exp2 never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + (block * stride_v_block + offset * stride_v_tok)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, UPCAST)
        m = m_new

    nonempty = l > 0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    lse2 = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    out_ptrs = out_ptr + seq * stride_out_b + heads[:, None] * stride_out_h + split * stride_out_split
    lse_ptrs = lse_ptr + seq * stride_lse_b + heads * stride_lse_h + split
    if FINAL:  # a single split writes the result directly, in q's dtype and natural log
        tl.store(out_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & dim_mask[None, :])
        tl.store(lse_ptrs, lse2 * _LN2, mask=row_mask)
    else:  # partials stay float32 and in log2 units for the reduction
        tl.store(out_ptrs + dims[None, :], out, mask=row_mask[:, None] & dim_mask[None, :])
        tl.store(lse_ptrs, lse2, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
    stride_part_b, stride_part_h, stride_part_split, stride_plse_b, stride_plse_h,
    stride_out_b, stride_out_h, stride_lse_b, stride_lse_h,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse2 = tl.load(part_lse_ptr + seq * stride_plse_b + head * stride_plse_h + splits,
                   mask=split_mask, other=float("-inf"))
    m = tl.max(lse2, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights become exp2(-inf) = 0, not NaN
    weights = tl.exp2(lse2 - m)
    total = tl.sum(weights, axis=0)
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + seq * stride_part_b + head * stride_part_h
                    + splits[:, None] * stride_part_split + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    lse = tl.where(total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * _LN2, float("-inf"))
    tl.store(out_ptr + seq * stride_out_b + head * stride_out_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)
    tl.store(lse_ptr + seq * stride_lse_b + head * stride_lse_h, lse)


def _tile_config(q: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): about 16 KB of K and of V per iteration on the GPU."""
    if q.device.type != "cuda":
        return 16, 4, 1  # small tiles: the interpreter tests then cross tiles, pages and splits
    bytes_per_row = padded_head_dim(head_dim) * q.element_size()
    block_n = max(16, min(128, 16384 // bytes_per_row))
    return block_n, 4, 2


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, block_n: int,
                      device: torch.device) -> int:
    """Splits per row from shapes only: as many as keep the launch within PROGRAMS_PER_SM programs per SM, but each
    split at least two key tiles of the widest possible context (a split's fixed cost is one q load, one partial
    write and its share of the merge). Rounding down, not up, matters: on the H200 (sweep_decode_tiles.py) 8 x 32k
    read 0.74 of the HBM rate at 9 splits, one launch's worth and a tail, and 0.99 at 16."""
    fits = PROGRAMS_PER_SM * sm_count(device) // max(1, batch * num_kv_heads)
    by_length = triton.cdiv(max_blocks * block_size, 2 * block_n)
    return max(1, min(fits, by_length, MAX_SPLITS))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, num_splits=None,
                           config: tuple | None = None):
    """Decode attention over paged KV; returns (out [B, Hq, D] in q's dtype, lse float32 [B, Hq]).

    `num_splits` overrides the shape-derived split count (tests use it to force split-K paths); `config`
    (BLOCK_N, num_warps, num_stages) overrides _tile_config's (benchmarks/sweep_decode_tiles.py).
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    group = check_queries(q, k_cache, num_kv_heads, head_dim)
    batch, num_q_heads, _ = q.shape
    check_int_tensor("block_tables", block_tables, (batch, block_tables.shape[-1]))
    check_int_tensor("context_lens", context_lens, (batch,))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    block_n, num_warps, num_stages = config or _tile_config(q, head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size, block_n, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    final = num_splits == 1
    if final:
        part_out, part_lse = out, lse
        part_strides = (out.stride(0), out.stride(1), 0, lse.stride(0), lse.stride(1))
    else:
        part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                        part_lse.stride(0), part_lse.stride(1))
    with on_device(q):
        _decode_split_kernel[(num_kv_heads, num_splits, batch)](
            q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
            exp2_scale(scale), num_splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            *part_strides,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, next_power_of_2(group)),
            BLOCK_N=block_n, BLOCK_D=padded_head_dim(head_dim), IEEE=ieee_dot(q.dtype),
            UPCAST=interpreted(q.device), FINAL=final,
            num_warps=num_warps, num_stages=num_stages,
        )
        if not final:
            _decode_reduce_kernel[(batch, num_q_heads)](
                part_out, part_lse, out, lse, num_splits,
                part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
                out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(num_splits), BLOCK_D=next_power_of_2(head_dim),
                num_warps=4,
            )
    return out, lse

