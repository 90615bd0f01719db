"""paged_prefill_attention: causal varlen attention of a prefill chunk over its paged KV (cached prefix + chunk).

Layout: k_cache/v_cache token-major `[num_blocks, block_size, Hkv, D]`; block_tables int32 `[B, max_blocks]`
padded with -1. q `[T, Hq, D]` packs every sequence's chunk; cu_seqlens_q int32 `[B+1]` delimits them.
context_lens int32 `[B]` counts sequence b's tokens in the cache *including* this chunk (its K/V were stored
before the call), so query i of sequence b sits at position context_lens[b] - q_len_b + i and sees keys
0..that position. max_seqlen_q (a Python int) only bounds the grid; rows with q_len 0 are allowed.
Returns out `[T, Hq, D]` in q's dtype and lse float32 `[T, Hq]` (natural log).

Flash-attention tiling: one program per (BLOCK_M queries, query head, sequence), online softmax over
BLOCK_N-key tiles gathered through the block table. Key tiles wholly below the tile's causal diagonal run
without the causal mask; tiles past the last query's position are never visited. Prefill is compute-bound,
so query heads of one kv head are separate programs and share K/V through L2 (adjacent program ids).

With `tiles` (int32 [G, 2]: each query tile's (sequence, tile index), -1 past the last; `prefill_tiles` builds
it) the grid is (G, Hq) instead and every program reads its tile there. The grid then depends on no Python value
of the step, so a CUDA graph can hold the kernel and replay it on any batch whose tiles fit G
(engine/graphs/prefill_graphs.py).
"""
import numpy as np
import torch
import triton
import triton.language as tl

from ._common import (check_int_tensor, check_paged_cache, check_queries, dot, exp2_scale, ieee_dot, interpreted,
                      on_device, padded_head_dim)

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_key_tiles(
    acc, m, l, q, positions, lo, hi, table, k_base, v_base,
    stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, CAUSAL: tl.constexpr, CONTIGUOUS: tl.constexpr,
):
    """Online-softmax update of (acc, m, l) with keys lo..hi-1; CAUSAL masks keys past each query's position.
    CONTIGUOUS: the table is the identity (block i is cache block i), so no table is read."""
    dims = tl.arange(0, BLOCK_D)
    for tile in range(lo, hi, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        valid = toks < hi
        if CONTIGUOUS:
            block = (toks // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(table + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = toks % BLOCK_SIZE
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_base + (block * stride_k_block + offset * stride_k_tok)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)
        scores = dot(q, tl.trans(k), IEEE, UPCAST) * qk_scale
        if CAUSAL:
            scores = tl.where(toks[None, :] <= positions[:, None], scores, float("-inf"))
        else:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A row can be fully masked in a tile before it has seen any key; keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + (block * stride_v_block + offset * stride_v_tok)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, UPCAST)
        m = m_new
    return acc, m, l


