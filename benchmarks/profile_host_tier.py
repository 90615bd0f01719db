"""Where a host-tier decode step's time goes (GPU host): kernel time inside the step against the step itself.

Wraps cpu_attention's kernels with timers, runs decode steps with every sequence on the host tier, and
times the same decode kernel standalone on the step's own maps.
"""
import argparse
import time

import torch

import cpu_attention
from benchmarks.random_model import materialize
from offload_engine import LLM, SamplingParams

TIMES = {"decode": 0.0, "store": 0.0, "event_wait": 0.0}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--random-prompts", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--warm-generate", action="store_true")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="warm up on the first measured prompt, so the measured prefill stages a cached prefix")
    parser.add_argument("--torch-parallel-op", action="store_true",
                        help="run one multi-threaded torch CPU op on the main thread first (as prefix staging does)")
    args = parser.parse_args()
    llm = LLM(materialize("qwen3-0.6b", "/tmp/offload_engine_models"), kv_placement="cpu", max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_gb=8, max_num_seqs=args.num_seqs)
    engine = llm.engine
    engine.runner.executor.warmup()
    if args.warm_generate:
        llm.generate([[5] * args.context], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.num_seqs):
        prompt = torch.randint(0, 10000, (args.context,), generator=gen).tolist() if args.random_prompts else [i + 1] * args.context
        if i == 0 and args.shared_prefix:
            llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        engine.add(engine.make_sequence(prompt, SamplingParams(temperature=0.6, max_tokens=128, ignore_eos=True)))
    while engine.step().is_prefill:
        pass
    for _ in range(3):
        engine.step()
    if args.torch_parallel_op:
        big = torch.randn(4096, 8, 64, 128)
        torch.index_select(big, 0, torch.randperm(4096)[:2048])
    cpu_attention.paged_decode_attention = timed("decode", cpu_attention.paged_decode_attention)
    cpu_attention.store_kvcache = timed("store", cpu_attention.store_kvcache)
    event_sync = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = timed("event_wait", event_sync)
    meta_seen = []
    attend = engine.runner.model.model.attend
    engine.runner.model.model.attend = lambda layer, q, k, v, meta: (meta_seen.append((q, meta)), attend(layer, q, k, v, meta))[1]
    start = time.perf_counter()
    durations = [engine.step().seconds * 1e3 for _ in range(args.steps)]
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print("step ms over the run:", [round(d) for d in durations[:: max(1, args.steps // 12)]])
    per = {k: v / args.steps * 1e3 for k, v in TIMES.items()}
    print(f"step {step_ms:.2f} ms | in kernels: decode {per['decode']:.2f} ms, store {per['store']:.2f} ms | "
          f"worker waiting for q on the GPU {per['event_wait']:.2f} ms")
    q, meta = meta_seen[-1]
    layer = engine.runner.model.attention_layers()[0]
    q_host = q.cpu()
    from cpu_attention.decode import paged_decode_attention as raw
    for threads in (15, 16):
        import numba
        numba.set_num_threads(threads)
        raw(q_host, layer.k_cache_cpu, layer.v_cache_cpu, meta.block_tables_cpu, meta.context_lens_cpu, 0.1)
        start = time.perf_counter()
        for _ in range(28):
            raw(q_host, layer.k_cache_cpu, layer.v_cache_cpu, meta.block_tables_cpu, meta.context_lens_cpu, 0.1)
        ms = (time.perf_counter() - start) * 1e3
        kv = int(meta.context_lens_cpu.sum()) * 2 * layer.k_cache_cpu.shape[1] * layer.k_cache_cpu.shape[3] * 2 * 28
        print(f"standalone, main thread, {threads} threads: 28 layers {ms:.2f} ms = {kv / ms / 1e6:.1f} GB/s")
    engine.abort()
    llm.close()


if __name__ == "__main__":
    main()
