"""What the load-time check for NaN and infinity in the weights costs (loader.check_finite), at a real shape.

    PYTHONPATH=. python benchmarks/bench_weight_check.py --model qwen3-8b     # GPU host: random weights, 8B shape

Builds the model from safetensors as the engine does (loader.build_model, which runs the check once), then times
the check alone, `--repeats` times, with the device synchronized around each: the check reads every weight once
where it lives, so its rate is set against the weights' bytes. Writes benchmarks/results/<device>/weight_check.json.
"""
import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.bench_throughput import RESULTS, device_slug, model_dir
from offload_engine.config import ModelConfig
from offload_engine.loader import build_model, check_finite


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = model_dir(args.model, args.model_cache)
    cfg = ModelConfig.from_model_dir(path)
    model = None

    def load():
        nonlocal model
        model = build_model(cfg, path, torch.bfloat16, device, max_position=4096)

    load_s = timed(load, device)
    params = dict(model.named_parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    checks = [timed(lambda: check_finite(params, {}), device) for _ in range(args.repeats)]
    result = {"model": args.model, "device": device_slug(), "date": time.strftime("%Y-%m-%d"),
              "commit": os.environ.get("BENCH_COMMIT"), "weight_bytes": weight_bytes,
              "load_s_with_check": load_s, "check_s": checks, "check_s_median": statistics.median(checks),
              "check_gbps": weight_bytes / statistics.median(checks) / 1e9,
              "check_over_load": statistics.median(checks) / load_s}
    out = args.out or os.path.join(RESULTS, result["device"], "weight_check.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.model}: {weight_bytes / 1e9:.1f} GB of weights loaded in {load_s:.1f} s; the finiteness check "
          f"{result['check_s_median'] * 1e3:.1f} ms ({result['check_gbps']:.0f} GB/s, "
          f"{result['check_over_load']:.4f} of the load)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
