"""Benchmark the paged attention kernels in the hardware's terms, against ceilings measured in this run: our
Triton kernels and, where it is installed, flash-attn 4 through our backend (layers/flash_attn_backend.py), each on
the same paged caches, beside torch SDPA on contiguous ones.

Decode (memory-bound): KV bytes read / time = achieved HBM GB/s, next to a device-to-device copy ceiling
(bytes read + written / time) and torch SDPA over contiguous KV doing the same work.
Prefill (compute-bound): causal TFLOP/s (4 * L^2 / 2 * Hq * D per sequence) next to torch SDPA (flash, causal).
Shapes: 8 KV heads x D 128, Hq 32, bf16. Every case runs in its own try/except; results go to
benchmarks/results/gpu_attention_<gpu-name-slug>.json.

    python3 benchmarks/bench_gpu_attention.py [--quick] [--out-dir DIR | --out FILE]
"""
import argparse
import json
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.check_gpu_kernels import capture  # noqa: E402
from gpu_kernels import paged_decode_attention, paged_prefill_attention  # noqa: E402

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, DTYPE = 8, 32, 128, torch.bfloat16
DECODE_CASES = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (64, 4096), (64, 32768),
                (256, 1024), (256, 4096), (8, 131072)]
PREFILL_CASES = [(1, 4096), (1, 16384), (8, 2048)]
QUICK_DECODE, QUICK_PREFILL = [(1, 4096), (1, 32768), (64, 4096)], [(1, 4096)]


