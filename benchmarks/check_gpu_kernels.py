"""Correctness of the Triton kernels at real shapes on the GPU, against float64 torch references on the GPU.

Covers Hkv 8 x D 128 with Hq 16 and 32, bf16 / fp16 / fp32, block sizes 16 and 256: decode (B 1 and 64,
contexts up to 32k, empty rows, NaN in every slot no sequence owns), prefill (a 512-token chunk after a 4k
prefix, a whole-sequence prefill, a single query, an empty chunk), merge (empty partials on either or both
sides), store (strided key/value views, -1 slots), and decode + store captured in a CUDA graph and replayed
with new values. Prints a pass/fail table, writes JSON, exits 1 on any failure.

    python3 benchmarks/check_gpu_kernels.py --out benchmarks/results/gpu_kernel_check.json
"""
import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import merge_attn_states, paged_decode_attention, paged_prefill_attention, store_kvcache  # noqa: E402

NUM_KV_HEADS, HEAD_DIM = 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUT_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LSE_TOL = {torch.float32: 5e-4, torch.bfloat16: 2e-3, torch.float16: 2e-3}


def reference_attention(q, k, v, scale, first_position=None):
    """float64 attention on the GPU: q [M, Hq, D], k/v [N, Hkv, D] -> out [M, Hq, D], lse [M, Hq]."""
    num_q, num_q_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    if num_k == 0:
        return (torch.zeros(num_q, num_q_heads, head_dim, dtype=torch.float64, device=q.device),
                torch.full((num_q, num_q_heads), -math.inf, dtype=torch.float64, device=q.device))
    group = num_q_heads // num_kv_heads
    qd = q.double().reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, M, D]
    scores = qd @ k.double().permute(1, 2, 0).unsqueeze(1) * scale  # [Hkv, G, M, N]
    if first_position is not None:
        positions = first_position + torch.arange(num_q, device=q.device)
        scores.masked_fill_(torch.arange(num_k, device=q.device)[None, :] > positions[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v.double().permute(1, 0, 2).unsqueeze(1)  # [Hkv, G, M, D]
    out = out.permute(2, 0, 1, 3).reshape(num_q, num_q_heads, head_dim)
    return out, lse.permute(2, 0, 1).reshape(num_q, num_q_heads)


def make_paged(context_lens, block_size, dtype, device, seed):
    """Shuffled paged caches holding random K/V, NaN in every slot no sequence owns; -1-padded tables."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks) + 4
    max_blocks = max(blocks) + max(blocks) // 2 + 1  # wider than needed, like a CUDA-graph table
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32, device=device)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    used = 0
    for b, (n, nb) in enumerate(zip(context_lens, blocks)):
        tables[b, :nb] = order[used:used + nb].int()
        used += nb
        toks = torch.arange(n, device=device)
        owned[tables[b, toks // block_size].long() * block_size + toks % block_size] = True
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(2):
        cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[~owned] = math.nan
        caches.append(cache)
    return caches[0], caches[1], tables


def gather(cache, table_row, n, block_size):
    """A sequence's contiguous [n, Hkv, D] K or V out of the paged cache."""
    toks = torch.arange(n, device=cache.device)
    return cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[table_row[toks // block_size].long() * block_size + toks % block_size]


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(out, lse, ref_out, ref_lse, dtype):
    """(passed, detail): relative error of out, max |lse error|, exact 0 / -inf on empty rows."""
    empty = torch.isinf(ref_lse)
    err = rel_err(out[~empty], ref_out[~empty]) if (~empty).any() else 0.0
    lse_err = (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    empty_ok = bool(torch.equal(torch.isneginf(lse), empty) and torch.all(out[empty] == 0))
    passed = err < OUT_TOL[dtype] and lse_err < LSE_TOL[dtype] and empty_ok and not torch.isnan(out).any().item()
    return passed, {"rel_err": err, "lse_err": lse_err, "empty_rows_ok": empty_ok}


def check_decode(dtype, num_q_heads, block_size, batch, device, seed):
    if batch == 1:
        context_lens = [32768]
    else:
        special = [0, 1, 15, 16, 17, 255, 256, 257, 4095, 32767, 0, 8192]
        rand = torch.randint(1, 8193, (batch - len(special),), generator=torch.Generator().manual_seed(seed))
        context_lens = special + rand.tolist()
    k_cache, v_cache, tables = make_paged(context_lens, block_size, dtype, device, seed)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, device=device).to(dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = HEAD_DIM ** -0.5
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    refs = [reference_attention(q[b:b + 1], gather(k_cache, tables[b], n, block_size),
                                gather(v_cache, tables[b], n, block_size), scale) for b, n in enumerate(context_lens)]
    return compare(out, lse, torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]), dtype)


def check_prefill(dtype, num_q_heads, block_size, device, seed):
    # (context including the chunk, chunk length): 512 after a 4k prefix, a whole prefill, one query, none.
    seqs = [(4096 + 512, 512), (1000, 1000), (301, 1), (777, 0), (2048 + 300, 300)]
    context_lens = [c for c, _ in seqs]
    k_cache, v_cache, tables = make_paged(context_lens, block_size, dtype, device, seed)
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, HEAD_DIM, device=device).to(dtype)
    scale = HEAD_DIM ** -0.5
    out, lse = paged_prefill_attention(q, k_cache, v_cache, tables, cu,
                                       torch.tensor(context_lens, dtype=torch.int32, device=device), scale, max(q_lens))
    ref_out, ref_lse = [], []
    for b, (context, q_len) in enumerate(seqs):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        o, l = reference_attention(q[rows], gather(k_cache, tables[b], context, block_size),
                                   gather(v_cache, tables[b], context, block_size), scale, context - q_len)
        ref_out.append(o)
        ref_lse.append(l)
    return compare(out, lse, torch.cat(ref_out), torch.cat(ref_lse), dtype)


def check_merge(dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens, num_heads = 4096, 32
    out_a = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen, device=device).to(dtype)
    out_b = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen, device=device).to(dtype)
    lse_a = torch.randn(num_tokens, num_heads, generator=gen, device=device) * 3 + 5
    lse_b = torch.randn(num_tokens, num_heads, generator=gen, device=device) * 3 + 5
    pick = torch.rand(num_tokens, num_heads, generator=gen, device=device)
    lse_a[pick < 0.15] = -math.inf  # 0.00-0.05 both empty, 0.05-0.15 only a empty, 0.15-0.25 only b empty
    lse_b[(pick < 0.05) | ((pick >= 0.15) & (pick < 0.25))] = -math.inf
    out_a[torch.isinf(lse_a)] = math.nan  # an empty side's out must not leak into the result
    out_b[torch.isinf(lse_b)] = math.nan
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    w_a = torch.exp(lse_a.double() - ref_lse).nan_to_num(0.0)[..., None]
    w_b = torch.exp(lse_b.double() - ref_lse).nan_to_num(0.0)[..., None]
    ref_out = (torch.where(w_a > 0, w_a * out_a.double(), 0.0) + torch.where(w_b > 0, w_b * out_b.double(), 0.0))
    ref_out = ref_out.nan_to_num(0.0)
    a_only, b_only = torch.isinf(lse_b) & ~torch.isinf(lse_a), torch.isinf(lse_a) & ~torch.isinf(lse_b)
    passthrough = bool(torch.equal(out[a_only], out_a[a_only]) and torch.equal(out[b_only], out_b[b_only])
                       and torch.equal(lse[a_only], lse_a[a_only]) and torch.equal(lse[b_only], lse_b[b_only]))
    passed, detail = compare(out, lse, ref_out, ref_lse, dtype)
    detail["passthrough_exact"] = passthrough
    return passed and passthrough, detail


def check_store(dtype, block_size, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens, num_q_heads, num_blocks = 4096, 32, 4096 * 2 // block_size + 3
    qkv = torch.randn(num_tokens, num_q_heads + 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    key, value = qkv[:, num_q_heads:num_q_heads + NUM_KV_HEADS], qkv[:, num_q_heads + NUM_KV_HEADS:]
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device=device) < 0.1] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[keep]] = key[keep]
    v_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[keep]] = value[keep]
    store_kvcache(key, value, k_cache, v_cache, slots.int())
    passed = bool(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))
    return passed, {"exact": passed}


