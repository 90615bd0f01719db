"""Where a device-tier prefill step's time goes (GPU host): for steps of 1 to 8 rows of one prompt length, the
engine step's wall time split into building the inputs, launching the forward (host time until it returns), and
the sample's read-back (the wait for the GPU), beside the GPU's own time for the forward (CUDA events). Then
torch.profiler over a one-row and a four-row step, by self CPU and by GPU time.

    python -m benchmarks.profile_prefill_step --model qwen3-0.6b --prompt-len 2048 [--out F.json]
"""
import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_throughput import model_dir
from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner import model_runner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--eager-prefill", action="store_true", help="prefill_graph_tokens=0: eager prefill steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    llm = LLM(model_dir(args.model, args.model_cache), kv_placement="gpu", num_gpu_blocks=2048,
              prefill_graph_tokens=0 if args.eager_prefill else 8192)
    engine, runner = llm.engine, llm.engine.runner
    parts: dict[str, float] = {}
    build, forward, sample = runner.inputs.prefill, runner._forward, model_runner.sample

    def timed(name, fn):
        def wrapper(*a, **k):
            began = time.perf_counter()
            out = fn(*a, **k)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - began
            return out
        return wrapper

    def timed_forward(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = timed("forward_launch", forward)(*a, **k)
        end.record()
        parts["events"] = (start, end)
        return out

    runner.inputs.prefill = timed("build_inputs", build)
    runner._forward = timed_forward
    model_runner.sample = lambda *a, **k: _ListTimed(sample(*a, **k), parts)

    vocab = llm.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def one_step(rows: int) -> dict:
        for _ in range(rows):
            prompt = torch.randint(1, vocab - 10, (args.prompt_len,), generator=generator).tolist()
            engine.add(engine.make_sequence(prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
        parts.clear()
        torch.cuda.synchronize()
        began = time.perf_counter()
        stats = engine.step()
        wall = time.perf_counter() - began
        assert stats.is_prefill
        start, end = parts.pop("events")
        torch.cuda.synchronize()
        found = {"rows": rows, "wall_ms": 1e3 * wall, "gpu_forward_ms": start.elapsed_time(end)}
        found.update({f"{k}_ms": 1e3 * v for k, v in parts.items()})
        engine.abort()
        return found

    graphs = runner.prefill_graphs
    if graphs is not None:
        # Measured at capture here (num_gpu_blocks is given); where the memory profile measured, these are empty.
        launch = 1e3 * graphs.launch_seconds if graphs.launch_seconds else float("nan")
        print(f"prefill graphs: buckets {graphs.buckets}, eager launch {launch:.1f} ms, GPU "
              f"(no attention) {({b: round(1e3 * t, 1) for b, t in graphs.gpu_seconds.items()})} ms, pays "
              f"{[b for b, p in graphs.pays.items() if p]}; start-up {runner.startup_seconds.get('prefill_graphs')}")
    for rows in (1, 4):  # compile and tune the shapes first
        one_step(rows)
    results = []
    for rows in map(int, args.rows.split(",")):
        runs = [one_step(rows) for _ in range(args.repeats)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append(median)
        print({k: round(v, 2) for k, v in median.items()}, flush=True)

    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    one_step(1)
    profiler.disable()
    print("== 1 row: Python functions by own time (cProfile)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumtime").print_stats(45)

    profiles = {}
    for rows in (1, 4):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one_step(rows)
        averages = prof.key_averages()
        print(f"== {rows} row(s) of {args.prompt_len}: by self CPU time")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70))
        print(f"== {rows} row(s): by device time")
        print(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))
        profiles[rows] = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                           "self_device_us": getattr(e, "self_device_time_total", 0.0)}
                          for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:40]]
    llm.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "steps": results, "profiles": profiles}, f, indent=2)


class _ListTimed:
    """The sampled ids, whose .tolist() (the step's wait for the GPU) is timed as `read_back`."""

    def __init__(self, ids, parts):
        self.ids, self.parts = ids, parts

    def tolist(self):
        began = time.perf_counter()
        out = self.ids.tolist()
        self.parts["read_back"] = self.parts.get("read_back", 0.0) + time.perf_counter() - began
        return out


if __name__ == "__main__":
    main()
