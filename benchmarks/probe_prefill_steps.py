"""Where a run's prefill seconds go, per engine step: the work before the prefill (host step read-back,
promotions), the read of the device step in flight, and the prefill's own run, for each placement given.

    python -m benchmarks.probe_prefill_steps --model qwen3-0.6b --num-seqs 64 --prompt-len 2048 --output-len 256 \
        --num-gpu-blocks 576 --placements gpu,auto,auto
"""
import argparse
import json
import time

from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import measure, random_prompts
from offload_engine.engine.llm_engine import LLMEngine
from offload_engine.engine.sequence import BlockLocation


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-gpu-blocks", type=int, default=576)
    parser.add_argument("--placements", default="gpu,auto")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    steps: list[dict] = []
    prefill_step, resolve = LLMEngine._prefill_step, LLMEngine._resolve_device_step

    def timed_prefill_step(engine, batch, finished, start):
        entry = time.perf_counter()
        row = {"pre_s": entry - start, "tokens": sum(s.num_scheduled_tokens for s in batch),
               "host_tokens": sum(s.num_scheduled_tokens for s in batch if s.location == BlockLocation.CPU),
               "rows": len(batch), "host_in_flight": engine.in_flight is not None, "resolve_s": 0.0}
        steps.append(row)
        result = prefill_step(engine, batch, finished, start)
        row["total_s"] = time.perf_counter() - start
        row["run_s"] = row["total_s"] - row["pre_s"] - row["resolve_s"]
        return result

    def timed_resolve(engine):
        began = time.perf_counter()
        result = resolve(engine)
        if steps and "total_s" not in steps[-1]:
            steps[-1]["resolve_s"] += time.perf_counter() - began
        return result

    LLMEngine._prefill_step, LLMEngine._resolve_device_step = timed_prefill_step, timed_resolve
    found = []
    directory = model_dir(args.model, args.model_cache)
    for placement in args.placements.split(","):
        steps.clear()
        prompts = random_prompts([args.prompt_len] * args.num_seqs, 10000, seed=1)
        result = measure(directory, prompts, [args.output_len] * args.num_seqs, kv_placement=placement,
                         num_gpu_blocks=args.num_gpu_blocks)
        measured = [s for s in steps if "total_s" in s]  # the warm-up's steps too
        summary = {k: round(sum(s[k] for s in measured), 4) for k in ("pre_s", "resolve_s", "run_s", "total_s")}
        host = [s for s in measured if s["host_tokens"]]
        print(f"== {placement}: {result['output_tok_per_s']:.0f} tok/s, prefill {result['prefill_seconds']:.3f} s, "
              f"{len(measured)} prefill steps (warm-up included) {summary}; checks "
              f"{result['lane_stats'].get('checks')}")
        for s in sorted(measured, key=lambda s: -s["total_s"])[:12]:
            print("   ", {k: (round(v * 1e3, 1) if k.endswith("_s") else v) for k, v in s.items()})
        print(f"   host-tier prefill steps: {len(host)}, total {sum(s['total_s'] for s in host):.3f} s")
        found.append({"placement": placement, "result": result, "steps": list(measured)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": found}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