def bench_ms(fn) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (the engine replays decode from graphs, so host
    launch cost is not the kernel's), falling back to eager launches where capture fails. do_bench warms up
    and flushes L2 between runs, so KV really comes from HBM."""
    return _do_bench(_graphed(fn))


def _graphed(fn):
    try:
        graph, _ = capture(fn)
        return graph.replay
    except Exception:
        torch.cuda.synchronize()
        return fn


def _do_bench(fn) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except TypeError:  # older do_bench without return_mode
        return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0]


def copy_ceiling_gbps(device) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read + written: the HBM bandwidth a kernel can reach."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    best = max(2 * src.numel() / (_do_bench(lambda: dst.copy_(src)) * 1e-3) / 1e9 for _ in range(2))
    del src, dst
    return best


def sdpa_best_ms(q, k, v, is_causal, backends):
    """Fastest of the given SDPA backends that runs this shape, and its label.

    GQA goes through enable_gqa where the backend takes it; otherwise K/V are expanded to Hq heads once
    (noted as "expanded": that backend then reads Hq / Hkv times the KV bytes).
    """
    from torch.nn.attention import sdpa_kernel
    expanded = None
    best = (float("inf"), None)
    for backend in backends:
        for gqa in (True, False):
            try:
                if gqa:
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
                else:
                    if expanded is None:
                        group = q.shape[1] // k.shape[1]
                        expanded = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                    fn = lambda: F.scaled_dot_product_attention(q, *expanded, is_causal=is_causal)
                with sdpa_kernel(backend):
                    fn()
                    ms = bench_ms(fn)
                label = f"{backend.name.lower()}{'' if gqa else ', expanded'}"
                best = min(best, (ms, label), key=lambda t: t[0])
                break
            except Exception:
                continue
    if best[1] is None:
        raise RuntimeError("no SDPA backend ran this shape")
    return best


def sdpa_decode_ms(batch, context, device):
    from torch.nn.attention import SDPBackend
    q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    return sdpa_best_ms(q, k, v, False, backends)


def paged_kv(num_tokens_per_seq, batch, block_size, device):
    """Random bf16 paged caches with a shuffled block table (fragmented, as after a long serving run)."""
    blocks_per_seq = triton.cdiv(num_tokens_per_seq, block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, device=device, dtype=DTYPE)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    return k_cache, v_cache, tables


def flash_attn_4():
    """flash-attn 4 behind our contract, or None where it does not run here."""
    from offload_engine.layers.attention_backends import flash_attn_version

    if flash_attn_version(torch.device("cuda")) != 4:
        return None
    from offload_engine.layers.flash_attn_backend import FlashAttn4

    return FlashAttn4


def fa4_into(row: dict, unit: str, work: float, time_ms) -> None:
    """flash-attn 4's milliseconds (time_ms(backend)) and rate (work per second, as fa4_<unit>) into row, or why not;
    nothing where flash-attn 4 does not run here."""
    fa4 = flash_attn_4()
    if fa4 is None:
        return
    try:
        ms = time_ms(fa4)
        row.update({"fa4_ms": ms, f"fa4_{unit}": work / (ms * 1e-3)})
    except Exception as exc:  # noqa: BLE001 - a case it cannot run is a result
        row["fa4_error"] = repr(exc)[:300]
    torch.cuda.empty_cache()


def ours_decode_ms(batch, context, block_size, device, decode=paged_decode_attention):
    k_cache, v_cache, tables = paged_kv(context, batch, block_size, device)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = HEAD_DIM ** -0.5
    return bench_ms(lambda: decode(q, k_cache, v_cache, tables, ctx, scale))


def run_decode(cases, block_sizes, copy_gbps, max_kv_gb, device):
    rows = []
    for batch, context in cases:
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
        row = {"kind": "decode", "batch": batch, "context": context, "kv_gb": kv_bytes / 1e9}
        if kv_bytes / 1e9 > max_kv_gb:
            rows.append({**row, "skipped": f"KV over --max-kv-gb {max_kv_gb}"})
            continue
        try:  # SDPA first, and freed, so its contiguous copy never coexists with the paged cache
            sdpa_ms, backend = sdpa_decode_ms(batch, context, device)
            row.update(sdpa_ms=sdpa_ms, sdpa_gbps=kv_bytes / (sdpa_ms * 1e-3) / 1e9, sdpa_backend=backend)
        except Exception as exc:
            row["sdpa_error"] = repr(exc)[:300]
        torch.cuda.empty_cache()
        for block_size in block_sizes:
            entry = {**row, "block_size": block_size}
            try:
                ms = ours_decode_ms(batch, context, block_size, device)
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                entry.update(ours_ms=ms, ours_gbps=gbps, ours_over_copy=gbps / copy_gbps)
                if "sdpa_ms" in row:
                    entry["ours_over_sdpa"] = row["sdpa_ms"] / ms  # > 1: ours is faster
            except Exception as exc:
                entry["error"] = repr(exc)[:300]
                traceback.print_exc()
            torch.cuda.empty_cache()
            fa4_into(entry, "gbps", kv_bytes / 1e9,
                     lambda fa4: ours_decode_ms(batch, context, block_size, device, fa4.paged_decode_attention))
            rows.append(entry)
            print_decode_row(entry)
    return rows


def print_decode_row(r):
    if "ours_ms" not in r:
        print(f"decode B={r['batch']:4d} L={r['context']:7d} bs={r.get('block_size', '-')}: "
              f"{r.get('error') or r.get('skipped')}", flush=True)
        return
    sdpa = (f"SDPA {r['sdpa_ms'] * 1e3:8.1f} us {r['sdpa_gbps']:6.0f} GB/s ({r['sdpa_backend']})  "
            f"ours/SDPA {r['ours_over_sdpa']:5.2f}x") if "sdpa_ms" in r else f"SDPA failed: {r.get('sdpa_error')}"
    print(f"decode B={r['batch']:4d} L={r['context']:7d} bs={r['block_size']:3d} KV {r['kv_gb']:6.2f} GB  "
          f"ours {r['ours_ms'] * 1e3:8.1f} us {r['ours_gbps']:6.0f} GB/s = {r['ours_over_copy']:4.2f} of copy  "
          f"{sdpa}  flash-attn 4 {r.get('fa4_gbps', float('nan')):6.0f} GB/s", flush=True)


def run_prefill(cases, block_size, device):
    rows = []
    for batch, length in cases:
        flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * length * length / 2  # QK^T and PV, causal half
        row = {"kind": "prefill", "batch": batch, "context": length, "block_size": block_size, "tflop": flops / 1e12}
        try:
            q = torch.randn(batch, NUM_Q_HEADS, length, HEAD_DIM, device=device, dtype=DTYPE)
            k = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, device=device, dtype=DTYPE)
            v = torch.randn_like(k)
            row["sdpa_ms"] = sdpa_prefill_ms(q, k, v, row)
            row["sdpa_tflops"] = flops / (row["sdpa_ms"] * 1e-3) / 1e12
            del q, k, v
        except Exception as exc:
            row["sdpa_error"] = repr(exc)[:300]
        torch.cuda.empty_cache()
        try:
            ms = ours_prefill_ms(batch, length, block_size, device)
            row.update(ours_ms=ms, ours_tflops=flops / (ms * 1e-3) / 1e12)
            if "sdpa_ms" in row:
                row["ours_over_sdpa"] = row["sdpa_ms"] / ms
        except Exception as exc:
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        torch.cuda.empty_cache()
        fa4_into(row, "tflops", flops / 1e12,
                 lambda fa4: ours_prefill_ms(batch, length, block_size, device, fa4.paged_prefill_attention))
        rows.append(row)
        print(f"prefill B={batch} L={length} bs={block_size}: flash-attn 4 {row.get('fa4_tflops', float('nan')):6.1f}"
              f" TFLOP/s  ours {row.get('ours_tflops', float('nan')):6.1f} "
              f"TFLOP/s  SDPA {row.get('sdpa_tflops', float('nan')):6.1f} TFLOP/s ({row.get('sdpa_backend', '?')})  "
              f"ours/SDPA {row.get('ours_over_sdpa', float('nan')):5.2f}x {row.get('error', '')}", flush=True)
    return rows


def sdpa_prefill_ms(q, k, v, row):
    """Causal SDPA on the flash backend; the other fused backends only if flash cannot run the shape."""
    from torch.nn.attention import SDPBackend
    try:
        ms, row["sdpa_backend"] = sdpa_best_ms(q, k, v, True, (SDPBackend.FLASH_ATTENTION,))
    except RuntimeError:
        ms, row["sdpa_backend"] = sdpa_best_ms(q, k, v, True, (SDPBackend.EFFICIENT_ATTENTION,
                                                                SDPBackend.CUDNN_ATTENTION))
    return ms


def ours_prefill_ms(batch, length, block_size, device, prefill=paged_prefill_attention):
    k_cache, v_cache, tables = paged_kv(length, batch, block_size, device)
    q = torch.randn(batch * length, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * length
    ctx = torch.full((batch,), length, dtype=torch.int32, device=device)
    scale = HEAD_DIM ** -0.5
    return bench_ms(lambda: prefill(q, k_cache, v_cache, tables, cu, ctx, scale, length))


def print_summary(copy_gbps, rows):
    print(f"\ncopy ceiling {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'kind':8s} {'B':>4s} {'L':>7s} {'bs':>4s} {'KV GB':>6s} {'ours us':>9s} {'ours':>12s} {'of copy':>8s} "
          f"{'SDPA':>12s} {'ours/SDPA':>9s}  SDPA backend")
    for r in rows:
        if "ours_ms" not in r:
            print(f"{r['kind']:8s} {r['batch']:4d} {r['context']:7d}  {r.get('error') or r.get('skipped', '')}")
            continue
        decode = r["kind"] == "decode"
        unit = "GB/s" if decode else "TF/s"
        ours = r["ours_gbps"] if decode else r["ours_tflops"]
        sdpa = r.get("sdpa_gbps" if decode else "sdpa_tflops", float("nan"))
        of_copy = f"{r['ours_over_copy']:8.2f}" if decode else f"{'':8s}"
        print(f"{r['kind']:8s} {r['batch']:4d} {r['context']:7d} {r['block_size']:4d} {r.get('kv_gb', 0):6.2f} "
              f"{r['ours_ms'] * 1e3:9.1f} {ours:7.0f} {unit} {of_copy} {sdpa:7.0f} {unit} "
              f"{r.get('ours_over_sdpa', float('nan')):8.2f}x  {r.get('sdpa_backend', r.get('sdpa_error', ''))}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny grid (a few cases) for a smoke run")
    parser.add_argument("--out-dir", default="benchmarks/results", help="folder for gpu_attention_<gpu>.json")
    parser.add_argument("--out", default=None, help="exact JSON path (overrides --out-dir)")
    parser.add_argument("--block-sizes", default="16,256", help="comma-separated decode block sizes")
    parser.add_argument("--max-kv-gb", type=float, default=40.0, help="skip decode cases with more KV than this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")  # SDPA warns for every backend that declines a shape
    start = time.time()
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbps = copy_ceiling_gbps(device)
    print(f"device-to-device copy ceiling: {copy_gbps:.0f} GB/s", flush=True)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    rows = run_decode(QUICK_DECODE if args.quick else DECODE_CASES, block_sizes, copy_gbps, args.max_kv_gb, device)
    rows += run_prefill(QUICK_PREFILL if args.quick else PREFILL_CASES, block_sizes[0], device)
    print_summary(copy_gbps, rows)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = Path(args.out) if args.out else Path(args.out_dir) / f"gpu_attention_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                               "copy_gbps": copy_gbps, "shapes": {"num_kv_heads": NUM_KV_HEADS, "num_q_heads":
                               NUM_Q_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)},
                               "seconds": time.time() - start, "rows": rows}, indent=1))
    print(f"wrote {out} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
