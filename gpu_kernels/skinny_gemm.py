"""skinny_linear: y = x @ W^T + b for the few rows of a decode step, streaming W once.

Layout: x [M, K] with M <= MAX_ROWS and a unit last stride; weight [N, K] contiguous (nn.Linear's); bias [N] or
None; y [M, N] contiguous in x's dtype.

Contract: float32 accumulation over the whole of K in one program, bias added in float32, one rounding to the dtype
at the end: the same bits every call (no split of K, no atomics). The launch depends on shapes only (launch_config),
and there are no host syncs: graph-safe.

Why: at decode's batch sizes a projection is a matrix-vector product bound by reading W. Where the output columns
are fewer than the inputs (an attention output or MLP down projection), cuBLAS splits K and adds the slices in a
second kernel; one program per BLOCK_N columns over all of K reads those weights faster (docs/decisions/
device-kernels.md, "Skinny projections"). x's rows are padded to 16 for tl.dot (the tensor cores have slack in a
memory-bound kernel). `pays` is the shape rule the layers take it by (layers/linear.py).
"""
import torch
import triton
import triton.language as tl

from ._common import dot, ieee_dot, interpreted, on_device, sm_count

MAX_ROWS = 16
WIDE_HEAD = 16  # N >= WIDE_HEAD * K: a vocabulary's LM head, which it also reads faster


def pays(n: int, k: int, device: torch.device) -> bool:
    """Whether the kernel reads an [n, k] weight faster than torch's GEMM at 1 to 16 rows, by the sweep's rule
    (bench_skinny_gemm.py --sweep): where cuBLAS splits K (n <= k) and the columns alone give at least one program
    per two SMs, and on LM heads. Always on the interpreter, whose tests then reach it at any shape."""
    if interpreted(device):
        return True
    block_n = launch_config(1, n, k, device)[0]  # the same at every row count and dtype
    return (n <= k and triton.cdiv(n, block_n) * 2 >= sm_count(device)) or n >= WIDE_HEAD * k


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One program per BLOCK_N output columns, over all of K."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += dot(x, tl.trans(w), IEEE, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    where = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=where)


def launch_config(rows: int, n: int, k: int, device: torch.device, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) from shapes only: the sweep's best over the 8B's projections in
    bf16 at one row, and at 16 (bench_skinny_gemm.py --sweep); BLOCK_K keeps its bytes for wider dtypes, so that the
    stages fit in shared memory."""
    if interpreted(device):
        return 16, 32, 4, 1  # small tiles: the tests cross tiles
    return (32, 1024 // itemsize, 4, 3) if rows == 1 else (32, 512 // itemsize, 4, 4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """-> x @ weight.T (+ bias), [M, N]. `config` overrides launch_config (the sweep's and the tests' hook)."""
    _check(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    block_n, block_k, warps, stages = config or launch_config(rows, n, k, x.device, x.element_size())
    with on_device(x):
        _skinny_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0),
            out.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            IEEE=ieee_dot(x.dtype), UPCAST=interpreted(x.device) and x.dtype != torch.float32,
            num_warps=warps, num_stages=stages)
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
