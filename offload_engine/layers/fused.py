"""Whether the layers run the fused Triton kernels (kernels/rms_norm.py, rotary.py, silu_and_mul.py) on CUDA tensors.

On by default. On the CPU the unfused torch path runs (the Triton interpreter would be far slower; CI tests the
kernels themselves). Benchmarks switch it off to measure what fusing pays (bench_engine_step.py --unfused). It is
read while a step runs, so CUDA graphs keep what it was when they were captured: set it before making an LLM.
"""
ENABLED = True
# Kernels left out one by one ("rms_norm", "norm_rope", "silu_and_mul", "kv_store"): what each pays.
DISABLED: set[str] = set()
# Built and exact, but not yet shown on the device to pay: off unless a benchmark tries them (bench_engine_step.py
# --try-kernels). Empty: docs/decisions/device-kernels.md, "The K/V store inside the rotation".
UNMEASURED: frozenset[str] = frozenset()
TRIED: set[str] = set()


def use_fused(x, kernel: str) -> bool:
    return ENABLED and kernel not in DISABLED and (kernel not in UNMEASURED or kernel in TRIED) and x.is_cuda


def stores_kv_ahead(meta, x, attn) -> bool:
    """Whether this forward's device-tier K/V store runs in the k rotation's kernel (kernels.norm_rope with a
    store) instead of in the attention layer: decode steps with device rows, on CUDA with both kernels on, once
    the layer's pool is bound. One launch fewer per layer."""
    return (use_fused(x, "norm_rope") and use_fused(x, "kv_store") and not meta.is_prefill and meta.has_gpu_rows
            and attn.k_cache is not None)
