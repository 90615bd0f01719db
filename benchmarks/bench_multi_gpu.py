"""Two GPUs against one (issue 13): prefill/decode separation and tensor parallelism, measured side by side.

    python -m benchmarks.bench_multi_gpu --entries greedy pd tp --out-dir benchmarks/results/nvidia-h200-x2

- `pd`: the offload suite's workload b (benchmarks/workloads.py, the full profile's prompt-heavy specs, 0.6B and
  8B shapes) on one GPU and with `prefill_device`, in "gpu" and "auto" at the same device budget per decode GPU.
  Ratio: PD tok/s over one GPU's.
- `tp`: the 8B shape, decode-heavy (64 x (1024 + 1024)), tensor_parallel_size=2 against 1: "gpu" at a budget both
  hold, "gpu" and "auto" at the suite's 24 GiB-card budget (3,296 blocks, beyond what it holds of the batch), and N
  24 GiB cards against one (entry_tp).
- `greedy`: the tiny models of the test suite in float32, greedy tokens of PD and of TP=2 against the single-GPU
  engine's (and against each other), so the measured modes are known to compute the same thing.

Each entry is merged into `multi_gpu.json` in the output folder, so entries can run in separate device calls.
Set NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (done here, before any CUDA
work, and inherited by the ranks the engine spawns): the lent hosts must keep NVLink multicast off.
"""
import argparse
import json
import os
import tempfile

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_name] = "0" if _name == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402

from benchmarks.bench_throughput import model_dir  # noqa: E402
from benchmarks.engine_run import measure, random_prompts  # noqa: E402
from benchmarks.workloads import PROFILES, QWEN3_8B_ON_24_GIB, blocks_beside_weights  # noqa: E402

BLOCK_SIZE = 16


def _budget_runs(path: str, spec, budget: int, modes: dict[str, dict], runs: list, keep,
                 placements=("gpu", "auto")) -> list[dict]:
    """Every placement x mode at one device budget, appended to `runs`, which `keep` gets after each run (a call
    that runs out of time keeps the runs so far); each run is one LLM made and closed."""
    prompts = random_prompts([spec.prompt_len] * spec.num_seqs, 10000, seed=1)
    seq_len = spec.prompt_len + spec.output_len
    for placement in placements:
        for mode, extra in modes.items():
            kwargs = dict(max_model_len=seq_len, max_num_seqs=spec.num_seqs, block_size=BLOCK_SIZE,
                          kv_placement=placement, num_gpu_blocks=budget, **extra)
            if placement == "auto":
                kwargs["cpu_kv_cache_gb"] = round(1.1 * spec.num_seqs * seq_len * _kv_bytes(path) / 2**30 + 0.5, 1)
            print(f"  {spec.model} {spec.num_seqs} x ({spec.prompt_len}+{spec.output_len}) {placement} {mode} "
                  f"@{budget} blocks", flush=True)
            result = measure_apart(path, prompts, [spec.output_len] * spec.num_seqs, **kwargs)
            print(f"    {result.get('output_tok_per_s', 0):.0f} output tok/s {result.get('error', '')}", flush=True)
            runs.append({"placement": placement, "mode": mode, "budget_blocks": budget, **result})
            keep(runs)
    return runs


