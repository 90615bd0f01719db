"""The offload benchmark suite: the engine against its peers beyond VRAM (workloads in workloads.py).

    python benchmarks/bench_throughput.py --profile full      # GPU host: real shapes, random weights
    python benchmarks/bench_throughput.py --profile small     # anywhere, a few minutes (make bench)
    python benchmarks/bench_throughput.py single --model qwen3-0.6b --num-seqs 64 ...   # one engine run
    python benchmarks/bench_throughput.py single ... --spread 0.5   # lengths uniform in L x [0.5, 1.5] (mixed)

Every run writes JSON (config, device, host cores, measured ceilings, per-system throughput, ratios to gpu and
to the ideal, promotions/demotions/preemptions per run) and a PNG of throughput and ratios against the device KV
budget to benchmarks/results/<device>/. On the GPU host the suite runs in parts, one device call each
(run_on_device.sh); `python -m benchmarks.report DIR` merges them.
"""
import argparse
import json
import os
import platform
import random
import re
import time

import torch

from benchmarks.engine_run import measure, random_prompts
from benchmarks.peers import hf_generate
from benchmarks.workloads import PROFILES, BeyondVram, Profile, mixed_lengths
from offload_engine.engine.sched import placement as placement_rules

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def model_dir(name: str, cache: str) -> str:
    if name == "tiny":
        from offload_engine.tiny_model import default_model_dir

        return default_model_dir()
    from benchmarks.random_model import materialize

    return materialize(name, cache)


def device_slug() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def workload_a(profile: Profile, cache: str) -> dict:
    rng = random.Random(0)
    lo, hi = profile.a_range
    prompt_lens = [rng.randint(lo, hi) for _ in range(profile.a_num_seqs)]
    output_lens = [rng.randint(lo, hi) for _ in range(profile.a_num_seqs)]
    path = model_dir(profile.a_model, cache)
    kwargs = {**profile.llm_kwargs, "max_num_seqs": max(profile.a_num_seqs, profile.llm_kwargs.get("max_num_seqs", 0))}
    result = measure(path, random_prompts(prompt_lens, 10000 if profile.name == "full" else 400), output_lens,
                     kv_placement="gpu", **kwargs)
    return {"model": profile.a_model, "num_seqs": profile.a_num_seqs, "range": profile.a_range, **result}


