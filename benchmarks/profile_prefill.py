"""Where a long prompt's prefill spends its time, against the bounds of its parts, measured in the same process.

    python -m benchmarks.profile_prefill --workload c|batch8b [--placement auto|cpu|gpu] [--out FILE]   (CUDA only)

One prompt of the workload (bench_long_context's specs) is prefilled twice: a warm-up that also times the call
(`prefill_seconds`), then once under torch.profiler on a prompt that shares no prefix with it. The profiler's device
kernels are summed by part:
- dense: matrix products (cuBLAS/cuBLASLt/CUTLASS kernels), against 2 x linear weights x tokens FLOP and a bf16
  product of the model's widest layer measured here (`matmul_tflops`);
- attention: the prefill attention kernels, against 4 x layers x Hq x D x the causal pairs FLOP and torch's SDPA
  on a chunk of the prompt, causal (`sdpa_tflops`);
- host_kv: the host tier's copies (KV written to host blocks, the host prefix staged back), against the host-tier
  tokens' KV bytes x 2 (one write, at most one read back per layer) and a pinned device-to-host copy (`d2h_gbps`);
- other: the rest (norms, rotary, activations, sampling).
Each part's `seconds` is device time, so parts on other streams can add up to more than the wall. `of_wall` is the
parts' seconds over the profiled call's wall time. The result is JSON (stdout, and --out).
"""
import argparse
import json
import os
import time

import torch

from benchmarks.bench_long_context import WORKLOADS, commit
from benchmarks.bench_throughput import _host_pool_gb, device_slug, model_dir
from benchmarks.engine_run import random_prompts

PARTS = {  # the first part whose any pattern is in a kernel's lower-cased name
    "attention": ("prefill_kernel", "attend", "flash", "fmha", "attention", "sdpa"),
    "host_kv": ("write_blocks", "copy_kernel", "memcpy", "scatter", "gather"),
    "dense": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_"),
}


def part_of(name: str) -> str:
    lowered = name.lower()
    return next((part for part, patterns in PARTS.items() if any(p in lowered for p in patterns)), "other")


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats


def ceilings(hidden: int, widest: int, heads: int, head_dim: int, chunk: int) -> dict:
    """This GPU's bf16 product at [chunk, hidden] x [hidden, widest], SDPA causal on one chunk, pinned D2H."""
    dev, bf16 = "cuda", torch.bfloat16
    a, b = torch.randn(chunk, hidden, device=dev, dtype=bf16), torch.randn(hidden, widest, device=dev, dtype=bf16)
    matmul_s = timed(lambda: a @ b)
    q = torch.randn(1, heads, chunk, head_dim, device=dev, dtype=bf16)
    sdpa_s = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    d2h_s = timed(lambda: dst.copy_(src, non_blocking=True), repeats=3)
    causal = chunk * (chunk + 1) / 2
    return {"matmul_tflops": 2 * chunk * hidden * widest / matmul_s / 1e12,
            "sdpa_tflops": 4 * heads * head_dim * causal / sdpa_s / 1e12, "d2h_gbps": (1 << 30) / d2h_s / 1e9,
            "shapes": {"matmul": [chunk, hidden, widest], "sdpa": [heads, chunk, head_dim]}}


