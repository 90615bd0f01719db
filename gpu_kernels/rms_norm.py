"""rms_norm: RMSNorm of each row, with the residual added first where there is one, in one kernel.

Unfused (layers/norm.py) the same computation is nine launches per call (docs/decisions/device-kernels.md,
"Fused norms, rotary and silu").

Contract: x [rows, N] (rows may be strided; the last dimension has stride 1), residual the same shape or None,
weight [N]. With a residual, s = x + residual rounded to x's dtype (as torch adds), and the new residual is s.
out = (s / sqrt(mean(s^2) + eps)) rounded to x's dtype, times weight, in the dtype torch's `*` would give. The
rounding points are the unfused path's, so they differ only by the order of the mean's sum (float32).
One program per row; no host syncs.
"""
import torch
import triton
import triton.language as tl

from ._common import next_power_of_2, on_device


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne")
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * rstd).to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """-> out, or (out, new residual) when a residual is given (layers/norm.RMSNorm's contract)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x [rows, N] with a unit last stride and weight [N], got {tuple(x.shape)} "
                         f"(strides {x.stride()}) and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.result_type(x, weight), device=x.device)
    # Without a residual the kernel neither reads nor writes one (HAS_RESIDUAL): any tensors stand in.
    residual_out = torch.empty_like(x) if residual is not None else out
    source = residual if residual is not None else x
    if rows:
        with on_device(x):
            _rms_norm_kernel[(rows,)](
                x, source, weight, out, residual_out, x.stride(0), source.stride(0), out.stride(0),
                residual_out.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(n))
    return out if residual is None else (out, residual_out)