def workload_b(profile: Profile, spec: BeyondVram, cache: str, read_gbps: float, peers: bool = True,
               cpu: bool = True, rounds: int = 1) -> dict:
    """gpu and auto at each of the spec's device budgets (in turns, `rounds` times, each keeping its fastest round:
    a point of a few seconds moves by several percent run to run), cpu once, then transformers' peers."""
    path = model_dir(spec.model, cache)
    vocab = 10000 if profile.name == "full" else 400
    prompts = random_prompts([spec.prompt_len] * spec.num_seqs, vocab, seed=1)
    block_size, seq_len = 16, spec.prompt_len + spec.output_len
    total_blocks = spec.num_seqs * -(-seq_len // block_size)
    kv_bytes_per_token = _kv_bytes_per_token(path)
    kv_gib = spec.num_seqs * seq_len * kv_bytes_per_token / 2**30
    common = {**profile.llm_kwargs, "max_model_len": seq_len, "max_num_seqs": spec.num_seqs, "block_size": block_size}
    if "num_cpu_blocks" not in common:
        common["cpu_kv_cache_gb"] = _host_pool_gb(kv_gib)  # the whole batch fits the host tier
    # "cpu" does not depend on the device budget: it runs once. "gpu" and "auto" run at every budget.
    budgets = spec.budgets(total_blocks)

    def run_one(placement: str, budget: int) -> dict:
        print(f"[{spec.name}] {spec.model}: {placement} at {budget} device blocks "
              f"({budget / total_blocks:.3f} of the batch's KV)")
        kwargs = common if placement != "gpu" else {k: v for k, v in common.items() if "cpu" not in k}
        try:
            result = measure(path, prompts, [spec.output_len] * spec.num_seqs, kv_placement=placement,
                             num_gpu_blocks=budget, **kwargs)
        except (ValueError, RuntimeError, torch.OutOfMemoryError) as error:
            result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(f"    {result.get('output_tok_per_s', 0):.0f} output tok/s, {result.get('promotions', 0)} promoted, "
              f"{result.get('demotions', 0)} demoted, {result.get('preemptions', 0)} preempted "
              f"{result.get('error', '')}")
        if placement == "auto" and "lane_stats" in result:
            print(f"    lanes {result['decoded_by_lane']}, cost check {result['lane_stats']}")
        return {"placement": placement, "budget_blocks": budget, "budget_fraction": budget / total_blocks, **result}

    runs = []
    for budget in budgets:
        tries = {"gpu": [], "auto": []}
        for r in range(rounds):
            for placement in ("gpu", "auto") if r % 2 == 0 else ("auto", "gpu"):
                tries[placement].append(run_one(placement, budget))
        runs += [fastest_of(tries[placement]) for placement in ("gpu", "auto")]
    if spec.cpu and cpu:
        runs.append(run_one("cpu", budgets[-1]))
    found = {}
    for cache_kind in (None, "offloaded") if peers and spec.peers else ():
        label = f"hf_{cache_kind or 'dynamic'}"
        print(f"[d] {spec.model}: transformers generate, {label}")
        found[label] = hf_generate(path, prompts, spec.output_len, cache_kind, spec.peer_batch, profile.peer_seconds)
        print(f"    {found[label].get('output_tok_per_s', 0):.0f} output tok/s {found[label].get('error', '')}")
    ideal = {str(r["budget_blocks"]): ideal_tok_per_s(r["output_tok_per_s"], read_gbps, spec.prompt_len,
                                                      spec.output_len, kv_bytes_per_token)
             for r in runs if r["placement"] == "gpu" and r.get("output_tok_per_s")}
    return {"name": spec.name, "spec": spec.__dict__, "batch_kv_gib": kv_gib, "runs": runs, "peers": found,
            "host_read_gbps": read_gbps, "kv_bytes_per_token": kv_bytes_per_token,
            "host_tier_tok_per_s": ideal_tok_per_s(0.0, read_gbps, spec.prompt_len, spec.output_len,
                                                   kv_bytes_per_token),  # the host term alone
            "ideal_tok_per_s": ideal, "ratios": b_ratios(runs, found, ideal)}


def fastest_of(tries: list[dict]) -> dict:
    """The try with the most output tok/s (a failed one counts none); with several, every try's rate beside it."""
    best = max(tries, key=lambda run: run.get("output_tok_per_s") or 0.0)
    if len(tries) > 1:
        best = {**best, "rounds_output_tok_per_s": [run.get("output_tok_per_s") for run in tries]}
    return best


def ideal_tok_per_s(gpu_tok_per_s: float, host_read_gbps: float, prompt_len: int, output_len: int,
                    kv_bytes_per_token: int) -> float:
    """The ideal `auto` at one device budget: `gpu`'s measured output tok/s at that budget plus the host tier's
    capacity, host read GB/s x 1e9 / (KV bytes per token-step of a host row), where a host row's KV bytes per
    token-step = its mean context (prompt_len + output_len / 2) x kv_bytes_per_token. A host row's decode step
    reads its whole KV once to make one token, so that capacity does not depend on how many rows share it."""
    return gpu_tok_per_s + host_read_gbps * 1e9 / ((prompt_len + output_len / 2) * kv_bytes_per_token)


def _host_pool_gb(kv_gib: float) -> float:
    """A host pool that holds kv_gib of KV, with room for blocks the sequences leave part-filled."""
    return round(1.1 * kv_gib + 0.5, 1)


def _kv_bytes_per_token(path: str) -> int:
    from offload_engine.config import ModelConfig

    config = ModelConfig.from_model_dir(path)
    return config.kv_bytes_per_token(config.dtype)


def b_ratios(runs: list[dict], peers: dict, ideal: dict[str, float]) -> dict:
    """auto over gpu (same budget), cpu, transformers' offloaded cache and the ideal (same budget; keyed by
    str(budget_blocks)), each as "auto/<other>@<budget_blocks>"."""
    rate = {(r["placement"], r["budget_blocks"]): r.get("output_tok_per_s") for r in runs}
    cpu = next((r.get("output_tok_per_s") for r in runs if r["placement"] == "cpu"), None)
    offloaded = peers.get("hf_offloaded", {}).get("output_tok_per_s")
    ratios = {}
    for (placement, budget), auto in rate.items():
        if placement != "auto" or not auto:
            continue
        for name, other in (("gpu", rate.get(("gpu", budget))), ("cpu", cpu), ("hf_offloaded", offloaded),
                            ("ideal", ideal.get(str(budget)))):
            if other:
                ratios[f"auto/{name}@{budget}"] = auto / other
    return ratios


def hbm_copy_gbps(gigabytes: float = 2.0, repeats: int = 5) -> float:
    """Device memory bandwidth of a device-to-device copy (bytes read + written per second), best of repeats."""
    src = torch.empty(int(gigabytes * 1e9) // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gigabytes / best


def one_long_sequence(profile: Profile, path: str, context: int, placement: str,
                      budget_tokens: int | None = None) -> dict:
    """One sequence of `context` tokens (prompt + c_output) on a c_budget_tokens device pool. Under "auto" it is
    split: its first tokens' KV on the device, the rest on the host tier; under "cpu" it is wholly on the host.
    Under "gpu", with budget_tokens = context, it is wholly on the device: the reference for prefill where the
    context fits. The host read ceiling is measured again right before the run (with_bound uses the best)."""
    from benchmarks.bench_cpu_attention import read_ceiling_gbps

    prompt_len = context - profile.c_output
    prompt = random_prompts([prompt_len], 10000 if profile.name == "full" else 400, seed=2)
    kwargs = {**profile.llm_kwargs, "max_model_len": context, "max_num_seqs": 1}
    if "num_cpu_blocks" not in kwargs:
        kwargs["cpu_kv_cache_gb"] = _host_pool_gb(context * _kv_bytes_per_token(path) / 2**30)
    read_gbps = read_ceiling_gbps(profile.ceiling_gb)
    result = measure(path, prompt, [profile.c_output], kv_placement=placement,
                     num_gpu_blocks=-(-(budget_tokens or profile.c_budget_tokens) // 16), **kwargs)
    device_tokens = prompt_len if placement == "gpu" else result["kv_device_tokens"]
    return {"placement": placement, "context": context, **result, "host_read_gbps_before": read_gbps,
            "kv_device_tokens": device_tokens, "kv_host_tokens": prompt_len - device_tokens,
            "decode_tok_per_s": 1e3 / result["decode_step_ms_median"],
            "prefill_tok_per_s": prompt_len / result["prefill_seconds"]}


def with_bound(run: dict, c_output: int, read_gbps: float, hbm_gbps: float) -> dict:
    """The run's decode bound: the slower of its two parts' reads at the mean context, host bytes / host read
    GB/s and device bytes / HBM GB/s (the HBM copy's rate, which counts a read and a write per byte: a bound
    that is generous to the device part)."""
    per_token = run["kv_bytes_per_token"]
    host_tokens = run["kv_host_tokens"] + (c_output // 2 if run["kv_host_tokens"] else 0)
    device_tokens = run["kv_device_tokens"] + (0 if run["kv_host_tokens"] else c_output // 2)
    step_seconds = max(host_tokens * per_token / (read_gbps * 1e9), device_tokens * per_token / (hbm_gbps * 1e9))
    return {**run, "bound_tok_per_s": 1 / step_seconds, "fraction_of_bound": run["decode_tok_per_s"] * step_seconds}


def workload_c(profile: Profile, cache: str, read_gbps: float) -> dict:
    """One long sequence on a c_budget_tokens device pool: at c_context tokens, split across both tiers (the
    workload's result), and at 1.5x the budget, where the split matters most; each also wholly on the host tier,
    and wholly on the device (with the budget it needs), for comparison: prefill's reference. The host read
    ceiling of the bounds is the best of the suite's and one measured right before each run: on the shared GPU
    hosts one measurement read 71 to 129 GB/s (H100 host, 2026-11-23), and a ceiling is what the memory did."""
    path = model_dir(profile.c_model, cache)
    hbm_gbps = hbm_copy_gbps() if torch.cuda.is_available() else None
    x15 = profile.c_budget_tokens * 3 // 2
    cases = [("long", profile.c_context, "auto", None), ("long", profile.c_context, "cpu", None),
             ("long", profile.c_context, "gpu", profile.c_context),
             ("x1.5", x15, "auto", None), ("x1.5", x15, "cpu", None), ("x1.5", x15, "gpu", x15)]
    runs = {f"{name}_{placement}": one_long_sequence(profile, path, context, placement, budget)
            for name, context, placement, budget in cases}
    read_gbps = max([read_gbps] + [run["host_read_gbps_before"] for run in runs.values()])
    hbm_gbps = hbm_gbps or read_gbps  # off CUDA both parts are in host memory
    runs = {key: with_bound(run, profile.c_output, read_gbps, hbm_gbps) for key, run in runs.items()}
    for run in runs.values():
        print(f"[c] {run['context']:,} tokens {run['placement']}: device {run['kv_device_tokens']:,} + host "
              f"{run['kv_host_tokens']:,} tokens, decode {run['decode_tok_per_s']:.2f} tok/s = "
              f"{run['fraction_of_bound']:.2f} of its bound ({run['bound_tok_per_s']:.2f}), prefill "
              f"{run['prefill_tok_per_s']:.0f} tok/s")
    split = runs["long_auto"]
    return {"model": profile.c_model, "context": profile.c_context, "budget_tokens": profile.c_budget_tokens,
            **split, "host_read_gbps": read_gbps, "hbm_gbps": hbm_gbps, "runs": runs,
            "split_over_host_only": {name: runs[f"{name}_auto"]["decode_tok_per_s"]
                                     / runs[f"{name}_cpu"]["decode_tok_per_s"] for name in ("long", "x1.5")},
            "prefill_over_device_only": {f"{name}_{placement}": runs[f"{name}_{placement}"]["prefill_tok_per_s"]
                                         / runs[f"{name}_gpu"]["prefill_tok_per_s"]
                                         for name in ("long", "x1.5") for placement in ("auto", "cpu")}}


def run_suite(profile_name: str, workloads: str, cache: str, out_dir: str | None, b_models: str | None = None,
              peers: bool = True, b_names: str | None = None, cpu: bool = True, rounds: int = 1) -> dict:
    """Runs the chosen workloads. All of them write offload_<profile>.json and its PNG; a part (some workloads,
    or some b specs: by model, by name) writes offload_<profile>_<part>.json, and `report.py` merges the parts.
    peers=False skips transformers' runs in b, cpu=False the "cpu" placement there (the suite's guarantee, auto
    against gpu, needs neither); rounds > 1 runs b's gpu and auto in turns, each keeping its fastest round."""
    from benchmarks.bench_cpu_attention import read_ceiling_gbps
    from benchmarks.report import plot

    profile = PROFILES[profile_name]
    specs = [s for s in profile.b if (b_models is None or s.model in b_models.split(","))
             and (b_names is None or s.name in b_names.split(","))]
    if "b" in workloads and not specs:
        raise ValueError(f"no b workload of profile {profile_name!r} has a model in {b_models!r} and a name in "
                         f"{b_names!r}: pick from {[(s.name, s.model) for s in profile.b]}")
    read_gbps = read_ceiling_gbps(profile.ceiling_gb)
    result = {"profile": profile_name, "device": device_slug(), "host_cores": os.cpu_count(),
              "platform": platform.platform(), "torch": torch.__version__, "host_read_gbps": read_gbps,
              "date": time.strftime("%Y-%m-%d")}
    print(f"host read ceiling {read_gbps:.1f} GB/s")
    if "a" in workloads:
        result["a"] = workload_a(profile, cache)
        print(f"[a] output {result['a']['output_tok_per_s']:.0f} tok/s")
    if "b" in workloads:
        result["b"] = [workload_b(profile, spec, cache, read_gbps, peers, cpu, rounds) for spec in specs]
        for b in result["b"]:
            print(f"[{b['name']}] {b['spec']['model']} ratios: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in b["ratios"].items()))
            print(f"[{b['name']}] {b['spec']['model']} ideal tok/s (gpu + {b['host_tier_tok_per_s']:.0f} host tier): "
                  + ", ".join(f"@{k} {v:.0f}" for k, v in b["ideal_tok_per_s"].items()))
    if "c" in workloads:
        result["c"] = workload_c(profile, cache, read_gbps)
        print(f"[c] split decode {result['c']['decode_tok_per_s']:.2f} tok/s = {result['c']['fraction_of_bound']:.2f} "
              f"of its bound ({result['c']['bound_tok_per_s']:.2f} tok/s); split / host only: "
              + ", ".join(f"{k} {v:.2f}x" for k, v in result["c"]["split_over_host_only"].items()))
    out_dir = out_dir or os.path.join(RESULTS, result["device"])
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.join(out_dir, f"offload_{profile_name}{part_name(profile, workloads, specs)}")
    with open(name + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    if result.get("b"):
        plot(result, name + ".png")
    print(f"wrote {name}.json")
    return result


def part_name(profile: Profile, workloads: str, specs: list[BeyondVram]) -> str:
    """The file-name suffix of a part: none for the whole suite, else "_" and its workloads, each b spec as
    <name>-<model> (offload_full_a-c, offload_full_b-qwen3-8b, offload_full_dh-qwen3-8b)."""
    if set(workloads) >= set("abc") and len(specs) == len(profile.b):
        return ""
    ids = [f"{s.name}-{s.model}" for s in specs] if "b" in workloads else []
    return "_" + "-".join(["a"] * ("a" in workloads) + ids + ["c"] * ("c" in workloads))


def set_placement_constants(assignments: list[str]) -> dict[str, int | float]:
    """Sets engine/sched/placement.py's numeric constants from NAME=VALUE strings, before any work; returns them. A name
    that is not such a constant, or a value of another type, is a ValueError that names what exists."""
    known = {name: value for name, value in vars(placement_rules).items()
             if name.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool)}
    constants = {}
    for assignment in assignments:
        name, equals, text = assignment.partition("=")
        if not equals:
            raise ValueError(f"--set-placement {assignment!r}: give NAME=VALUE, e.g. PROMOTION_HOLD_STEPS=0")
        if name not in known:
            raise ValueError(f"--set-placement {assignment!r}: {name!r} is not one of placement's constants "
                             f"{sorted(known)}")
        try:
            constants[name] = type(known[name])(text)
        except ValueError:
            raise ValueError(f"--set-placement {assignment!r}: {name} takes a {type(known[name]).__name__}, "
                             f"e.g. {name}={known[name]}") from None
    for name, value in constants.items():
        setattr(placement_rules, name, value)
    return constants


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="suite", choices=("suite", "single"))
    parser.add_argument("--profile", default="small", choices=sorted(PROFILES))
    parser.add_argument("--workloads", default="abc", help="any of a, b (with the peers, d) and c")
    parser.add_argument("--b-models", default=None, help="only these b models (comma-separated config names)")
    parser.add_argument("--b-names", default=None, help="only these b variants (comma-separated: b, dh)")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers' generate in b")
    parser.add_argument("--no-cpu", action="store_true", help="skip the cpu placement in b")
    parser.add_argument("--rounds", type=int, default=1,
                        help="b's gpu and auto this many times in turns at each budget, each keeping its fastest")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out-dir", default=None)
    single = parser.add_argument_group("single run")
    single.add_argument("--model", default="qwen3-0.6b")
    single.add_argument("--num-seqs", type=int, default=64)
    single.add_argument("--prompt-len", type=int, default=512)
    single.add_argument("--output-len", type=int, default=128)
    single.add_argument("--spread", type=float, default=0.0,
                        help="lengths uniform in [L(1 - spread), L(1 + spread)] around --prompt-len / --output-len")
    single.add_argument("--kv-placement", default="gpu")
    single.add_argument("--num-gpu-blocks", type=int, default=None)
    single.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    single.add_argument("--max-model-len", type=int, default=None)
    single.add_argument("--max-num-seqs", type=int, default=256)
    single.add_argument("--out", default=None, help="JSON path of a single run")
    single.add_argument("--set-placement", action="append", default=[], metavar="NAME=VALUE",
                        help="run with one of engine/sched/placement.py's constants changed (repeatable), for A/B runs "
                             "in one call, e.g. PROMOTION_HOLD_STEPS=0")
    args = parser.parse_args(argv)
    constants = set_placement_constants(args.set_placement)
    if args.mode == "suite":
        run_suite(args.profile, args.workloads, args.model_cache, args.out_dir, args.b_models, not args.no_peers,
                  args.b_names, not args.no_cpu, args.rounds)
        return
    path = model_dir(args.model, args.model_cache)
    prompt_lens, output_lens = mixed_lengths(args.num_seqs, args.prompt_len, args.output_len, args.spread)
    result = measure(path, random_prompts(prompt_lens, 10000), output_lens, kv_placement=args.kv_placement,
                     num_gpu_blocks=args.num_gpu_blocks, cpu_kv_cache_gb=args.cpu_kv_cache_gb,
                     max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    result.update(model=args.model, num_seqs=args.num_seqs, prompt_len=args.prompt_len, output_len=args.output_len,
                  spread=args.spread, kv_placement=args.kv_placement, device_name=device_slug(),
                  torch=torch.__version__, host_cores=os.cpu_count(), placement_constants=constants)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
