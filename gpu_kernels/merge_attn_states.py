"""merge_attn_states: combine two partial attention results over disjoint key sets by log-sum-exp.

Layout: out_a/out_b `[T, H, D]` (any strides with a contiguous last dimension, any of fp32/bf16/fp16),
lse_a/lse_b float32 `[T, H]`, natural log. Returns out `[T, H, D]` in out_a's dtype and lse float32 `[T, H]`.

Contract: out = (e^lse_a * out_a + e^lse_b * out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b).
A partial with lse -inf is empty: the other passes through exactly (weight 1 and 0, whatever the empty
side's out holds), and both empty gives out 0, lse -inf, never NaN. This is how a sequence split across the
GPU and CPU tiers, or a prefix on one tier and a chunk on the other, becomes one attention result.
One program per (token, block of heads); grid from shapes only.
"""
import torch
import triton
import triton.language as tl

from ._common import KV_DTYPES, LOG2E, next_power_of_2, on_device

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_heads,
    stride_oa_t, stride_oa_h, stride_la_t, stride_la_h, stride_ob_t, stride_ob_h, stride_lb_t, stride_lb_h,
    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_heads
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    lse_a = tl.load(lse_a_ptr + token * stride_la_t + heads * stride_la_h, mask=head_mask, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + token * stride_lb_t + heads * stride_lb_h, mask=head_mask, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: weights 0 instead of exp(-inf - -inf) = NaN
    w_a = tl.exp2((lse_a - m) * _LOG2E)
    w_b = tl.exp2((lse_b - m) * _LOG2E)
    total = w_a + w_b
    safe_total = tl.where(total > 0, total, 1.0)
    out_a = tl.load(out_a_ptr + token * stride_oa_t + heads[:, None] * stride_oa_h + dims[None, :],
                    mask=mask, other=0.0).to(tl.float32)
    out_b = tl.load(out_b_ptr + token * stride_ob_t + heads[:, None] * stride_ob_h + dims[None, :],
                    mask=mask, other=0.0).to(tl.float32)
    # where(), not a multiply by 0: an empty side's out may hold anything, including NaN.
    merged = (tl.where(w_a[:, None] > 0, out_a * w_a[:, None], 0.0)
              + tl.where(w_b[:, None] > 0, out_b * w_b[:, None], 0.0)) / safe_total[:, None]
    lse = tl.where(total > 0, m + tl.log2(safe_total) * _LN2, float("-inf"))
    tl.store(out_ptr + token * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + token * stride_l_t + heads * stride_l_h, lse, mask=head_mask)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must both be [T, H, D], got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise ValueError(f"lse_a and lse_b must be [T, H] = {tuple(out_a.shape[:2])}, got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise ValueError(f"lse_a and lse_b must be float32, got {lse_a.dtype} and {lse_b.dtype}")
    if out_a.dtype not in KV_DTYPES or out_b.dtype not in KV_DTYPES:
        raise ValueError(f"out_a/out_b dtypes must be in {KV_DTYPES}, got {out_a.dtype} and {out_b.dtype}")
    if len({t.device for t in (out_a, lse_a, out_b, lse_b)}) != 1:
        raise ValueError("out_a, lse_a, out_b and lse_b must be on one device")


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial attention results; returns (out in out_a's dtype, lse float32)."""
    _check(out_a, lse_a, out_b, lse_b)
    num_tokens, num_heads, head_dim = out_a.shape
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    out_a = out_a if out_a.stride(-1) == 1 else out_a.contiguous()
    out_b = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_heads), max(1, 4096 // block_d))  # about 4K values per program
    with on_device(out_a):
        _merge_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out_a, lse_a, out_b, lse_b, out, lse, num_heads,
            out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
            out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        )
    return out, lse