# The table's width changes from step to step (the batch's longest row): unspecialized, it compiles once.
@triton.jit(do_not_specialize=["stride_table_b"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, tiles_ptr, out_ptr, lse_ptr, qk_scale,
    stride_q_t, stride_q_h, stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head, stride_table_b,
    stride_out_t, stride_out_h, stride_lse_t, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, TILED: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):
    head = tl.program_id(1)
    if TILED:
        seq = tl.load(tiles_ptr + 2 * tl.program_id(0)).to(tl.int64)
        if seq < 0:  # past the step's last tile
            return
        m_block = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    else:
        # Reversed: the longest causal rows (last query tiles) start first, so the short ones fill the tail.
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid covers max_seqlen_q; shorter chunks end early
        return
    context = tl.load(context_lens_ptr + seq)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + dims[None, :], mask=io_mask, other=0.0)
    positions = context - q_len + rows

    first = context - q_len + m_block * BLOCK_M  # position of the tile's first query
    # Rows of the other KV tier arrive with context 0 (docs/design.md, "The dual maps"): their positions are
    # negative, they see no key, and the clamps keep both loops from walking a -1 block table.
    unmasked_end = tl.maximum((first + 1) // BLOCK_N * BLOCK_N, 0)  # keys every query of the tile sees
    end = tl.maximum(tl.minimum(context, first + BLOCK_M), 0)  # one past the last query's position
    kv_head = head // GROUP
    table = block_tables_ptr + seq * stride_table_b
    k_base = k_ptr + kv_head * stride_k_head
    v_base = v_ptr + kv_head * stride_v_head
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc, m, l = _attend_key_tiles(acc, m, l, q, positions, 0, unmasked_end, table, k_base, v_base,
                                  stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, qk_scale,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, IEEE, UPCAST, False, CONTIGUOUS)
    acc, m, l = _attend_key_tiles(acc, m, l, q, positions, unmasked_end, end, table, k_base, v_base,
                                  stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, qk_scale,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, IEEE, UPCAST, True, CONTIGUOUS)

    nonempty = l > 0
    safe_l = tl.where(nonempty, l, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(nonempty, (m + tl.log2(safe_l)) * _LN2, float("-inf"))
    tl.store(out_ptr + tokens[:, None] * stride_out_t + head * stride_out_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)
    tl.store(lse_ptr + tokens * stride_lse_t + head * stride_lse_h, lse, mask=row_mask)


LONG_TILE = (256, 64, 8, 3)  # 256 queries a program: 1.1-1.3x the default on 16k-query chunks (docs/results.md)
LONG_TILE_WAVES = 4  # the long tile only where its programs fill the SMs this many times over
LONG_TILE_SHARED_MEMORY = 200 * 1024  # bytes a block may take: its q tile and three stages of K/V tiles


def _tile_config(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for H100-class GPUs; small tiles under the interpreter."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # tests then cross query tiles, key tiles and pages with tiny shapes
    if dtype == torch.float32:  # ieee fp32 dots run on the FMA units and need twice the registers
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 16, 4, 2)
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def _gpu(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory a block may opt into, in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 0)


def _launch_config(device: torch.device, dtype: torch.dtype, num_q_heads: int, head_dim: int, max_seqlen_q: int,
                   batch: int, tiled: bool) -> tuple[int, int, int, int]:
    """_tile_config's, or LONG_TILE for untiled 16-bit calls with 65-128-dim heads whose query tiles of 256 fill the
    SMs LONG_TILE_WAVES times over, on GPUs with the shared memory for it."""
    config = _tile_config(device, dtype, head_dim)
    if tiled or device.type != "cuda" or dtype == torch.float32 or not 64 < head_dim <= 128:
        return config
    sms, shared_memory = _gpu(device)
    programs = triton.cdiv(max_seqlen_q, LONG_TILE[0]) * num_q_heads * batch
    if programs < LONG_TILE_WAVES * sms or shared_memory < LONG_TILE_SHARED_MEMORY:
        return config
    return LONG_TILE


def launch_configs(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[tuple[int, int, int, int]]:
    """Every config an untiled call on this device may take (_launch_config's choices): each is a kernel variant,
    compiled where a call first meets it unless run before."""
    config = _tile_config(device, dtype, head_dim)
    if device.type != "cuda" or dtype == torch.float32 or not 64 < head_dim <= 128:
        return [config]
    return [config] + ([LONG_TILE] if _gpu(device)[1] >= LONG_TILE_SHARED_MEMORY else [])


def query_tile_rows(device: torch.device, dtype: torch.dtype, head_dim: int) -> int:
    """Queries per program (BLOCK_M) for q of this device, dtype and head size: what `prefill_tiles` cuts by."""
    return _tile_config(device, dtype, head_dim)[0]


def prefill_tiles(query_lens, tile_rows: int, capacity: int) -> np.ndarray:
    """The `tiles` of a step whose rows have query_lens: int32 [capacity, 2], each query tile's (sequence, tile
    index) with the longest causal tiles first (so the short ones fill the tail, as the untiled grid orders
    them), then rows of -1."""
    counts = -(-np.asarray(query_lens, dtype=np.int64) // tile_rows)
    total = int(counts.sum())
    if total > capacity:
        raise ValueError(f"{total} query tiles do not fit a tile map of {capacity}")
    seqs = np.repeat(np.arange(len(counts)), counts)
    index = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort(-index, kind="stable")
    tiles = np.full((capacity, 2), -1, dtype=np.int32)
    tiles[:total, 0], tiles[:total, 1] = seqs[order], index[order]
    return tiles


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q,
                            tiles=None, contiguous: bool = False, config: tuple[int, int, int, int] | None = None):
    """Causal prefill attention over paged KV; returns (out [T, Hq, D] in q's dtype, lse float32 [T, Hq]).
    tiles: the query tiles to run (`prefill_tiles`, on q's device), in place of a grid over max_seqlen_q.
    contiguous: every row's table is the identity (0, 1, 2, ...: a staging cache), which the kernel then does not
    read (1.05-1.2x on 16k-query chunks). config: (BLOCK_M, BLOCK_N, num_warps, num_stages) in place of
    _launch_config's (benchmarks, tests)."""
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    group = check_queries(q, k_cache, num_kv_heads, head_dim)
    num_tokens, num_q_heads, _ = q.shape
    batch = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_int_tensor("context_lens", context_lens, (batch,))
    check_int_tensor("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_int_tensor("block_tables", block_tables, (batch, block_tables.shape[-1]))
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be a non-negative Python int, got {max_seqlen_q!r}")
    if tiles is not None:
        check_int_tensor("tiles", tiles, (tiles.shape[0], 2))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out, lse
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    block_m, block_n, num_warps, num_stages = config or _launch_config(
        q.device, q.dtype, num_q_heads, head_dim, max_seqlen_q, batch, tiles is not None)
    if tiles is None:
        grid = (triton.cdiv(max_seqlen_q, block_m), num_q_heads, batch)
    else:
        grid = (tiles.shape[0], num_q_heads, 1)
        tiles = tiles if tiles.is_contiguous() else tiles.contiguous()
    with on_device(q):
        _prefill_kernel[grid](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, tiles if tiles is not None else cu_seqlens_q,
            out, lse, exp2_scale(scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=padded_head_dim(head_dim), IEEE=ieee_dot(q.dtype), UPCAST=interpreted(q.device),
            TILED=tiles is not None, CONTIGUOUS=contiguous, num_warps=num_warps, num_stages=num_stages,
        )
    return out, lse
