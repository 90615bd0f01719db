"""Whether the layers run the fused Triton kernels (gpu_kernels/rms_norm.py, rotary.py, silu_and_mul.py,
skinny_gemm.py): by default on CUDA tensors (on the CPU the Triton interpreter would be far slower). Benchmarks switch
them off to measure what fusing pays (bench_engine_step.py --unfused). CUDA graphs keep the value they were captured
with: set it before making an LLM.
"""
ENABLED = True
# Kernels left out one by one ("rms_norm", "norm_rope", "silu_and_mul", "kv_store", "skinny_gemm"): what each pays.
DISABLED: set[str] = set()
# Built and exact but not yet shown to pay on the device: off unless in TRIED (bench_engine_step.py --try-kernels).
UNMEASURED: frozenset[str] = frozenset()
TRIED: set[str] = set()


def use_fused(x, kernel: str) -> bool:
    return ENABLED and kernel not in DISABLED and (kernel not in UNMEASURED or kernel in TRIED) and x.is_cuda


def stores_kv_ahead(meta, x, attn) -> bool:
    """Whether this forward's device-tier K/V store runs in the k rotation's kernel (gpu_kernels.norm_rope with a store)
    instead of in the attention layer: one launch fewer per layer."""
    return (use_fused(x, "norm_rope") and use_fused(x, "kv_store") and not meta.is_prefill and meta.has_gpu_rows
            and attn.k_cache is not None)