def linear_weights(model) -> int:
    """Weights of the layers' matrix products (the embedding and the head, run for one token, left out)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in name and "lm_head" not in name)


def use_baseline_tiles() -> None:
    """The prefill kernel as it ran before its long tile and contiguous staging reads: _tile_config's tiles, every
    table read (before/after in one process; patched before an engine picks its backend)."""
    import gpu_kernels
    from gpu_kernels import paged_prefill

    def baseline(q, k_cache, v_cache, *args, contiguous=False, config=None, **kwargs):
        config = paged_prefill._tile_config(q.device, q.dtype, k_cache.shape[-1])
        return paged_prefill.paged_prefill_attention(q, k_cache, v_cache, *args, config=config, **kwargs)

    gpu_kernels.paged_prefill_attention = baseline


def profile(workload: str, placement: str, cache: str) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from offload_engine import LLM, SamplingParams

    from offload_engine.config import ModelConfig

    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill needs a CUDA GPU: it profiles device kernels")
    spec = WORKLOADS[workload]
    path = model_dir(spec.model, cache)
    config = ModelConfig.from_model_dir(path)
    host_gb = _host_pool_gb(spec.context * config.kv_bytes_per_token(config.dtype) / 2**30)
    llm = LLM(path, max_model_len=spec.context, max_num_seqs=1, block_size=16, num_gpu_blocks=spec.num_gpu_blocks,
              kv_placement=placement, cpu_kv_cache_gb=host_gb)
    try:
        warm, measured = random_prompts([spec.prompt_len] * 2, spec.vocab, seed=11)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        began = time.perf_counter()
        llm.generate([warm], params, use_tqdm=False)
        prefill_seconds = time.perf_counter() - began
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            out = llm.generate([measured], params, use_tqdm=False)[0]
            torch.cuda.synchronize()
            wall = time.perf_counter() - began
        seconds, kernels = {part: 0.0 for part in (*PARTS, "other")}, {}
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            s = event.time_range.elapsed_us() / 1e6
            seconds[part_of(event.name)] += s
            kernels[event.name] = kernels.get(event.name, 0.0) + s
        cfg, model = llm.model_config, llm.engine.runner.model
        layers, heads, head_dim = cfg.num_layers, cfg.num_heads, cfg.head_dim
        n = spec.prompt_len
        host_tokens = n - (out.kv_device_tokens if out.kv_location == "split" else
                           (n if out.kv_location == "gpu" else 0))
        work = {"dense": 2 * linear_weights(model) * n, "attention": 4 * layers * heads * head_dim * n * (n + 1) / 2,
                "host_kv": 2 * host_tokens * cfg.kv_bytes_per_token(llm.dtype)}
        widest = max(cfg.intermediate_size * 2, heads * head_dim + 2 * cfg.num_kv_heads * head_dim)
        ceiling = ceilings(cfg.hidden_size, widest, heads, head_dim, min(n, llm.config.max_num_batched_tokens))
        limits = {"dense": ceiling["matmul_tflops"] * 1e12, "attention": ceiling["sdpa_tflops"] * 1e12,
                  "host_kv": ceiling["d2h_gbps"] * 1e9}
        parts = {}
        for part, s in seconds.items():
            entry = {"seconds": s, "of_wall": s / wall}
            if part in work and s > 0:
                entry.update(rate=work[part] / s, bound_seconds=work[part] / limits[part],
                             of_bound=(work[part] / limits[part]) / s)
            parts[part] = entry
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
        return {"workload": workload, "model": spec.model, "prompt_len": n, "kv_placement": placement,
                "kv_location": out.kv_location, "host_tokens": host_tokens, "device": device_slug(),
                "date": time.strftime("%Y-%m-%d"), "commit": commit(), "prefill_seconds": prefill_seconds,
                "prefill_tok_per_s": n / prefill_seconds, "profiled_wall_seconds": wall, "work": work,
                "ceilings": ceiling, "parts": parts,
                "top_kernels": [{"name": name[:120], "seconds": s, "part": part_of(name)} for name, s in top],
                "chunk_tokens": llm.config.max_num_batched_tokens,
                "attention_backend": os.environ.get("OFFLOAD_ENGINE_ATTENTION_BACKEND", "auto")}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("c", "batch8b"), default="c")
    parser.add_argument("--placement", default="auto", choices=("auto", "cpu", "gpu"))
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--baseline", action="store_true", help="the prefill kernel's earlier tiles (use_baseline_tiles)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.baseline:
        use_baseline_tiles()
    result = {**profile(args.workload, args.placement, args.model_cache), "baseline_tiles": args.baseline}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
