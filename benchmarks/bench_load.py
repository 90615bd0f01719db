"""Load: thousands of mixed requests through one engine, in rounds, watching for lost requests and memory growth.

    python benchmarks/bench_load.py --profile full    # GPU host: Qwen3-0.6B shape (random weights), 10 x 1,000
    python benchmarks/bench_load.py --profile small   # anywhere: the embedded tiny model, 3 x 100, under a minute

One engine under kv_placement="auto" with a device pool that holds only part of the concurrent batch, so every
round fills both tiers, demotes or preempts, and promotes. Requests mix prompt lengths and max_tokens (both
log-uniform: many short, some long), greedy, seeded, unseeded, top-k and top-p sampling, ignore_eos and stop
tokens. After a warm-up round (not counted) and after every round: host RSS, pinned bytes (the host KV pool,
plus torch's pinned staging on CUDA), device memory, cumulative tokens and the round's tok/s. A leak shows as
growth from the first measured round to the last; a lost request as an output that did not come back complete
(finish_reason set and, with ignore_eos and no stop tokens, exactly max_tokens tokens). Lost must be 0: the
program exits 1 otherwise. JSON (and a PNG of memory and tok/s per round) to benchmarks/results/<device>/.
"""
import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch

from benchmarks.bench_throughput import RESULTS, device_slug, model_dir
from benchmarks.engine_run import random_prompts
from offload_engine import LLM, SamplingParams
from offload_engine.engine.sequence import BlockLocation

GiB = 1 << 30
KINDS = ("greedy", "seeded", "unseeded", "top_k", "top_p")


@dataclass(frozen=True)
class LoadProfile:
    name: str
    model: str  # a config in benchmarks/configs, or "tiny" for the embedded default
    rounds: int
    per_round: int
    warmup: int  # requests in the warm-up round, before memory at "start" is taken
    prompt_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    llm_kwargs: dict = field(default_factory=dict)


# full: 2,000 device blocks of 16 hold 32k tokens (3.5 GiB of the 0.6B shape's KV), about half of what 256
# concurrent requests of mean ~280 tokens need; the 4 GiB host pool holds about as much again. A third of the
# requests start on the host tier, so the run goes at ~2,200 output tok/s, not the device tier's 5-7k: with
# max_tokens 8..256 (mean 71) a round of 1,000 took 32 s on an H100 (2026-11-22), 6.6 minutes in all; 8..128
# (mean 43) keeps 10,000 requests within ~5 minutes.
PROFILES = {
    "full": LoadProfile("full", "qwen3-0.6b", rounds=10, per_round=1000, warmup=200, prompt_range=(16, 1024),
                        max_tokens_range=(8, 128),
                        llm_kwargs=dict(num_gpu_blocks=2000, cpu_kv_cache_gb=4.0, max_num_seqs=256,
                                        max_model_len=1024 + 256)),
    "small": LoadProfile("small", "tiny", rounds=3, per_round=100, warmup=20, prompt_range=(16, 256),
                         max_tokens_range=(4, 32),
                         llm_kwargs=dict(num_gpu_blocks=48, num_cpu_blocks=24, max_num_seqs=32,
                                         max_model_len=256 + 32)),
}


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_requests(profile: LoadProfile, count: int, vocab: int,
                  seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """count requests, each kind of sampling in turn; a different seed per round, so no prompt prefix repeats."""
    rng = random.Random(seed)
    prompts = random_prompts([_log_uniform(rng, *profile.prompt_range) for _ in range(count)], vocab, seed)
    params = []
    for i in range(count):
        sampling = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, seed=rng.randrange(2**31)),
                    "unseeded": dict(temperature=1.0), "top_k": dict(temperature=0.7, top_k=rng.choice((1, 20, 50))),
                    "top_p": dict(temperature=0.9, top_p=rng.choice((0.5, 0.95)))}[KINDS[i % len(KINDS)]]
        stop = tuple(rng.sample(range(vocab), 4)) if rng.random() < 0.1 else None
        params.append(SamplingParams(max_tokens=_log_uniform(rng, *profile.max_tokens_range),
                                     ignore_eos=rng.random() < 0.5, stop_token_ids=stop, **sampling))
    return prompts, params


def is_complete(output, params: SamplingParams) -> bool:
    """Came back finished, with no more than max_tokens; all of them where nothing but the length could end it."""
    if output.finish_reason not in ("stop", "length") or not 1 <= len(output.token_ids) <= params.max_tokens:
        return False
    must_run_out = output.finish_reason == "length" or (params.ignore_eos and not params.stop_token_ids)
    return len(output.token_ids) == params.max_tokens if must_run_out else True


