"""Whether the layers run the fused Triton kernels (kernels/rms_norm.py, kernels/rotary.py) on CUDA tensors.

On by default. On the CPU the unfused torch path runs (the Triton interpreter would be far slower; CI tests the
kernels themselves). Benchmarks switch it off to measure what fusing pays (bench_engine_step.py --unfused). It is
read while a step runs, so CUDA graphs keep what it was when they were captured: set it before making an LLM.
"""
ENABLED = True


def use_fused(x) -> bool:
    return ENABLED and x.is_cuda
