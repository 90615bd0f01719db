"""Where a decode step's time goes: torch.profiler over a few steps of the engine (GPU host)."""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.random_model import materialize
from offload_engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--kv-placement", default="gpu")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--model-dir", default="/tmp/offload_engine_models")
    args = parser.parse_args()
    llm = LLM(materialize(args.model, args.model_dir), kv_placement=args.kv_placement, max_model_len=4096,
              gpu_memory_utilization=0.3, cpu_kv_cache_gb=8 if args.kv_placement != "gpu" else None)
    engine = llm.engine
    prompts = [[i % 1000 + 1] * args.context for i in range(args.num_seqs)]
    for p in prompts:
        engine.add(engine.make_sequence(p, SamplingParams(max_tokens=64, ignore_eos=True)))
    while engine.step().is_prefill:
        pass
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        times = [engine.step().seconds for _ in range(10)]
    print(f"{args.kv_placement}: decode step {1e3 * sorted(times)[5]:.2f} ms (median of 10), batch {args.num_seqs}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    engine.abort()
    llm.close()


if __name__ == "__main__":
    main()