def memory_snapshot(llm: LLM) -> dict:
    """Bytes in use now: garbage collected first, so growth means memory still referenced (or never freed)."""
    gc.collect()
    pool = llm.engine.runner.host_pool
    snap = {"rss": psutil.Process().memory_info().rss, "host_pool": pool.nbytes if pool is not None else 0,
            "host_pool_pinned": pool.nbytes if pool is not None and pool.pinned else 0}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        snap.update(torch_pinned=_torch_pinned_bytes(), cuda_allocated=torch.cuda.memory_allocated(),
                    cuda_reserved=torch.cuda.memory_reserved(), device_used=total - free,
                    reserved_by_stream=_reserved_by_stream())
    snap["pinned"] = snap["host_pool_pinned"] + (snap.get("torch_pinned") or 0)
    return snap


def _reserved_by_stream() -> dict[str, int]:
    """The caching allocator's segments summed per CUDA stream: a freed block is reused only by later
    allocations on its own stream, so growth shows here as the stream that needed a larger block."""
    sizes: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot():
        key = str(segment.get("stream", "?"))
        sizes[key] = sizes.get(key, 0) + segment["total_size"]
    return sizes


def _torch_pinned_bytes() -> int | None:
    """Pinned host memory held by torch's caching host allocator (staging buffers), where torch reports it."""
    try:
        return torch.cuda.host_memory_stats().get("allocated_bytes.current")
    except (AttributeError, RuntimeError):
        return None


