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
from offload_engine.engine.sched.lane_stats import LaneStats


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
    parser.add_argument("--isolated", type=int, default=0, metavar="N",
                        help="instead: N one-prompt prefills on a kv_placement='gpu' engine, then on a 'cpu' one "
                             "(no host lane running), and a torch profile of one more of each")
    args = parser.parse_args(argv)
    if args.isolated:
        isolated(args)
        return

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
                        "device_step_baseline_s": stats._device_prefill.seconds(tokens),
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
                  f"device-tier step {1e3 * (s['device_step_baseline_s'] or 0):6.1f} ms "
                  f"-> extra {s['host_extra_us_per_token']:5.1f} (n={s['host_extra_samples']})")
    device_only = [s for s in samples if not s["host_tokens"]]
    print(f"{len(device_only)} device-only prefill steps; runs:",
          [(round(r["tok_s"]), r["lane_stats"]["checks"]) for r in runs])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "samples": samples, "runs": runs}, f, indent=2)


def isolated(args) -> None:
    """Prefill steps of one prompt alone, device-tier then host-tier: the extra with nothing else running."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    found = {}
    for placement in ("gpu", "cpu"):
        llm = LLM(model_dir(args.model, args.model_cache), kv_placement=placement, num_gpu_blocks=args.num_gpu_blocks,
                  cpu_kv_cache_gb=args.cpu_kv_cache_gb, max_model_len=args.max_model_len)
        seconds = []
        record = LaneStats.prefill_done
        LaneStats.prefill_done = lambda stats, tokens, host_tokens, s: seconds.append(s)
        vocab = min(llm.model_config.vocab_size, 10000)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        for i in range(args.isolated + 2):
            llm.generate(random_prompts([args.prompt_len], vocab, seed=100 + i), one, use_tqdm=False)
        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            llm.generate(random_prompts([args.prompt_len], vocab, seed=99), one, use_tqdm=False)
            if cuda:
                torch.cuda.synchronize()
        LaneStats.prefill_done = record
        llm.close()
        steps = sorted(seconds[2:-1])
        found[placement] = {"ms": [round(1e3 * s, 2) for s in seconds[2:-1]], "median_ms": 1e3 * steps[len(steps) // 2]}
        print(f"== {placement}: one {args.prompt_len}-token prompt's prefill step: median "
              f"{found[placement]['median_ms']:.1f} ms of {found[placement]['ms']}")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        if args.out:
            prof.export_chrome_trace(args.out.replace(".json", f"_{placement}_trace.json"))
    print(f"host-tier extra: {found['cpu']['median_ms'] - found['gpu']['median_ms']:.1f} ms a prompt")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "isolated": found}, f, indent=2)


if __name__ == "__main__":
    main()