def capture(fn):
    """Warm up on a side stream (compiles the kernels), then capture fn into a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def check_decode_graph(device, seed):
    """Capture decode once, replay with new q and new context lengths (values only, same shapes)."""
    dtype, batch, num_q_heads, block_size, capacity = torch.bfloat16, 8, 32, 16, 8192
    k_cache, v_cache, tables = make_paged([capacity] * batch, block_size, dtype, device, seed)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, device=device).to(dtype)
    ctx = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    scale = HEAD_DIM ** -0.5
    graph, (out, lse) = capture(lambda: paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale))
    details, passed = [], True
    for trial, lens in enumerate(([8192, 1, 0, 17, 4096, 300, 8191, 16], [5, 6000, 7000, 0, 0, 2, 8000, 129])):
        q.copy_(torch.randn(batch, num_q_heads, HEAD_DIM, device=device).to(dtype))
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        refs = [reference_attention(q[b:b + 1], gather(k_cache, tables[b], n, block_size),
                                    gather(v_cache, tables[b], n, block_size), scale) for b, n in enumerate(lens)]
        ok, detail = compare(out, lse, torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]), dtype)
        passed &= ok
        details.append(detail)
    return passed, {"replays": details}


def check_store_graph(device, seed):
    """Capture store once, replay with new key/value and a new slot mapping."""
    dtype, num_tokens, block_size, num_blocks = torch.bfloat16, 64, 16, 32
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    graph, _ = capture(lambda: store_kvcache(key, value, k_cache, v_cache, slots))
    new_slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    new_slots[::7] = -1
    key.copy_(torch.randn_like(key))
    value.copy_(torch.randn_like(value))
    slots.copy_(new_slots)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = new_slots >= 0
    k_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[new_slots[keep]] = key[keep]
    v_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[new_slots[keep]] = value[keep]
    graph.replay()
    torch.cuda.synchronize()
    passed = bool(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))
    return passed, {"exact": passed}


def cases(device):
    """(name, thunk) for every check, in run order."""
    for dname, dtype in DTYPES.items():
        yield f"store {dname}", lambda d=dtype: check_store(d, 16, device, 1)
        yield f"store {dname} bs256", lambda d=dtype: check_store(d, 256, device, 2)
        yield f"merge {dname}", lambda d=dtype: check_merge(d, device, 3)
        for hq in (16, 32):
            for bs in (16, 256):
                for batch in (1, 64):
                    yield (f"decode {dname} Hq{hq} bs{bs} B{batch}",
                           lambda d=dtype, h=hq, s=bs, b=batch: check_decode(d, h, s, b, device, 4))
                yield f"prefill {dname} Hq{hq} bs{bs}", lambda d=dtype, h=hq, s=bs: check_prefill(d, h, s, device, 5)
    yield "cuda graph: decode bf16", lambda: check_decode_graph(device, 6)
    yield "cuda graph: store bf16", lambda: check_store_graph(device, 7)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_kernel_check.json", help="JSON results path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_gpu_kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    results = []
    start = time.time()
    for name, thunk in cases(device):
        t0 = time.time()
        try:
            passed, detail = thunk()
        except Exception as exc:  # one broken case must not hide the others
            passed, detail = False, {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-2000:]}
        torch.cuda.empty_cache()
        results.append({"case": name, "passed": bool(passed), "seconds": round(time.time() - t0, 2), **detail})
        print(f"{'PASS' if passed else 'FAIL'}  {name:34s} {time.time() - t0:6.1f}s  "
              f"{ {k: v for k, v in detail.items() if k != 'traceback'} }", flush=True)
    failed = [r for r in results if not r["passed"]]
    print(f"\n{'case':36s} {'result':6s} {'rel_err':>10s} {'lse_err':>10s}")
    for r in results:
        rel, lerr = r.get("rel_err", float("nan")), r.get("lse_err", float("nan"))
        print(f"{r['case']:36s} {'PASS' if r['passed'] else 'FAIL':6s} {rel:10.2e} {lerr:10.2e}")
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {time.time() - start:.0f}s on "
          f"{torch.cuda.get_device_name()}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": __import__("triton").__version__, "results": results}, indent=1))
    print(f"wrote {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
