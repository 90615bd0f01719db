"""A decode step of the engine against its own CUDA graph and the HBM bound, and a mixed workload's throughput
against its bound and transformers' continuous batching, all in one run (GPU host).

    PYTHONPATH=. python benchmarks/bench_engine_step.py [--model qwen3-0.6b] [--out-dir DIR] [--earlier JSON]
    PYTHONPATH=. python benchmarks/bench_engine_step.py --plot RESULT.json [EARLIER.json]   # the PNG only, no GPU

steps: one engine (kv_placement="gpu") takes, for each context length, batches of sequences of that length;
once they are prefilled, `--steps` decode steps are timed. wall_ms is the engine's step as a user's loop sees it
(schedule, inputs, graph, sampling, postprocess), with async scheduling as configured by default (on), and
wall_ms_sync the same steps with it off, in the same run; gpu_ms is the device lane's graph replay alone, between
CUDA events around the replay (the graph holds the whole step on the device: the token gather, the model and the
sampler; the grid samples at temperature 1); hbm_bound_ms is what the step must read (every weight once, and the batch's KV) over
the HBM copy rate measured in this run.
throughput: 256 prompts of lengths uniform in [100, 1024], 512 greedy tokens each (ignore_eos): the engine's
output tok/s, the bound (every decode step at the HBM bound, prefill free: a bound generous to the engine), and
transformers' `generate_batch` (continuous batching, sdpa) on the same prompts. Also nano-vllm's protocol
(workload a of bench_throughput). Results: benchmarks/results/<device>/engine_step.json, and engine_step.png
beside it: per batch, wall / graph and graph / HBM bound, one line per context (an earlier run's lines dashed).
"""
import argparse
import json
import os
import random
import statistics
import time

import torch

from benchmarks.bench_throughput import RESULTS, device_slug, hbm_copy_gbps, model_dir, workload_a
from benchmarks.engine_run import random_prompts, weight_bytes
from benchmarks.workloads import PROFILES
from offload_engine import LLM, SamplingParams
from offload_engine.engine.graphs.replay_timer import ReplayTimer
from offload_engine.layers import fused

BATCHES = (1, 4, 16, 64, 128, 256)
CONTEXTS = (512, 2048, 8192)
MAX_CASE_TOKENS = 600_000  # batch x context of one case; more would not fit the 0.6B shape's pool on an H100


def step_case(llm, timer: ReplayTimer, batch: int, context: int, steps: int, kv_bytes: int, weights: int,
              hbm_gbps: float, seed: int, modes=(True, False)) -> dict:
    engine = llm.engine
    prompts = random_prompts([context] * batch, llm.model_config.vocab_size - 1, seed=seed)
    for prompt in prompts:
        engine.add(engine.make_sequence(prompt, SamplingParams(max_tokens=2 * steps + 16, ignore_eos=True)))
    while engine.step().is_prefill:
        pass
    walls = {}
    for async_scheduling in modes:  # the engine reads the setting every step
        engine.cfg.async_scheduling = async_scheduling
        for _ in range(3):  # the first decode steps after a prefill, and graph buckets' first replays
            engine.step()
        torch.cuda.synchronize()
        timer.take_ms()
        walls[async_scheduling] = []
        for _ in range(steps):
            began = time.perf_counter()
            engine.step()
            walls[async_scheduling].append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        gpu = timer.take_ms() if async_scheduling else gpu
        if async_scheduling and len(gpu) != steps:
            raise RuntimeError(f"batch {batch}: {len(gpu)} of {steps} decode steps replayed the device lane's graph")
    engine.cfg.async_scheduling = True
    engine.abort()  # drops the rest of the case's requests
    read = weights + batch * (context + 4 + steps) * kv_bytes
    wall_ms, gpu_ms, bound_ms = statistics.median(walls[True]), statistics.median(gpu), read / (hbm_gbps * 1e9) * 1e3
    sync_ms = statistics.median(walls[False]) if False in walls else float("nan")
    return {"batch": batch, "context": context, "wall_ms": wall_ms, "gpu_ms": gpu_ms, "wall_over_gpu": wall_ms / gpu_ms,
            "wall_ms_sync": sync_ms, "sync_wall_over_gpu": sync_ms / gpu_ms,
            "hbm_bound_ms": bound_ms, "gpu_over_bound": gpu_ms / bound_ms}


