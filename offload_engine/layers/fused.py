"""Whether the layers run the fused Triton kernels (kernels/rms_norm.py, rotary.py, silu_and_mul.py) on CUDA tensors.

On by default. On the CPU the unfused torch path runs (the Triton interpreter would be far slower; CI tests the
kernels themselves). Benchmarks switch it off to measure what fusing pays (bench_engine_step.py --unfused). It is
read while a step runs, so CUDA graphs keep what it was when they were captured: set it before making an LLM.
"""
ENABLED = True
DISABLED: set[str] = set()  # kernels left out one by one ("rms_norm", "norm_rope", "silu_and_mul"): what each pays


def use_fused(x, kernel: str) -> bool:
    return ENABLED and kernel not in DISABLED and x.is_cuda
