"""Which kernels a device-lane decode step launches, and how long each kind takes (GPU host).

    PYTHONPATH=. python benchmarks/profile_decode_kernels.py [--batch 16] [--context 2048] [--out FILE]

An engine (0.6B shape, kv_placement="gpu", enforce_eager so that every kernel is its own launch) prefills
`batch` sequences of `context` tokens, then a few decode steps run under torch.profiler. Printed and written: the
kernels per step, and per kernel name its launches per step and GPU time per step, the largest first. The step's
whole-graph time is in bench_engine_step.py; this says what it is made of (issue 12: fuse what the profile names).
"""
import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import random_prompts
from offload_engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="replay the whole-step graphs (async scheduling on) "
                        "instead of eager steps: shows what runs outside the graph, and the step's wall time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(model_dir(args.model, "/tmp/offload_engine_models"), kv_placement="gpu", enforce_eager=not args.graphs,
              max_model_len=args.context + 64, max_num_seqs=args.batch)
    engine = llm.engine
    for prompt in random_prompts([args.context] * args.batch, llm.model_config.vocab_size - 1, seed=3):
        engine.add(engine.make_sequence(prompt, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)))
    while engine.step().is_prefill:
        pass
    engine.step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - began) * 1e6 / args.steps
    per_name = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += 1
            per_name[event.name][1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    rows = sorted(({"kernel": name[:100], "launches_per_step": n / args.steps, "us_per_step": us / args.steps}
                   for name, (n, us) in per_name.items()), key=lambda r: -r["us_per_step"])
    total = {"kernels_per_step": sum(r["launches_per_step"] for r in rows),
             "gpu_us_per_step": sum(r["us_per_step"] for r in rows), "batch": args.batch, "context": args.context,
             "graphs": args.graphs, "wall_us_per_step_profiled": wall_us}
    print(json.dumps(total))
    for row in rows[:30]:
        print(f"{row['us_per_step']:9.1f} us {row['launches_per_step']:6.1f}x  {row['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"total": total, "kernels": rows}, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
