"""Paged decode attention on the host: validation, zero-copy numpy views, the split plan, the output dtype.

Contract (docs/design.md, "Kernel contracts"): head-major caches [num_blocks, Hkv, block_size, D], contiguous (never
copied); q [B, Hq, D] in their dtype (float32, bfloat16 or float16), block_tables [B, max_blocks] padded with -1,
context_lens [B], Hq % Hkv == 0 -> out [B, Hq, D] in q's dtype and lse float32 [B, Hq] (natural log); a row with
context 0 gives out 0 and lse -inf. All torch CPU tensors. The output is rounded to q's dtype in numpy, never in
torch (docs/decisions/host-kernel.md, "Output rounded in numpy"): float16 by numpy's cast, bfloat16 by
round-to-nearest-even on the bits.
"""
import numba
import numpy as np
import torch

from cpu_attention.decode_kernel import ERRORS, decode_kernel, plan_split_offsets, plan_work

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view in the element type the kernels expect: float32 as is, bfloat16 bits as uint16,
    float16 bits as int16 (the element type tells the kernel how to widen)."""
    if t.dtype == torch.float32:
        return t.numpy()
    bits = t.view(torch.int16).numpy()
    return bits.view(np.uint16) if t.dtype == torch.bfloat16 else bits


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float):
    """One query token per sequence against its paged context -> (out [B, Hq, D] in q's dtype, lse [B, Hq])."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    out = np.empty((batch, num_q_heads, head_dim), np.float32)
    lse = np.empty((batch, num_q_heads), np.float32)
    error = decode_kernel(kernel_view(q.contiguous()), kernel_view(k_cache), kernel_view(v_cache),
                          _int32(block_tables), _int32(context_lens), scale, 0, numba.get_num_threads(), out, lse)
    if error:
        raise ValueError(f"paged_decode_attention: {ERRORS[error]}")
    return torch.from_numpy(narrowed(out, q.dtype)).view(q.dtype), torch.from_numpy(lse)


def narrowed(out: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 `out` rounded to nearest-even in `dtype`, as numpy's element type the torch dtype shares bits with."""
    if dtype == torch.float32:
        return out
    if dtype == torch.float16:
        with np.errstate(over="ignore"):  # beyond float16's range is inf, as torch rounds it
            return out.astype(np.float16)
    bits = out.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(out)
    if nan.any():  # the rounding carry would turn a nan's low mantissa into inf: keep it a (quiet) nan
        rounded[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return rounded.view(np.int16)


def split_plan(context_lens, block_size: int, num_kv_heads: int, num_threads: int | None = None) -> np.ndarray:
    """Splits per sequence that the kernel will use (split-K): each split is one work item per run of kv heads
    (item_heads of them; see decode_kernel.plan_work)."""
    lens = np.ascontiguousarray(np.asarray(context_lens, dtype=np.int32))
    threads = numba.get_num_threads() if num_threads is None else num_threads
    chunk_blocks, _ = plan_work(lens, block_size, num_kv_heads, threads)
    return np.diff(plan_split_offsets(lens, block_size, chunk_blocks))


def _int32(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.int32 or not t.is_contiguous():
        t = t.to(torch.int32).contiguous()
    return t.numpy()


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Shape, dtype and device checks: attribute reads only, this is on every decode step."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
             "context_lens": context_lens}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"paged_decode_attention: {name} must be a torch tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"paged_decode_attention: {name} is on {t.device}; the host kernel needs CPU tensors")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_decode_attention: expected q [B, Hq, D] and equal caches [blocks, Hkv, "
                         f"block_size, D], got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if q.dtype not in CACHE_DTYPES or not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"paged_decode_attention: q and caches must share one dtype of float32, bfloat16, "
                         f"float16; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention: the caches must be contiguous (they are read in place)")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim != k_cache.shape[3] or num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit caches of {num_kv_heads} kv "
                         f"heads x head_dim {k_cache.shape[3]} (Hq must be a multiple of Hkv)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"paged_decode_attention: block_tables must be [{batch}, max_blocks] and context_lens "
                         f"[{batch}], got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged_decode_attention: block_tables and context_lens must be int32 (or int64), got "
                         f"{block_tables.dtype} and {context_lens.dtype}")
