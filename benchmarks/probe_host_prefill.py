"""Where a host-tier prompt's measured prefill cost comes from: every sample LaneStats.prefill_done takes, in order.

The admission check charges each host-tier prompt LaneStats.host_prefill_seconds_per_token. In runs that refused
thousands of admissions that estimate read 22-55 us a token, where runs of the same workload that admitted
freely read 0-4 (decode-heavy 0.6B at 512 blocks, H100 host, 2026-11-24). This logs, per prefill step: its
tokens, its host-tier tokens, its seconds, the time it waited for earlier host writes, whether a host step was in
flight, and the estimate after it. `--repeats 2` generates the workload twice in one engine, the second time warm.

    python -m benchmarks.probe_host_prefill --model qwen3-0.6b --num-seqs 32 --prompt-len 1024 --output-len 1024 \
        --num-gpu-blocks 512 --out /tmp/probe.json
"""
import argparse
import json
import time

from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import random_prompts
from offload_engine import LLM, SamplingParams
from offload_engine.engine.lane_stats import LaneStats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    llm = LLM(model_dir(args.model, args.model_cache), kv_placement="auto", num_gpu_blocks=args.num_gpu_blocks,
              cpu_kv_cache_gb=args.cpu_kv_cache_gb, max_model_len=args.max_model_len)
    engine = llm.engine
    samples, waited, phase = [], [0.0], ["warm-up"]
    wait_writes = engine.runner.accesses.wait_writes

    def timed_wait_writes():
        began = time.perf_counter()
        wait_writes()
        waited[0] += time.perf_counter() - began

    engine.runner.accesses.wait_writes = timed_wait_writes
    record = LaneStats.prefill_done

    def logged(stats, tokens, host_tokens, seconds):
        record(stats, tokens, host_tokens, seconds)
        samples.append({"phase": phase[0], "t": time.perf_counter(), "tokens": tokens, "host_tokens": host_tokens,
                        "seconds": seconds, "waited_writes_s": waited[0],
                        "host_step_in_flight": engine.in_flight is not None,
                        "device_us_per_token": (stats._device_prefill.value or 0) * 1e6,
                        "host_extra_us_per_token": (stats.host_prefill_seconds_per_token or 0) * 1e6,
                        "host_extra_samples": stats._host_prefill_extra.count})
        waited[0] = 0.0

    LaneStats.prefill_done = logged
    vocab = llm.model_config.vocab_size
    count = llm.config.max_num_batched_tokens // args.prompt_len + 1
    warm = [[vocab - 1] * 64] + [[vocab - 2 - i] * args.prompt_len for i in range(count)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs = []
    for r in range(args.repeats):
        phase[0] = f"run{r}"
        began = time.perf_counter()
        prompts = random_prompts([args.prompt_len] * args.num_seqs, min(vocab, 10000), seed=r)
        params = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        runs.append({"seconds": seconds, "tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
                     "lane_stats": engine.stats.snapshot()})
        if r == 0:
            engine.stats.checks.clear()
    LaneStats.prefill_done = record
    llm.close()
    for s in samples:
        if s["host_tokens"]:
            print(f"{s['phase']:8} tokens {s['tokens']:5} host {s['host_tokens']:5} {1e3 * s['seconds']:7.1f} ms "
                  f"waited {1e3 * s['waited_writes_s']:6.1f} ms in-flight {int(s['host_step_in_flight'])} "
                  f"device {s['device_us_per_token']:5.1f} us/tok -> extra {s['host_extra_us_per_token']:5.1f} "
                  f"(n={s['host_extra_samples']})")
    device_only = [s for s in samples if not s["host_tokens"]]
    print(f"{len(device_only)} device-only prefill steps; runs:",
          [(round(r["tok_s"]), r["lane_stats"]["checks"]) for r in runs])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "samples": samples, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
