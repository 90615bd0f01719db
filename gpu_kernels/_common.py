"""Host-side helpers shared by the Triton kernels: shape checks, tile sizes, the SM count.

Everything here looks at shapes, dtypes and devices only, never at tensor values, so every wrapper that
uses it stays launchable inside a CUDA graph.
"""
import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634  # kernels use exp2; scores are pre-scaled by log2(e)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
    """tl.dot needs power-of-two tiles of at least 16 along every axis."""
    return max(16, next_power_of_2(head_dim))


def ieee_dot(dtype: torch.dtype) -> bool:
    """fp32 inputs must not silently drop to tf32 on the GPU; 16-bit inputs take the plain tensor-core dot."""
    return dtype == torch.float32


def interpreted(device: torch.device) -> bool:
    """True when kernels run through Triton's interpreter (CPU tensors, or TRITON_INTERPRET=1)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(t: torch.Tensor):
    """The context to launch a kernel on t's device in: its CUDA device made current (Triton launches on the
    current one), or nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation, exact fp32 products when IEEE. UPCAST (the interpreter, which multiplies
    bfloat16 bit patterns as integers) widens the operands first: bf16/fp16 products are exact in float32, so the
    numbers match the GPU's 16-bit tensor-core dot."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        result = tl.dot(a, b, input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; under the interpreter a small stand-in keeps grids cheap."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate a token-major cache pair and return (block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must share one dtype out of {KV_DTYPES}, got {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous along head_dim (stride 1 in the last dimension)")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return block_size, num_kv_heads, head_dim


def check_queries(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Validate q [rows, Hq, D] against the cache and return the GQA group size Hq // Hkv."""
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [rows, num_q_heads, {head_dim}], got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {k_cache.device}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}")
    return q.shape[1] // num_kv_heads


def check_int_tensor(name: str, t: torch.Tensor, shape: tuple, dtypes=(torch.int32,)) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be {dtypes} of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")


def exp2_scale(scale: float) -> float:
    """Softmax scale folded with log2(e), so the kernels can use exp2 (one instruction) instead of exp."""
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:  # a tensor would sync
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return float(scale) * LOG2E
