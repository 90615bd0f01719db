"""norm_rope: per-head RMSNorm (Qwen3's q_norm / k_norm, optional) and the rotary embedding, in one kernel.

Unfused (layers/norm.py then layers/rotary.py) a layer's q and k take ~34 launches: each norm nine, the rotary
embedding two gathers of cos/sin and, per tensor, a cast, four products, a sum, a difference, a concatenation and
a cast back. Here each of q and k is one launch.

Contract: x [T, H, D] (any strides, the last 1; a slice of the fused qkv projection), positions [T] int,
cos/sin float32 [max_position, D/2] (the rotate-half form: out = [x1*cos - x2*sin, x2*cos + x1*sin] for the
halves x1, x2 of each head), weight [D] or None (no norm), eps. Returns a new contiguous [T, H, D] in x's dtype.
The norm's output is rounded to x's dtype, then multiplied by the weight and rounded again, and the rotation
runs in float32 on that, as the unfused path does. One program per token and group of heads; no host syncs.
"""
import torch
import triton
import triton.language as tl

from ._common import next_power_of_2, on_device


@triton.jit
def _norm_rope_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr, weight_ptr, out_ptr,
    stride_x_t, stride_x_h, stride_out_t, stride_out_h, stride_cos,
    num_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
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
    out = out_ptr + token * stride_out_t + heads * stride_out_h
    tl.store(out + dims, (a * cos - b * sin).to(dtype, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(out + HALF + dims, (b * cos + a * sin).to(dtype, fp_downcast_rounding="rtne"), mask=mask)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(-1) != 1 or cos.shape[1] != dim // 2 or cos.dtype != torch.float32:
        raise ValueError(f"norm_rope needs x [T, H, D] (D even, unit last stride) and float32 cos/sin [P, D/2], got "
                         f"{tuple(x.shape)} (strides {x.stride()}) and {tuple(cos.shape)} {cos.dtype}")
    if weight is not None and weight.shape != (dim,):
        raise ValueError(f"norm_rope: weight {tuple(weight.shape)} is not [{dim}]")
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    block_h = min(next_power_of_2(heads), 16)
    if tokens:
        with on_device(x):
            _norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
                x, positions, cos, sin, weight if weight is not None else x, out,
                x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), heads, eps,
                HALF=dim // 2, BLOCK_HALF=next_power_of_2(dim // 2), BLOCK_H=block_h, HAS_NORM=weight is not None)
    return out
