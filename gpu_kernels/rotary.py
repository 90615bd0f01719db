"""norm_rope: per-head RMSNorm (Qwen3's q_norm / k_norm, optional) and the rotary embedding, in one kernel.

One launch for each of q and k, where the unfused path (layers/norm.py then layers/rotary.py) takes ~34 a layer
(docs/decisions/device-kernels.md, "Fused norms, rotary and silu").

Contract: x [T, H, D] (any strides, the last 1; a slice of the fused qkv projection), positions [T] int,
cos/sin float32 [max_position, D/2] (the rotate-half form: out = [x1*cos - x2*sin, x2*cos + x1*sin] for the
halves x1, x2 of each head), weight [D] or None (no norm), eps. Returns a new contiguous [T, H, D] in x's dtype.
The norm's output is rounded to x's dtype, then multiplied by the weight and rounded again, and the rotation
runs in float32 on that, as the unfused path does. One program per token and group of heads; no host syncs.

With `store` (KVStore: value [T, H, D], token-major caches [blocks, block_size, H, D], slot_mapping [T], -1 skips a
token), the kernel for k also writes the rotated k and the value into the caches at each token's slot, as
store_kvcache would: one launch a layer instead of two in a decode step.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, check_paged_cache, next_power_of_2, on_device


class KVStore(NamedTuple):
    """Where norm_rope also writes k (rotated) and v: store_kvcache's arguments but the key."""

    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


@triton.jit
def _norm_rope_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr, weight_ptr, out_ptr,
    stride_x_t, stride_x_h, stride_out_t, stride_out_h, stride_cos,
    num_heads, eps,
    value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_v_t, stride_v_h,
    stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_STORE: tl.constexpr, CACHE_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    base = x_ptr + token * stride_x_t + heads * stride_x_h
    x1 = tl.load(base + dims, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + dims, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        a = ((a * rstd[:, None]).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) * w1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
        b = ((b * rstd[:, None]).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) * w2).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + dims, mask=dims < HALF, other=0.0)
    first = (a * cos - b * sin).to(dtype, fp_downcast_rounding="rtne")
    second = (b * cos + a * sin).to(dtype, fp_downcast_rounding="rtne")
    out = out_ptr + token * stride_out_t + heads * stride_out_h
    tl.store(out + dims, first, mask=mask)
    tl.store(out + HALF + dims, second, mask=mask)
    if HAS_STORE:
        # int64: block * stride overflows int32 past 2^31 cache elements. Slot -1 masks the stores (as in
        # store_kvcache, broadcast first: the interpreter rejects a scalar folded into a block mask).
        slot = tl.load(slot_ptr + token).to(tl.int64)
        keep = mask & (tl.broadcast_to(slot, [BLOCK_H, BLOCK_HALF]) >= 0)
        block, offset = slot // CACHE_BLOCK, slot % CACHE_BLOCK
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok + heads * stride_kc_head
        tl.store(k_dst + dims, first, mask=keep)
        tl.store(k_dst + HALF + dims, second, mask=keep)
        value = value_ptr + token * stride_v_t + heads * stride_v_h
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok + heads * stride_vc_head
        tl.store(v_dst + dims, tl.load(value + dims, mask=keep), mask=keep)
        tl.store(v_dst + HALF + dims, tl.load(value + HALF + dims, mask=keep), mask=keep)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              weight: torch.Tensor | None = None, eps: float = 1e-6, store: KVStore | None = None) -> torch.Tensor:
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(-1) != 1 or cos.shape[1] != dim // 2 or cos.dtype != torch.float32:
        raise ValueError(f"norm_rope needs x [T, H, D] (D even, unit last stride) and float32 cos/sin [P, D/2], got "
                         f"{tuple(x.shape)} (strides {x.stride()}) and {tuple(cos.shape)} {cos.dtype}")
    if weight is not None and weight.shape != (dim,):
        raise ValueError(f"norm_rope: weight {tuple(weight.shape)} is not [{dim}]")
    if store is not None:
        _check_store(x, store)
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    block_h = min(next_power_of_2(heads), 16)
    # Without a store the kernel touches none of its arguments (HAS_STORE): x and out stand in.
    value, k_cache, v_cache, slots = store if store is not None else (x, out, out, positions)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3]) if store is not None else (0,) * 6
    if tokens:
        with on_device(x):
            _norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
                x, positions, cos, sin, weight if weight is not None else x, out,
                x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), heads, eps,
                value, k_cache, v_cache, slots, value.stride(0), value.stride(1), *cache_strides,
                HALF=dim // 2, BLOCK_HALF=next_power_of_2(dim // 2), BLOCK_H=block_h, HAS_NORM=weight is not None,
                HAS_STORE=store is not None, CACHE_BLOCK=k_cache.shape[1] if store is not None else 1)
    return out


def _check_store(x: torch.Tensor, store: KVStore) -> None:
    """store_kvcache's checks, for the key norm_rope makes from x."""
    block_size, num_kv_heads, head_dim = check_paged_cache(store.k_cache, store.v_cache)
    expected = (x.shape[0], num_kv_heads, head_dim)
    if tuple(x.shape) != expected or tuple(store.value.shape) != expected or store.value.stride(-1) != 1:
        raise ValueError(f"norm_rope's store needs key and value {expected} (value with a unit last stride), got "
                         f"{tuple(x.shape)} and {tuple(store.value.shape)} (strides {store.value.stride()})")
    if x.dtype != store.k_cache.dtype or store.value.dtype != store.v_cache.dtype:
        raise ValueError(f"key/value dtype ({x.dtype}, {store.value.dtype}) must match the cache dtype "
                         f"{store.k_cache.dtype}")
    check_int_tensor("slot_mapping", store.slot_mapping, (x.shape[0],), (torch.int32, torch.int64))