def step_grid(path: str, batches, contexts, steps: int, hbm_gbps: float, modes, label: str) -> tuple[list, int, int]:
    llm = LLM(path, kv_placement="gpu", max_model_len=max(contexts) + 2 * steps + 32, max_num_seqs=max(batches))
    kv_bytes, weights = llm.model_config.kv_bytes_per_token(llm.dtype), weight_bytes(llm)
    timer, rows = ReplayTimer(llm.engine.runner.decode_graphs["device"]), []
    for context in contexts:
        for batch in batches:
            if batch * context > MAX_CASE_TOKENS:
                continue
            row = step_case(llm, timer, batch, context, steps, kv_bytes, weights, hbm_gbps, batch + context, modes)
            rows.append(row)
            print(f"[step{label}] batch {batch:>3} context {context:>5}: wall {row['wall_ms']:.2f} ms, graph "
                  f"{row['gpu_ms']:.2f} ms ({row['wall_over_gpu']:.2f}x; async off {row['sync_wall_over_gpu']:.2f}x), "
                  f"HBM bound {row['hbm_bound_ms']:.2f} ms (graph {row['gpu_over_bound']:.2f}x it)", flush=True)
    timer.restore()
    llm.close()
    del llm
    torch.cuda.empty_cache()
    return rows, kv_bytes, weights


def throughput_bound(prompt_lens: list[int], output_len: int, weights: int, kv_bytes: int, hbm_gbps: float) -> float:
    """Output tok/s if every decode step of the whole batch ran at the HBM bound (prefill free)."""
    seconds = sum(weights + sum(p + s for p in prompt_lens) * kv_bytes for s in range(output_len)) / (hbm_gbps * 1e9)
    return len(prompt_lens) * output_len / seconds


