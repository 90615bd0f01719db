"""silu_and_mul: SwiGLU's silu(gate) * up over a fused gate/up projection, in one kernel.

Unfused (layers/activation.py) it is two launches per layer, silu then the product, with the silu result
written out and read back in between (docs/decisions/device-kernels.md, "Fused norms, rotary and silu").

Contract: x [rows, 2 * D] (the last dimension has stride 1), gate = x[:, :D], up = x[:, D:]. out [rows, D] in x's
dtype: silu(gate) = gate / (1 + exp(-gate)) in float32, rounded to the dtype, then times up in float32, rounded
again: the rounding points of torch's two ops, so the paths differ only where float32 exp differs by an ulp.
A grid of (rows, column tiles); no host syncs.
"""
import torch
import triton
import triton.language as tl

from ._common import on_device

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype, fp_downcast_rounding="rtne")
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype, fp_downcast_rounding="rtne"), mask=inside)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """-> silu(x[:, :D]) * x[:, D:], [rows, D]."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x [rows, 2 * D] with a unit last stride, got {tuple(x.shape)} "
                         f"(strides {x.stride()})")
    rows, width = x.shape
    d = width // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows and d:
        with on_device(x):
            _silu_and_mul_kernel[(rows, triton.cdiv(d, BLOCK))](x, out, x.stride(0), out.stride(0), d, BLOCK=BLOCK)
    return out
