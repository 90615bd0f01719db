"""store_kvcache: scatter the new tokens' K/V into the paged GPU cache.

Layout: k_cache/v_cache are token-major `[num_blocks, block_size, Hkv, D]` (flash-attn's), so one token's
K for all heads is one contiguous run of Hkv * D values. key/value are `[N, Hkv, D]` and may be strided
views (slices of a fused qkv projection); only the last dimension must have stride 1.

Contract: slot_mapping `[N]` (int32 or int64) holds slot = block * block_size + offset for token i, or -1 to
skip token i (its sequence lives on the CPU tier). Writes in place; every other slot is left untouched.
One program per token copies that token's [Hkv, D] tile; no host syncs, grid = (N,).
"""
import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, check_paged_cache, next_power_of_2, on_device


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_n, stride_key_h, stride_value_n, stride_value_h,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64: block * stride overflows int32 once a cache passes 2^31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Skipping is a mask, not a branch: slot -1 simply stores nothing. The slot is broadcast to the tile
    # before comparing because Triton's interpreter rejects a scalar bool folded into a block mask.
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (tl.broadcast_to(slot, [BLOCK_H, BLOCK_D]) >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    key = tl.load(key_ptr + token * stride_key_n + heads * stride_key_h + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok + heads * stride_kc_head + dims
    tl.store(k_dst, key, mask=mask)

    value = tl.load(value_ptr + token * stride_value_n + heads * stride_value_h + dims, mask=mask)
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok + heads * stride_vc_head + dims
    tl.store(v_dst, value, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value `[N, Hkv, D]` into the caches at `slot_mapping` (`-1` skips a token), in place."""
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    expected = (key.shape[0], num_kv_heads, head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key and value must be {expected}, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"key/value dtype ({key.dtype}, {value.dtype}) must match the cache dtype {k_cache.dtype}")
    check_int_tensor("slot_mapping", slot_mapping, (key.shape[0],), (torch.int32, torch.int64))
    if key.shape[0] == 0:
        return
    # A strided last dimension would break the vectorised row copy; such views are rare and small.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    with on_device(key):
        _store_kvcache_kernel[(key.shape[0],)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=4 if block_h * block_d >= 1024 else 1,
        )
