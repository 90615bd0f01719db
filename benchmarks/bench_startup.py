"""Start-up cost of an engine with a host tier: first-ever start (empty numba cache) and warm start.

    python benchmarks/bench_startup.py --cpu-kv-cache-gb 32      # GPU host: the 0.6B shape, a 32 GiB host pool

Each start runs in a fresh process (numba's in-memory caches, the CUDA context and torch's allocator start
empty, as for a user), timed from before `LLM(...)` to its return; the engine's own breakdown
(`ModelRunner.startup_seconds`: weights, numba compile, pinning, total) comes back beside it. Pinning and
the compile run on their own threads while the weights load, so the phases overlap and do not add up.
Writes benchmarks/results/<device>/startup.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ONE_START = """
import json, sys, time
began = time.perf_counter()
from offload_engine import LLM
imported = time.perf_counter()
llm = LLM(sys.argv[1], kv_placement=sys.argv[2], cpu_kv_cache_gb=float(sys.argv[3]) or None, max_num_seqs=256)
ready = time.perf_counter()
runner = llm.engine.runner
host = runner.host_pool
print(json.dumps({"start_s": ready - imported, "import_s": imported - began,
                  "host_pool_gib": host.nbytes / 2**30 if host else 0, "pinned": bool(host and host.pinned),
                  **{f"{k}_s": v for k, v in runner.startup_seconds.items()}}))
llm.close()
"""


def one_start(model_dir: str, placement: str, host_gb: float, numba_cache: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": numba_cache, "PYTHONPATH": os.getcwd()}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ONE_START, model_dir, placement, str(host_gb)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"start failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - began
    return result


def main() -> None:
    from benchmarks.bench_throughput import RESULTS, device_slug, model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=32.0)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = model_dir(args.model, args.model_cache)
    cache = tempfile.mkdtemp(prefix="numba-cache-")  # empty: the first start compiles, as on a fresh machine
    runs = {"first_start": one_start(path, "auto", args.cpu_kv_cache_gb, cache)}
    print("first start", runs["first_start"])
    runs["warm_start"] = one_start(path, "auto", args.cpu_kv_cache_gb, cache)
    print("warm start ", runs["warm_start"])
    runs["warm_start_again"] = one_start(path, "auto", args.cpu_kv_cache_gb, cache)
    runs["gpu_only"] = one_start(path, "gpu", 0, cache)
    print("gpu only   ", runs["gpu_only"])
    warm = min(runs["warm_start"]["start_s"], runs["warm_start_again"]["start_s"])
    result = {
        "model": args.model, "device": device_slug(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "host_cores": os.cpu_count(), "cpu_kv_cache_gb": args.cpu_kv_cache_gb,
        "host_tier_startup_s": warm, "first_start_s": runs["first_start"]["start_s"],
        "numba_compile_s": runs["first_start"].get("numba_compile_s"), "pin_s": runs["warm_start"].get("pin_s"),
        "gpu_only_startup_s": runs["gpu_only"]["start_s"], "runs": runs,
    }
    out = args.out or os.path.join(RESULTS, result["device"], "startup.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nhost tier ({args.cpu_kv_cache_gb:g} GiB pool), warm numba cache: {warm:.1f} s to ready "
          f"(pinning {result['pin_s']:.1f} s, overlapped); first-ever start {result['first_start_s']:.1f} s "
          f"(numba compile {result['numba_compile_s']:.1f} s); gpu only {result['gpu_only_startup_s']:.1f} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
