"""What the prefill graphs cost the device KV pool, and what they buy, per model (GPU host).

Three engines a model, sized from the device's memory (`--gpu-memory-utilization`, 0.3 of an 80 GB card being a
24 GB card's room), one after another in one process (before the memory profile claimed the lanes' cuBLAS
workspaces, the first engine of a process found 0.2-0.5 GiB more free than later ones; now they agree within ~1%):
- "paying": as the engine runs, the graphs' pool sized from the largest bucket that pays;
- "every_bucket": as before 2026-11-25, every bucket captured and the pool sized from the largest, whatever pays
  (the measurement made to answer the largest bucket);
- "eager": prefill_graph_tokens=0.
For each: the device KV blocks, what the memory profile set aside for a prefill's peak (at max_num_batched_tokens,
and at the graphs' largest bucket), the buckets captured, start-up seconds, and the median wall time of a prefill step
of 1 and 2 prompts of --prompt-len tokens.

    python -m benchmarks.probe_prefill_graph_memory --models qwen3-8b,qwen3-0.6b --out F.json
"""
import argparse
import json
import statistics
import time

import torch

from benchmarks.bench_throughput import model_dir
from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner import memory_profile
from offload_engine.engine.graphs.prefill_graphs import PrefillGraphs


def prefill_step_ms(llm: LLM, rows: int, prompt_len: int, repeats: int) -> float:
    engine, vocab = llm.engine, llm.model_config.vocab_size
    generator = torch.Generator().manual_seed(rows)
    times = []
    for _ in range(repeats + 1):  # the first compiles and tunes
        for _ in range(rows):
            prompt = torch.randint(1, vocab - 10, (prompt_len,), generator=generator).tolist()
            engine.add(engine.make_sequence(prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
        torch.cuda.synchronize()
        began = time.perf_counter()
        assert engine.step().is_prefill
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
        engine.abort()
    return statistics.median(times[1:])


def one_engine(path: str, mode: str, args) -> dict:
    kwargs = {"prefill_graph_tokens": 0} if mode == "eager" else {}
    original, peak = PrefillGraphs.largest_paying_bucket, memory_profile.prefill_peak_bytes
    if mode == "every_bucket":
        PrefillGraphs.largest_paying_bucket = lambda self: self.buckets[-1]
    peaks = {}  # what the memory profile set aside: a prefill's peak at these token counts (the graphs' at the last)
    memory_profile.prefill_peak_bytes = lambda runner, tokens: peaks.setdefault(tokens, peak(runner, tokens))
    try:
        began = time.perf_counter()
        llm = LLM(path, kv_placement="gpu", gpu_memory_utilization=args.gpu_memory_utilization, **kwargs)
        start_s = time.perf_counter() - began
    finally:
        PrefillGraphs.largest_paying_bucket, memory_profile.prefill_peak_bytes = original, peak
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    found = {"mode": mode, "num_gpu_blocks": runner.num_gpu_blocks,
             "kv_gib": runner.num_gpu_blocks * runner.block_bytes(runner.cfg.block_size) / 2**30,
             "paying_prefill_tokens": runner.paying_prefill_tokens,
             "profiled_peak_gib": {tokens: b / 2**30 for tokens, b in peaks.items()},
             "captured": sorted(graphs.graphs) if graphs else [], "start_s": start_s,
             "prefill_graphs_start_s": runner.startup_seconds.get("prefill_graphs")}
    for rows in (1, 2):
        found[f"prefill_{rows}x{args.prompt_len}_ms"] = prefill_step_ms(llm, rows, args.prompt_len, args.repeats)
    llm.close()
    print(json.dumps(found), flush=True)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-8b,qwen3-0.6b")
    parser.add_argument("--modes", default="paying,every_bucket,eager")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {"device": torch.cuda.get_device_name(), "gpu_memory_utilization": args.gpu_memory_utilization,
               "models": {}}
    for name in args.models.split(","):
        path = model_dir(name, args.model_cache)
        results["models"][name] = [one_engine(path, mode, args) for mode in args.modes.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
