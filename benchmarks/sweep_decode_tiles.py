"""The paged decode kernel's tiles and split counts on this GPU, graph-timed, against the HBM copy rate.

    python -m benchmarks.sweep_decode_tiles [--out FILE]

Shapes are the 8B's (Hq 32, Hkv 8, D 128, bf16, blocks of 16): one row of 32k and 128k tokens (the device lane of a
long-context batch, where the engine's decode attention read 0.77 of the HBM rate on the H200 host), eight rows of
32k, and 64 rows of 2k. Each (BLOCK_N, warps, stages) runs at each split count, and gives GB/s of K and
V read (the split kernel and its merge together) over the copy rate measured in the same process; the default is
marked.
"""
import argparse
import json
import time

import torch

from benchmarks.bench_gpu_attention import HEAD_DIM, NUM_Q_HEADS, bench_ms, copy_ceiling_gbps, paged_kv
from gpu_kernels.paged_decode import MAX_SPLITS, _tile_config, choose_num_splits, paged_decode_attention

SHAPES = {"1x32k": (1, 32768), "1x128k": (1, 131072), "8x32k": (8, 32768), "64x2k": (64, 2048)}
CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (32, 4, 2), (32, 4, 3), (32, 4, 4), (128, 8, 2), (128, 4, 2),
           (16, 4, 4)]  # (BLOCK_N, warps, stages)
SPLITS = (2, 4, 8, 16, 32, 48, 64)
BLOCK_SIZE = 16


def sweep_shape(batch: int, context: int, copy_gbps: float) -> dict:
    device = torch.device("cuda")
    k_cache, v_cache, tables = paged_kv(context, batch, BLOCK_SIZE, device)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=k_cache.dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale, kv_bytes = HEAD_DIM ** -0.5, 2 * k_cache.element_size() * batch * context * k_cache.shape[2] * HEAD_DIM
    reference = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)[0].float()
    default = _tile_config(q, HEAD_DIM)
    default_splits = choose_num_splits(batch, k_cache.shape[2], tables.shape[1], BLOCK_SIZE, default[0], device)
    rows = []
    for config in CONFIGS:
        for splits in sorted({*SPLITS, default_splits}):
            if splits > MAX_SPLITS:
                continue
            run = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits,
                                                 config=config)
            try:
                ms = bench_ms(run)
                diff = (run()[0].float() - reference).abs().max().item()
                rows.append({"config": config, "splits": splits, "us": 1e3 * ms,
                             "of_copy": kv_bytes / (ms * 1e-3) / 1e9 / copy_gbps, "max_abs_diff": diff,
                             "default": config == default and splits == default_splits})
            except Exception as error:  # out of shared memory or registers
                rows.append({"config": config, "splits": splits, "error": f"{type(error).__name__}: "
                                                                        f"{str(error)[:160]}"})
            print(batch, context, rows[-1], flush=True)
    return {"batch": batch, "context": context, "kv_bytes": kv_bytes, "default_config": default,
            "default_splits": default_splits, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_gbps = copy_ceiling_gbps(torch.device("cuda"))
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": copy_gbps,
              "shapes": {name: sweep_shape(*shape, copy_gbps) for name, shape in SHAPES.items()}}
    for name, shape in result["shapes"].items():
        done = [r for r in shape["rows"] if "us" in r]
        best, default = max(done, key=lambda r: r["of_copy"]), next((r for r in done if r["default"]), None)
        print(f"{name}: default {default and round(default['of_copy'], 3)} of the copy rate, best {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
