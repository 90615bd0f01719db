"""The engine with each device attention backend, side by side in one process: does `auto` keep the faster one?

    python -m benchmarks.bench_backends [--cases b-0.6b-gpu,...] [--backends triton,flash-attn,auto] [--out FILE]

Each case (prefill-heavy engine runs: the suite's b shapes and long prompts) runs once per backend, one after the
other on this GPU, through `engine_run.measure` (a warm-up first, so compiles fall outside the clock). Per case the
JSON gives every backend's output and total tok/s, prefill seconds and median decode step, and `auto_over_best`:
auto's total tok/s over the faster of the others (medians over --rounds, with each backend's spread). Needs CUDA; flash-attn 4 must be installed for "flash-attn".
"""
import argparse
import json
import os
import statistics
import time

from benchmarks.bench_long_context import commit
from benchmarks.bench_throughput import _host_pool_gb, _kv_bytes_per_token, device_slug, model_dir
from benchmarks.engine_run import measure, random_prompts

BLOCK = 16
# name: (model, sequences, prompt tokens, output tokens, placement, device budget as a share of the batch's blocks)
CASES = {
    "b-0.6b-gpu": ("qwen3-0.6b", 64, 2048, 256, "gpu", 1.0),
    "b-0.6b-auto-quarter": ("qwen3-0.6b", 64, 2048, 256, "auto", 1 / 4),
    "long-prompts-0.6b-gpu": ("qwen3-0.6b", 4, 32768, 16, "gpu", 1.0),
    "b-8b-gpu": ("qwen3-8b", 32, 4096, 128, "gpu", 1.0),
    "b-8b-auto-quarter": ("qwen3-8b", 32, 4096, 128, "auto", 1 / 4),
    "tiny-auto-half": ("tiny", 4, 64, 8, "auto", 1 / 2),  # the embedded model, for a check anywhere
}
KEEP = ("output_tok_per_s", "total_tok_per_s", "seconds", "prefill_seconds", "decode_step_ms_median",
        "startup_seconds", "kv_location", "demotions", "preemptions")


def run_case(name: str, backend: str, cache: str) -> dict:
    model, seqs, prompt_len, output_len, placement, share = CASES[name]
    path = model_dir(model, cache)
    seq_len = prompt_len + output_len
    blocks = seqs * -(-seq_len // BLOCK)
    kwargs = dict(kv_placement=placement, num_gpu_blocks=max(1, int(blocks * share)), max_model_len=seq_len,
                  max_num_seqs=seqs, block_size=BLOCK, attention_backend=backend)
    if placement != "gpu":
        kwargs["cpu_kv_cache_gb"] = _host_pool_gb(seqs * seq_len * _kv_bytes_per_token(path) / 2**30)
    try:
        result = measure(path, random_prompts([prompt_len] * seqs, 400 if model == "tiny" else 10000, seed=1), [output_len] * seqs, **kwargs)
    except Exception as error:  # noqa: BLE001 - a backend that cannot run a case is a result
        return {"case": name, "backend": backend, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"case": name, "backend": backend, **{k: result[k] for k in KEEP}}


def ratios(runs: list[dict]) -> dict:
    """Per case, on each backend's median total tok/s over the rounds: each backend's over triton's, auto's over
    the faster of the others, and each backend's spread ((max - min) / median) where it ran more than once."""
    out = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        rates = {}
        for r in runs:
            if r["case"] == case and "error" not in r:
                rates.setdefault(r["backend"], []).append(r["total_tok_per_s"])
        rate = {b: statistics.median(v) for b, v in rates.items()}
        entry = {f"{b}_over_triton": rate[b] / rate["triton"] for b in rate if "triton" in rate and b != "triton"}
        entry.update({f"{b}_spread": (max(v) - min(v)) / rate[b] for b, v in rates.items() if len(v) > 1})
        others = [v for b, v in rate.items() if b != "auto"]
        if "auto" in rate and others:
            entry["auto_over_best"] = rate["auto"] / max(others)
        out[case] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(c for c in CASES if not c.startswith("tiny")), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--backends", default="triton,flash-attn,auto")
    parser.add_argument("--rounds", type=int, default=1, help="every case and backend this many times, interleaved")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    runs = []
    for case in args.cases.split(","):
        for round_ in range(args.rounds):
            for backend in args.backends.split(","):
                runs.append({**run_case(case, backend, args.model_cache), "round": round_})
            print(json.dumps(runs[-1]), flush=True)
    result = {"device": device_slug(), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
              "cases": {name: CASES[name] for name in args.cases.split(",")}, "runs": runs, "ratios": ratios(runs)}
    print(json.dumps(result["ratios"], indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