def hf_continuous_batching(path: str, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' generate_batch (continuous batching, paged sdpa) on the same prompts, greedy."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.to("cuda").eval().requires_grad_(False)
        config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        # Not under inference_mode: its generation loop runs on a thread of its own, and updates in place
        # tensors that inference_mode would have made read-only there (every request failed).
        model.generate_batch(inputs=prompts[:4], generation_config=config)  # warm-up
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
        seconds = time.perf_counter() - start
        generated = sum(len(o.generated_tokens) for o in outputs.values())
        if generated < len(prompts) * output_len:
            return {"error": f"generate_batch made {generated} of {len(prompts) * output_len} tokens"}
        return {"seconds": seconds, "output_tokens": generated, "output_tok_per_s": generated / seconds}
    except Exception as error:  # an API this transformers lacks, out of memory: recorded, not skipped silently
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        model = None
        torch.cuda.empty_cache()


def plot(result_path: str, earlier_path: str | None = None, out: str | None = None) -> str:
    """Plots engine_step.json: a step's wall time over its graph's GPU time, and the graph's time over the HBM
    bound, against the batch, one line per context; an earlier run's (same device kind) dashed. Returns the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(result_path, "-")] + ([(earlier_path, "--")] if earlier_path else [])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path, style in runs:
        with open(path) as f:
            result = json.load(f)
        label = f"{result['date']}" + (" (earlier)" if style == "--" else "")
        for context in sorted({row["context"] for row in result["steps"]}):
            rows = sorted((r for r in result["steps"] if r["context"] == context), key=lambda r: r["batch"])
            batches = [r["batch"] for r in rows]
            axes[0].plot(batches, [r["wall_over_gpu"] for r in rows], style, marker="o", label=f"{label}, ctx {context}")
            axes[1].plot(batches, [r["gpu_over_bound"] for r in rows], style, marker="o", label=f"{label}, ctx {context}")
    axes[0].axhline(1.05, color="grey", lw=0.8)
    axes[0].set(xscale="log", xlabel="batch", ylabel="step wall / graph GPU time", title="host overhead per step")
    axes[1].set(xscale="log", yscale="log", xlabel="batch", ylabel="graph time / HBM bound", title="the graph itself")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    out = out or os.path.join(os.path.dirname(result_path), "engine_step.png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def mixed_throughput(path: str, args, weights: int, kv_bytes: int, hbm_gbps: float) -> dict:
    """Output tokens per second of --num-prompts mixed prompts, against the HBM bound, async scheduling on and off;
    transformers' continuous batching beside it unless --skip-hf."""
    rng = random.Random(0)
    prompt_lens = [rng.randint(100, 1024) for _ in range(args.num_prompts)]
    prompts = random_prompts(prompt_lens, 10000, seed=12)
    with LLM(path, kv_placement="gpu", max_model_len=1024 + args.output_len + 16,
             max_num_seqs=args.num_prompts) as llm:
        llm.generate(random_prompts([64, 512], 10000, seed=13), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        rates = {}
        for async_scheduling in (False, True):
            llm.engine.cfg.async_scheduling = async_scheduling
            llm.engine.blocks.reset()  # no prefix hits from the run before
            start = time.perf_counter()
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len,
                                                           ignore_eos=True), use_tqdm=False)
            seconds = time.perf_counter() - start
            rates[async_scheduling] = (sum(len(o.token_ids) for o in outputs) / seconds, seconds)
    (tok_s, seconds), sync_tok_s = rates[True], rates[False][0]
    bound = throughput_bound(prompt_lens, args.output_len, weights, kv_bytes, hbm_gbps)
    throughput = {"num_prompts": args.num_prompts, "prompt_range": [100, 1024], "output_len": args.output_len,
                  "seconds": seconds, "tok_s": tok_s, "bound_tok_s": bound, "of_bound": tok_s / bound,
                  "tok_s_async_off": sync_tok_s}
    print(f"[throughput] {tok_s:,.0f} output tok/s = {tok_s / bound:.2f} of the HBM bound ({bound:,.0f}); "
          f"async scheduling off: {sync_tok_s:,.0f}", flush=True)
    if not args.skip_hf:
        hf = hf_continuous_batching(path, prompts, args.output_len)
        throughput["hf_cb"] = hf
        throughput["hf_cb_tok_s"] = hf.get("output_tok_per_s")
        print(f"[throughput] transformers generate_batch: {hf}", flush=True)
    return throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--unfused", action="store_true", help="also time the steps without the fused kernels")
    parser.add_argument("--unfused-kernels", default="",
                        help="with --unfused: leave out only these fused kernels (comma-separated, layers/fused.py)")
    parser.add_argument("--try-kernels", default="",
                        help="also time the steps with these unmeasured fused kernels on (comma-separated, "
                             "layers/fused.py UNMEASURED, e.g. kv_store)")
    parser.add_argument("--skip-a", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="only the step grid: no mixed-prompt throughput run (nor transformers' beside it)")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--earlier", default=None, help="an earlier engine_step.json to plot dashed beside this run")
    parser.add_argument("--plot", nargs="+", metavar="JSON",
                        help="only plot: RESULT.json [EARLIER.json] to engine_step.png beside RESULT (no GPU needed)")
    args = parser.parse_args()
    if args.plot:
        if len(args.plot) > 2:
            parser.error("--plot takes RESULT.json and at most one EARLIER.json")
        print(f"wrote {plot(*args.plot)}")
        return
    path = model_dir(args.model, args.model_cache)
    hbm_gbps = hbm_copy_gbps()
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    result = {"device": device_slug(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "model": args.model, "hbm_gbps": hbm_gbps, "steps": []}

    result["steps"], kv_bytes, weights = step_grid(path, batches, contexts, args.steps, hbm_gbps, (True, False), "")
    result.update(weight_bytes=weights, kv_bytes_per_token=kv_bytes)
    if args.unfused:  # the same grid without the fused kernels (layers/fused.py), async on: what fusing pays
        left_out = {k for k in args.unfused_kernels.split(",") if k}
        if left_out:
            fused.DISABLED.update(left_out)
        else:
            fused.ENABLED = False
        unfused, _, _ = step_grid(path, batches, contexts, args.steps, hbm_gbps, (True,), " unfused")
        fused.ENABLED, result["unfused_kernels"] = True, sorted(left_out) or "all"
        fused.DISABLED.clear()
        for row, other in zip(result["steps"], unfused):
            row["unfused_gpu_ms"], row["unfused_wall_ms"] = other["gpu_ms"], other["wall_ms"]
    tried = {k for k in args.try_kernels.split(",") if k}
    if tried:  # the same grid with kernels that are off until measured (layers/fused.py): whether each pays
        unknown = tried - fused.UNMEASURED
        if unknown:
            raise ValueError(f"--try-kernels: {sorted(unknown)} are not among {sorted(fused.UNMEASURED)}")
        fused.TRIED.update(tried)
        with_tried, _, _ = step_grid(path, batches, contexts, args.steps, hbm_gbps, (True,), " tried")
        fused.TRIED.clear()
        result["tried_kernels"] = sorted(tried)
        for row, other in zip(result["steps"], with_tried):
            row["tried_gpu_ms"], row["tried_wall_ms"] = other["gpu_ms"], other["wall_ms"]
            print(f"[tried {','.join(sorted(tried))}] batch {row['batch']:>3} context {row['context']:>5}: graph "
                  f"{other['gpu_ms'] / row['gpu_ms']:.3f}x, wall {other['wall_ms'] / row['wall_ms']:.3f}x of without",
                  flush=True)

    if not args.skip_throughput:
        result["throughput"] = mixed_throughput(path, args, weights, kv_bytes, hbm_gbps)
    if not args.skip_a:
        profile = PROFILES["full"]
        result["a"] = workload_a(profile, args.model_cache)
        print(f"[a] nano-vllm's protocol: {result['a']['output_tok_per_s']:,.0f} output tok/s", flush=True)

    out_dir = args.out_dir or os.path.join(RESULTS, result["device"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "engine_step.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out_dir}/engine_step.json and {plot(os.path.join(out_dir, 'engine_step.json'), args.earlier)}")


if __name__ == "__main__":
    main()