def run_round(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return {"requests": len(prompts), "lost": len(prompts) - sum(map(is_complete, outputs, params)),
            "seconds": seconds, "output_tokens": output_tokens, "prompt_tokens": sum(map(len, prompts)),
            "output_tok_per_s": output_tokens / seconds,
            "kv_location": {t: sum(o.kv_location == t for o in outputs) for t in ("gpu", "cpu")},
            "promoted": sum(o.kv_promoted for o in outputs),
            "finish_reason": {r: sum(o.finish_reason == r for o in outputs) for r in ("stop", "length")}}


def run(profile: LoadProfile, cache: str) -> dict:
    path = model_dir(profile.model, cache)
    began = time.perf_counter()
    llm = LLM(path, kv_placement="auto", **profile.llm_kwargs)
    result = {"profile": asdict(profile), "device": device_slug(), "torch": torch.__version__,
              "host_cores": os.cpu_count(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
              "startup_seconds": time.perf_counter() - began, "kv_cache": llm.kv_cache_summary, "rounds": []}
    vocab, scheduler = llm.model_config.vocab_size, llm.engine.scheduler
    print(f"{profile.name}: {profile.model}, {llm.kv_cache_summary}, startup {result['startup_seconds']:.1f} s",
          flush=True)
    result["warmup"] = run_round(llm, *make_requests(profile, profile.warmup, vocab, seed=10**6))
    result["memory_after_warmup"] = memory_snapshot(llm)
    print(_round_line("warm-up", {**result["warmup"], "memory": result["memory_after_warmup"]}), flush=True)
    cumulative = 0
    for i in range(profile.rounds):
        record = run_round(llm, *make_requests(profile, profile.per_round, vocab, seed=i))
        cumulative += record["output_tokens"]
        record.update(cumulative_output_tokens=cumulative, preemptions=scheduler.num_preemptions,
                      promotions=scheduler.num_promotions, demotions=scheduler.num_demotions,
                      memory=memory_snapshot(llm))
        result["rounds"].append(record)
        print(_round_line(f"round {i + 1}", record), flush=True)
    pools = [llm.engine.blocks.pool(tier) for tier in BlockLocation]
    result["idle_after_rounds"] = not llm.engine.has_work() and all(p.num_free == p.num_blocks for p in pools)
    llm.close()
    result["summary"] = summarize(result)
    return result


def summarize(result: dict) -> dict:
    rounds = result["rounds"]
    seconds = sum(r["seconds"] for r in rounds)
    output_tokens = sum(r["output_tokens"] for r in rounds)
    start, middle, end = result["memory_after_warmup"], rounds[(len(rounds) - 1) // 2]["memory"], rounds[-1]["memory"]
    memory = {key: {"start": start[key], "middle": middle[key], "end": end[key],
                    "growth": None if start[key] is None or end[key] is None else end[key] - start[key]}
              for key in start if not isinstance(start[key], dict)}
    return {"requests": sum(r["requests"] for r in rounds), "requests_lost": sum(r["lost"] for r in rounds),
            "seconds": seconds, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / seconds,
            "total_tok_per_s": (output_tokens + sum(r["prompt_tokens"] for r in rounds)) / seconds,
            "preemptions": rounds[-1]["preemptions"], "promotions": rounds[-1]["promotions"],
            "demotions": rounds[-1]["demotions"], "memory": memory}


def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.3f}"


def _round_line(name: str, r: dict) -> str:
    m = r["memory"]
    return (f"{name:>8}: {r['requests']} requests, lost {r['lost']}, {r['output_tokens']} tokens in "
            f"{r['seconds']:.1f} s = {r['output_tok_per_s']:.0f} tok/s (gpu {r['kv_location']['gpu']}, cpu "
            f"{r['kv_location']['cpu']}, promoted {r['promoted']}); GiB: rss {_gib(m['rss'])}, pinned "
            f"{_gib(m['pinned'])}, device allocated {_gib(m.get('cuda_allocated'))}")


def print_table(result: dict) -> None:
    s = result["summary"]
    print(f"\n{'round':>5} {'requests':>8} {'lost':>4} {'out tokens':>10} {'cumulative':>10} {'seconds':>8} "
          f"{'out tok/s':>9} {'gpu/cpu':>9} {'preempt':>7} {'promote':>7} {'rss GiB':>8} {'pin GiB':>8} "
          f"{'dev GiB':>8}")
    for i, r in enumerate(result["rounds"], 1):
        tiers = f"{r['kv_location']['gpu']}/{r['kv_location']['cpu']}"
        print(f"{i:>5} {r['requests']:>8} {r['lost']:>4} {r['output_tokens']:>10} {r['cumulative_output_tokens']:>10} "
              f"{r['seconds']:>8.1f} {r['output_tok_per_s']:>9.0f} {tiers:>9} {r['preemptions']:>7} "
              f"{r['promotions']:>7} {_gib(r['memory']['rss']):>8} {_gib(r['memory']['pinned']):>8} "
              f"{_gib(r['memory'].get('cuda_allocated')):>8}")
    print(f"\n{'memory (GiB)':<18} {'start':>9} {'middle':>9} {'end':>9} {'growth':>9}")
    for key, m in s["memory"].items():
        print(f"{key:<18} {_gib(m['start']):>9} {_gib(m['middle']):>9} {_gib(m['end']):>9} {_gib(m['growth']):>9}")
    if "reserved_by_stream" in result["memory_after_warmup"]:
        print("device reserved per stream (GiB), after warm-up and each round:")
        sizes = [result["memory_after_warmup"]] + [r["memory"] for r in result["rounds"]]
        for stream in sorted({key for m in sizes for key in m["reserved_by_stream"]}):
            print(f"  stream {stream}: " + " ".join(_gib(m["reserved_by_stream"].get(stream, 0)) for m in sizes))
    print(f"\n{s['requests']} requests in {s['seconds']:.1f} s: {s['output_tok_per_s']:.0f} output tok/s "
          f"({s['total_tok_per_s']:.0f} with prompts), {s['preemptions']} preemptions, {s['promotions']} "
          f"promotions, requests lost: {s['requests_lost']}, engine idle and pools free: {result['idle_after_rounds']}")


def plot(result: dict, path: str) -> None:
    """Memory (GiB) and output tok/s against the round: a leak is a line that keeps climbing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = result["rounds"]
    x = list(range(1, len(rounds) + 1))
    fig, (mem, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for key in rounds[0]["memory"]:
        values = [r["memory"][key] for r in rounds]
        if all(isinstance(v, (int, float)) for v in values) and any(values):  # not the per-stream dicts
            mem.plot(x, [v / GiB for v in values], marker="o", label=key)
    mem.set(xlabel="round", ylabel="GiB", title="memory after each round")
    mem.legend(fontsize=8)
    rate.plot(x, [r["output_tok_per_s"] for r in rounds], marker="o")
    rate.set(xlabel="round", ylabel="output tok/s", title=f"{result['profile']['model']} on {result['device']}")
    rate.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="small", choices=sorted(PROFILES))
    parser.add_argument("--rounds", type=int, default=None, help="override the profile's number of rounds")
    parser.add_argument("--per-round", type=int, default=None, help="override the profile's requests per round")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>/load.json; "
                                                    "load_small.json for the small profile); the PNG goes beside it")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    overrides = {k: v for k, v in (("rounds", args.rounds), ("per_round", args.per_round)) if v is not None}
    profile = LoadProfile(**{**asdict(profile), **overrides})
    result = run(profile, args.model_cache)
    print_table(result)
    name = "load.json" if profile.name == "full" else f"load_{profile.name}.json"
    out = args.out or os.path.join(RESULTS, result["device"], name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(out)[0] + ".png")
    print(f"wrote {out}")
    if result["summary"]["requests_lost"] or not result["idle_after_rounds"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
