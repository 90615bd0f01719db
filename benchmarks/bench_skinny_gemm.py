"""Decode's projections on the GPU: torch's GEMM against gpu_kernels/skinny_gemm.py, per shape and row count, against the
HBM copy rate measured in the same process.

    python -m benchmarks.bench_skinny_gemm [--out FILE] [--sweep]

Shapes are the 8B's four projections (q/k/v, o, gate/up, down) and its LM head, whole and as one rank of two
holds them. Each case captures one CUDA graph of as many calls as there are distinct weights (enough that they are
8x the L2 cache, so every call reads its weight from HBM, as a step's layers do), replays it, and gives
microseconds per call and the weight's bytes per second over the copy rate. --sweep also tries every tile, split
count, warp and stage setting at 1 and 16 rows on the whole model's shapes; the default launch_config is marked, and
each shape says whether the layers take the kernel for it (skinny_gemm.pays).
"""
import argparse
import itertools
import json
import time

import torch

from benchmarks.bench_gpu_attention import copy_ceiling_gbps
from benchmarks.graph_timing import us_per_call
from gpu_kernels.skinny_gemm import launch_config, pays, skinny_linear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4096, 32, 8, 128, 12288, 151936  # qwen3-8b
SHAPES = {  # name: (N, K); the whole model's first, each written to --out as it ends
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * MLP, HIDDEN), "down": (HIDDEN, MLP), "head": (VOCAB, HIDDEN),
    "qkv/2": ((HEADS + 2 * KV_HEADS) * HEAD_DIM // 2, HIDDEN), "o/2": (HIDDEN, HEADS * HEAD_DIM // 2),
    "gate_up/2": (MLP, HIDDEN), "down/2": (HIDDEN, MLP // 2), "head/2": (VOCAB // 2, HIDDEN),
}
ROWS = (1, 4, 8, 16)
SWEEP = {"block_n": (16, 32, 64), "block_k": (128, 256, 512), "warps": (4, 8), "stages": (3, 4)}
L2_BYTES = 60 << 20


def per_call_us(fn, weights: list, x: torch.Tensor) -> float:
    """Microseconds per call of fn(x, w), from one graph over every weight in turn."""
    return us_per_call([lambda w=w: fn(x, w) for w in weights])


def shape_case(name: str, n: int, k: int, copy_gbps: float, sweep: bool) -> dict:
    device = torch.device("cuda")
    weight_bytes = n * k * 2
    count = max(4, -(-8 * L2_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(count)]
    rows_out = []
    for rows in ROWS:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        exact = (x.double() @ weights[0].double().T)
        torch_us = per_call_us(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
        default = launch_config(rows, n, k, device)
        configs = [default]
        if sweep and rows in (1, 16) and "/" not in name:
            configs += [c for c in itertools.product(*SWEEP.values()) if c != default]
        for config in configs:
            try:
                us = per_call_us(lambda a, w, c=config: skinny_linear(a, w, config=c), weights, x)
                error = (skinny_linear(x, weights[0], config=config).double() - exact).abs().max().item()
            except Exception as failure:  # out of shared memory or registers
                rows_out.append({"rows": rows, "config": config, "error": f"{type(failure).__name__}: "
                                                                        f"{str(failure)[:160]}"})
                continue
            rows_out.append({"rows": rows, "config": config, "default": config == default, "us": us,
                             "torch_us": torch_us, "over_torch": torch_us / us,
                             "of_copy": weight_bytes / (us * 1e-6) / 1e9 / copy_gbps,
                             "torch_of_copy": weight_bytes / (torch_us * 1e-6) / 1e9 / copy_gbps,
                             "max_abs_error": error})
        mine = next(r for r in rows_out if r["rows"] == rows and r.get("default"))
        best = max((r for r in rows_out if r["rows"] == rows and "us" in r), key=lambda r: r["of_copy"])
        print(f"{name:>9} [{n} x {k}] rows {rows:>2}: torch {mine['torch_us']:7.1f} us "
              f"({mine['torch_of_copy']:.2f} of copy), skinny {mine['us']:7.1f} us ({mine['of_copy']:.2f}), "
              f"best {best['config']} {best['us']:.1f} us ({best['of_copy']:.2f})", flush=True)
    del weights
    torch.cuda.empty_cache()
    return {"n": n, "k": k, "weight_bytes": weight_bytes, "weights_in_graph": count, "pays": pays(n, k, device),
            "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    copy_gbps = copy_ceiling_gbps(torch.device("cuda"))
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": copy_gbps,
              "shapes": {}}
    for name, (n, k) in SHAPES.items():  # written after each shape: a run cut short keeps what it measured
        result["shapes"][name] = shape_case(name, n, k, copy_gbps, args.sweep)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
