"""skinny_linear: y = x @ W^T + b for the few rows of a decode step, streaming W once.

Layout: x [M, K] with M <= MAX_ROWS and a unit last stride; weight [N, K] contiguous (nn.Linear's); bias [N] or
None; y [M, N] contiguous in x's dtype.

Contract: float32 accumulation and one rounding to the dtype at the end, bias added in float32 before it. With one
slice of K the kernel writes y; with split-K the slices' partial sums land in a float32 buffer [splits, M, N] and a
second kernel adds them in slice order, so a call gives the same bits every time (no atomics). The launch depends on
shapes only (launch_config), and there are no host syncs: graph-safe.

Why: at decode's batch sizes a projection is a matrix-vector product bound by reading W. cuBLAS read the 8B's
33-50 MB projections at 0.64 of the HBM rate in a batch-1 step on the H200 (docs/results.md); tensor parallelism
halves them again. One program per (BLOCK_N outputs, K slice), with enough programs to keep every SM's loads in
flight; x's rows are padded to 16 for tl.dot (the tensor cores have slack in a memory-bound kernel).
"""
import torch
import triton
import triton.language as tl

from ._common import dot, ieee_dot, interpreted, on_device, sm_count

MAX_ROWS = 16
PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 4  # a split streams at least this many K tiles: its fixed cost is one partial write


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_split,
                   k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FINAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """FINAL (one slice): y itself, bias added and rounded; else this slice's float32 partial sums."""
    col_block, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + ks
        inside = k < end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & inside[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=(cols[:, None] < N) & inside[None, :], other=0.0)
        acc += dot(x, tl.trans(w), IEEE, UPCAST)
    where = (rows[:, None] < M) & (cols[None, :] < N)
    if FINAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=where)
    else:
        tl.store(out_ptr + split * stride_split + rows[:, None] * stride_om + cols[None, :], acc, mask=where)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, N, splits, stride_split, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):  # in slice order: the same bits every call
        total += tl.load(part_ptr + s * stride_split + row * stride_pm + cols, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, total.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=inside)


def launch_config(rows: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages) from shapes only: about PROGRAMS_PER_SM programs per SM,
    split along K where the output columns alone give too few."""
    if interpreted(device):
        block_n, block_k, warps, stages = 16, 32, 4, 1  # small tiles: the tests cross tiles and splits
    else:
        block_n, block_k, warps, stages = 32, 256, 4, 4
    column_blocks = triton.cdiv(n, block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), column_blocks)
    splits = max(1, min(wanted, k // (MIN_TILES_PER_SPLIT * block_k)))
    return block_n, block_k, splits, warps, stages


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """-> x @ weight.T (+ bias), [M, N]. `config` overrides launch_config (the sweep's and the tests' hook)."""
    _check(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    block_n, block_k, splits, warps, stages = config or launch_config(rows, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # whole tiles per slice: the last may be shorter, none is empty
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    flags = dict(BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                 IEEE=ieee_dot(x.dtype), UPCAST=interpreted(x.device) and x.dtype != torch.float32,
                 num_warps=warps, num_stages=stages)
    with on_device(x):
        if splits == 1:
            _skinny_kernel[(triton.cdiv(n, block_n), 1)](
                x, weight, bias_arg, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), 0, k_per_split,
                FINAL=True, **flags)
            return out
        part = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
        _skinny_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, bias_arg, part, rows, n, k, x.stride(0), weight.stride(0), part.stride(1), part.stride(0),
            k_per_split, FINAL=False, **flags)
        block = 1024
        _sum_splits_kernel[(rows, triton.cdiv(n, block))](
            part, bias_arg, out, n, splits, part.stride(0), part.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block)
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or not 0 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_linear needs x [M <= {MAX_ROWS}, K] with a unit last stride, got "
                         f"{tuple(x.shape)} (strides {x.stride()})")
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear needs a contiguous weight [N, {x.shape[1]}] in {x.dtype}, got "
                         f"{tuple(weight.shape)} in {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"skinny_linear needs bias [{weight.shape[0]}] contiguous, got {tuple(bias.shape)}")
