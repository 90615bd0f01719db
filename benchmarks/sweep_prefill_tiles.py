"""The prefill attention kernel's tile configurations, paged and contiguous, against torch's SDPA, on this GPU.

    python -m benchmarks.sweep_prefill_tiles [--out FILE]

Shapes are a long prompt's segment chunks (16,384 queries at the end of their context): workload c's (Hq 16, Hkv 8,
D 128) at 64k and 262k tokens, and the 8B shape's (Hq 32) at 32k. Each configuration (BLOCK_M, BLOCK_N, warps,
stages) runs with the table read (paged) and without it (contiguous: a staging cache's identity table), and gives
TFLOP/s (4 x Hq x D per query-key pair seen). SDPA's causal flash attention on one square chunk is the ceiling.
"""
import argparse
import json
import time

import torch

from benchmarks.profile_prefill import timed
from gpu_kernels.paged_prefill import _tile_config, paged_prefill_attention

SHAPES = {"c_64k": (16, 8, 65536), "c_262k": (16, 8, 262144), "8b_32k": (32, 8, 32768)}
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 4), (128, 64, 4, 3),
           (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 4), (256, 64, 8, 3)]
CHUNK, HEAD_DIM, BLOCK_SIZE = 16384, 128, 16


def sweep_shape(heads: int, kv_heads: int, context: int) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    blocks = context // BLOCK_SIZE
    k = torch.randn(blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, device=dev, dtype=bf16)
    v = torch.randn_like(k)
    q = torch.randn(CHUNK, heads, HEAD_DIM, device=dev, dtype=bf16)
    table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    cu = torch.tensor([0, CHUNK], device=dev, dtype=torch.int32)
    lens = torch.tensor([context], device=dev, dtype=torch.int32)
    pairs = CHUNK * (context - CHUNK) + CHUNK * (CHUNK + 1) / 2
    flop = 4 * heads * HEAD_DIM * pairs
    reference = paged_prefill_attention(q, k, v, table, cu, lens, HEAD_DIM ** -0.5, CHUNK)[0]
    rows = []
    for config in CONFIGS:
        for contiguous in (False, True):
            run = lambda: paged_prefill_attention(q, k, v, table, cu, lens, HEAD_DIM ** -0.5, CHUNK,
                                                  contiguous=contiguous, config=config)
            try:
                seconds = timed(run, repeats=3)
                diff = (run()[0].float() - reference.float()).abs().max().item()
                rows.append({"config": config, "contiguous": contiguous, "tflops": flop / seconds / 1e12,
                             "max_abs_diff": diff})
            except Exception as error:  # a configuration out of shared memory or registers
                rows.append({"config": config, "contiguous": contiguous, "error": f"{type(error).__name__}: "
                                                                                   f"{str(error)[:160]}"})
            print(heads, context, rows[-1], flush=True)
    sq = q[:, :, :].transpose(0, 1)[None]  # [1, Hq, CHUNK, D]
    sk = k.reshape(-1, kv_heads, HEAD_DIM)[:CHUNK].transpose(0, 1)[None].repeat_interleave(heads // kv_heads, 1)
    sdpa_s = timed(lambda: torch.nn.functional.scaled_dot_product_attention(sq, sk, sk, is_causal=True), repeats=3)
    sdpa = 4 * heads * HEAD_DIM * CHUNK * (CHUNK + 1) / 2 / sdpa_s / 1e12
    return {"heads": heads, "kv_heads": kv_heads, "context": context, "chunk": CHUNK, "sdpa_causal_chunk_tflops": sdpa,
            "default_config": _tile_config(q.device, q.dtype, HEAD_DIM), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "shapes": {name: sweep_shape(*shape) for name, shape in SHAPES.items()}}
    for name, shape in result["shapes"].items():
        best = max((r for r in shape["rows"] if "tflops" in r), key=lambda r: r["tflops"])
        print(f"{name}: sdpa {shape['sdpa_causal_chunk_tflops']:.0f} TFLOP/s, best {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