def measure_apart(path: str, prompts: list, output_lens: list, **kwargs) -> dict:
    """engine_run.measure in a process of its own ({"error": ...} where it failed), so that every run starts as a
    user's would: symmetric memory serves only a process's first tensor-parallel engine (parallel_state), and no run
    inherits another's allocator or compiled state. The result names the run's all-reduce ("all_reduce")."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_measure_child, args=(send, path, prompts, output_lens, kwargs))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = None
    process.join()
    return result or {"error": f"the run's process ended with code {process.exitcode} and no result"}


def _measure_child(send, path: str, prompts: list, output_lens: list, kwargs: dict) -> None:
    from offload_engine.distributed import parallel_state

    try:
        result = measure(path, prompts, output_lens, **kwargs,
                         inspect=lambda llm: {"all_reduce": parallel_state.small_all_reduce_path("device")})
    except (ValueError, RuntimeError, torch.OutOfMemoryError) as error:
        result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    send.send(result)


def _ratios(runs: list[dict], mode: str, baseline: str) -> dict:
    rate = {(r["placement"], r["mode"], r["budget_blocks"]): r.get("output_tok_per_s") for r in runs}
    return {f"{placement}:{mode}/{baseline}@{budget}": value / rate[(placement, baseline, budget)]
            for (placement, m, budget), value in rate.items()
            if m == mode and value and rate.get((placement, baseline, budget))}


def _kv_bytes(path: str) -> int:
    from offload_engine.config import ModelConfig

    config = ModelConfig.from_model_dir(path)
    return config.kv_bytes_per_token(config.dtype)


def entry_pd(cache: str, models: list[str], keep) -> dict:
    """PD against one GPU on workload b: decode on cuda:1 with prefill on cuda:0, against everything on cuda:1."""
    modes = {"one_gpu": dict(device="cuda:1"), "pd": dict(device="cuda:1", prefill_device="cuda:0")}
    runs = []
    for spec in PROFILES["full"].b:
        if spec.name != "b" or spec.model not in models:
            continue
        total = spec.num_seqs * -(-(spec.prompt_len + spec.output_len) // BLOCK_SIZE)
        path = model_dir(spec.model, cache)
        _budget_runs(path, spec, max(1, total // 4), modes, runs, keep)
    return {"runs": runs, "ratios": _ratios(runs, "pd", "one_gpu")}


def entry_tp(cache: str, sizes: list[int], keep) -> dict:
    """TP=N against TP=1 on the 8B shape, decode-heavy: "gpu" at a budget both hold (the whole batch); "gpu" and
    "auto" at a 24 GiB card's 3,296 blocks for both (each rank's pool holds its share of every block); and TP=N on
    N 24 GiB cards, each holding 1/N of the weights and of every block (blocks_beside_weights), against TP=1 on one.
    Where N cards hold the whole batch, that is the first budget's run, not run again."""
    spec = next(s for s in PROFILES["full"].b if s.name == "dh" and s.model == "qwen3-8b")
    path = model_dir(spec.model, cache)
    modes = {"tp1": dict(device="cuda:0"), **{f"tp{n}": dict(device="cuda:0", tensor_parallel_size=n) for n in sizes}}
    total = spec.num_seqs * -(-(spec.prompt_len + spec.output_len) // BLOCK_SIZE)
    runs = _budget_runs(path, spec, total, modes, [], keep, placements=("gpu",))  # the whole batch on the device
    _budget_runs(path, spec, QWEN3_8B_ON_24_GIB, modes, runs, keep, placements=("gpu", "auto"))
    ratios = {key: value for n in sizes for key, value in _ratios(runs, f"tp{n}", "tp1").items()}
    ratios.update({f"auto/gpu:tp{n}@{QWEN3_8B_ON_24_GIB}": _run_ratio(
        runs, ("auto", f"tp{n}", QWEN3_8B_ON_24_GIB), ("gpu", f"tp{n}", QWEN3_8B_ON_24_GIB)) for n in sizes})
    for n in sizes:
        budget = min(total, blocks_beside_weights(spec.model, card_gib=24, tp=n))
        if budget != total:
            _budget_runs(path, spec, budget, {f"tp{n}": modes[f"tp{n}"]}, runs, keep, placements=("gpu",))
        ratios[f"gpu:tp{n}@24GiB-cards/tp1@24GiB-card"] = _run_ratio(
            runs, ("gpu", f"tp{n}", budget), ("gpu", "tp1", QWEN3_8B_ON_24_GIB))
    return {"runs": runs, "ratios": ratios}


def _run_ratio(runs: list[dict], top: tuple, bottom: tuple) -> float | None:
    """Output tok/s of the run keyed (placement, mode, budget) `top` over `bottom`'s; None where either failed."""
    rate = {(r["placement"], r["mode"], r["budget_blocks"]): r.get("output_tok_per_s") for r in runs}
    return rate[top] / rate[bottom] if rate.get(top) and rate.get(bottom) else None


def entry_tp_steps(cache: str, sizes: list[int], batches=(1, 16, 64), context: int = 1024, steps: int = 30,
                   profile_dir: str | None = None) -> dict:
    """A decode step's wall time against its graph's GPU time on every rank (bench_engine_step's ratio), 8B shape,
    "gpu", at TP=1 and each of `sizes`: rank 0's from its own timer, the workers' from their step times
    (offload_engine/distributed/step_times.py): the period between their queued steps, and their replays.
    profile_dir: also rank 0's kernels over 20 decode steps at the smallest and largest batch, per TP size
    (tp{N}_batch{B}_kernels.txt there): where a TP step's time goes beyond 1/N of one GPU's."""
    from benchmarks.bench_engine_step import step_case
    from benchmarks.engine_run import weight_bytes
    from offload_engine import LLM
    from offload_engine.distributed.step_times import ENV
    from offload_engine.engine.graphs.replay_timer import ReplayTimer

    path = model_dir("qwen3-8b", cache)
    max_len = context + 2 * steps + 32
    blocks = max(batches) * -(-max_len // BLOCK_SIZE)  # every case's batch whole on the device: no preemption
    rows = []
    for tp in [1, *sizes]:
        with tempfile.TemporaryDirectory() as folder:
            os.environ[ENV] = folder
            try:
                with LLM(path, kv_placement="gpu", tensor_parallel_size=tp, max_num_seqs=max(batches),
                         max_model_len=max_len, num_gpu_blocks=blocks, block_size=BLOCK_SIZE) as llm:
                    timer = ReplayTimer(llm.engine.runner.decode_graphs["device"])
                    kv_bytes, weights = llm.model_config.kv_bytes_per_token(llm.dtype), weight_bytes(llm)
                    cases = [step_case(llm, timer, b, context, steps, kv_bytes, weights, 1.0, seed=b, modes=(True,))
                             for b in batches]
                    for b in (batches[0], batches[-1]) if profile_dir else ():
                        with open(os.path.join(profile_dir, f"tp{tp}_batch{b}_kernels.txt"), "w") as f:
                            f.write(_decode_kernels(llm, b, context, seed=100 + b))
            finally:
                del os.environ[ENV]
            workers = [json.load(open(os.path.join(folder, f"rank{r}.json")))["steps"] for r in range(1, tp)]
        for case in cases:
            ranks = [{"rank": 0, "wall_ms": case["wall_ms"], "gpu_ms": case["gpu_ms"],
                      "wall_over_gpu": case["wall_over_gpu"]}]
            ranks += [dict(rank=r, **_worker_ratio(w, case["batch"], steps)) for r, w in enumerate(workers, 1)]
            gpus = [r["gpu_ms"] for r in ranks]
            worst = max(r["wall_over_gpu"] for r in ranks)
            rows.append({"tp": tp, "batch": case["batch"], "context": context, "ranks": ranks,
                         "gpu_skew": max(gpus) / min(gpus), "worst_wall_over_gpu": worst})
            print(f"  tp{tp} batch {case['batch']}: " + ", ".join(
                f"rank {r['rank']} {r['wall_ms']:.2f}/{r['gpu_ms']:.2f} ms" for r in ranks), flush=True)
    one = {row["batch"]: row["ranks"][0]["wall_ms"] for row in rows if row["tp"] == 1}
    speedups = {f"tp{row['tp']}/tp1@{row['batch']}": one[row["batch"]] / row["ranks"][0]["wall_ms"]
                for row in rows if row["tp"] > 1}
    return {"rows": rows, "step_speedup": speedups}


def _decode_kernels(llm, batch: int, context: int, seed: int, steps: int = 20) -> str:
    """Rank 0's CUDA kernels over `steps` decode steps of `batch` rows (after three unprofiled ones), as a table."""
    from torch.profiler import ProfilerActivity, profile

    from offload_engine import SamplingParams

    engine = llm.engine
    for prompt in random_prompts([context] * batch, llm.model_config.vocab_size - 1, seed=seed):
        engine.add(engine.make_sequence(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True)))
    while engine.step().is_prefill:
        pass
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort()
    return (f"# {steps} decode steps, {batch} rows of {context} tokens, rank 0\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))


def _worker_ratio(steps: list[dict], batch: int, count: int) -> dict:
    """A worker's last `count` steps of `batch` rows: the median period between its queued steps over its median
    replay, and how long rank 0's call took it from arrival to queued."""
    import statistics

    mine = [s for s in steps if s["rows"] == batch][-count:]
    periods = [b["queued"] - a["queued"] for a, b in zip(mine, mine[1:])]
    gpu = statistics.median(s["gpu_ms"] for s in mine if s["gpu_ms"] is not None)
    wall = statistics.median(periods) * 1e3
    return {"wall_ms": wall, "gpu_ms": gpu, "wall_over_gpu": wall / gpu,
            "busy_ms": statistics.median(s["queued"] - s["received"] for s in mine) * 1e3}


def entry_greedy(sizes=(2,)) -> dict:
    """Greedy tokens of PD and TP=N equal the single-GPU engine's, for each tiny architecture, float32."""
    from offload_engine import LLM, SamplingParams
    from offload_engine.tiny_model import build_tiny_model

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=max(2, *sizes), head_dim=16, vocab_size=256, max_position_embeddings=512)
    prompts = random_prompts([1, 16, 33, 47, 100], 256, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24)
    modes = {"one_gpu": dict(device="cuda:1"), "pd": dict(device="cuda:1", prefill_device="cuda:0"),
             **{f"tp{n}": dict(device="cuda:0", tensor_parallel_size=n) for n in sizes}}
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for seed, arch in enumerate(("qwen3", "llama", "qwen2")):
            path = build_tiny_model(os.path.join(root, arch), arch, seed=seed, with_tokenizer=False, **shape)
            for placement in ("gpu", "auto"):
                pools = dict(num_gpu_blocks=8, num_cpu_blocks=64, cpu_block_size=16) if placement == "auto" else {}
                tokens = {}
                for mode, extra in modes.items():
                    with LLM(path, dtype="float32", kv_placement=placement, **pools, **extra) as llm:
                        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                same = {mode: tokens[mode] == tokens["one_gpu"] for mode in modes if mode != "one_gpu"}
                results[f"{arch}:{placement}"] = same
                print(f"  {arch} {placement}: equal to one GPU {same}", flush=True)
    return {"equal": results, "all_equal": all(all(v.values()) for v in results.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", nargs="+", choices=("greedy", "pd", "tp", "tp_steps"),
                        default=["greedy", "pd", "tp", "tp_steps"])
    parser.add_argument("--tp-sizes", nargs="+", type=int, default=None,
                        help="tensor_parallel_size values besides 1 (default: 2, and 4 where four GPUs are seen)")
    parser.add_argument("--pd-models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--profile", action="store_true",
                        help="tp_steps: also rank 0's kernel tables, per TP size, into the output folder")
    parser.add_argument("--out-dir", default="benchmarks/results/nvidia-h200-x2")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "offload-engine-models"))
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"bench_multi_gpu needs two GPUs; torch sees {torch.cuda.device_count()}")
    sizes = args.tp_sizes or ([2, 4] if torch.cuda.device_count() >= 4 else [2])
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "multi_gpu.json")
    found = json.load(open(out)) if os.path.isfile(out) else {}
    found["device"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    def write(entry: str, value: dict) -> None:
        found[entry] = value
        with open(out, "w") as f:
            json.dump(found, f, indent=1)

    for entry in args.entries:
        print(f"[{entry}]", flush=True)
        keep = lambda runs, entry=entry: write(entry, {"runs": runs, "unfinished": True})  # noqa: E731
        write(entry, {"greedy": lambda: entry_greedy(sizes), "pd": lambda: entry_pd(args.cache, args.pd_models, keep),
                      "tp": lambda: entry_tp(args.cache, sizes, keep),
                      "tp_steps": lambda: entry_tp_steps(args.cache, sizes,
                                                         profile_dir=args.out_dir if args.profile else None)}[entry]())
        print(json.dumps(found[entry].get("ratios", found[entry].get("equal")), indent=1), flush=True)


if __name__ == "__main__":
    main()
