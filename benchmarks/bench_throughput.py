"""Engine throughput on random weights at a real model's shape: N sequences x (prompt P, output O).

Prints output tok/s, total tok/s and the pools' sizes, and writes JSON under benchmarks/results/.
"""
import argparse
import json
import os
import platform
import time

import torch

from benchmarks.random_model import materialize
from offload_engine import LLM, SamplingParams

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def run(model: str, num_seqs: int, prompt_len: int, output_len: int, kv_placement: str, num_gpu_blocks: int | None,
        cpu_kv_cache_gb: float | None, attention_backend: str, model_dir: str, max_model_len: int | None,
        max_num_seqs: int) -> dict:
    path = materialize(model, model_dir)
    start = time.perf_counter()
    llm = LLM(path, kv_placement=kv_placement, num_gpu_blocks=num_gpu_blocks, cpu_kv_cache_gb=cpu_kv_cache_gb,
              attention_backend=attention_backend, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    startup = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (prompt_len,), generator=gen).tolist() for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True)
    # Warm up kernels and graphs on a prompt that shares no prefix with the measured ones: a cached prefix would
    # change what is measured.
    llm.generate([[10001] * prompt_len], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps = []
    engine_step = llm.engine.step
    llm.engine.step = lambda: steps.append(engine_step()) or steps[-1]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=os.environ.get("BENCH_TQDM", "1") == "1")
    seconds = time.perf_counter() - start
    decode_ms = sorted(1e3 * s.seconds for s in steps if not s.is_prefill) or [0.0]
    generated = sum(len(o.token_ids) for o in outputs)
    result = {
        "model": model, "num_seqs": num_seqs, "prompt_len": prompt_len, "output_len": output_len,
        "kv_placement": kv_placement, "startup_seconds": startup, "seconds": seconds,
        "prefill_seconds": sum(s.seconds for s in steps if s.is_prefill), "decode_steps": len(decode_ms),
        "decode_step_ms_median": decode_ms[len(decode_ms) // 2], "output_tok_per_s": generated / seconds,
        "total_tok_per_s": (generated + num_seqs * prompt_len) / seconds,
        "kv_location": {t: sum(o.kv_location == t for o in outputs) for t in ("gpu", "cpu")},
        "preemptions": llm.engine.scheduler.num_preemptions, **llm.kv_cache_summary,
        "device_pool_gib": llm.engine.runner.num_gpu_blocks * llm.config.block_size
        * llm.model_config.kv_bytes_per_token(llm.dtype) / 2**30,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__, "host_cores": os.cpu_count(),
    }
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-placement", default="gpu")
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--model-dir", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/throughput_<model>.json)")
    args = parser.parse_args()
    result = run(args.model, args.num_seqs, args.prompt_len, args.output_len, args.kv_placement, args.num_gpu_blocks,
                 args.cpu_kv_cache_gb, args.attention_backend, args.model_dir, args.max_model_len, args.max_num_seqs)
    print(json.dumps(result, indent=2))
    out = args.out or os.path.join(RESULTS, f"throughput_{args.model}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
