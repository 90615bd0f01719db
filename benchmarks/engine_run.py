"""One measured engine run: a fixed set of requests through `LLM.generate`, with step-level timings."""
import os
import time

import torch

from offload_engine import LLM, SamplingParams


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def measure(model_dir: str, prompts: list[list[int]], output_lens: list[int], **llm_kwargs) -> dict:
    """Output and total tok/s of generating output_lens[i] tokens (ignore_eos) after prompts[i]."""
    start = time.perf_counter()
    llm = LLM(model_dir, **llm_kwargs)
    startup = time.perf_counter() - start
    vocab = llm.model_config.vocab_size
    # Warm up kernels and graphs on a prompt that shares no prefix with the measured ones: a cached prefix
    # would change what is measured.
    llm.generate([[vocab - 1] * min(len(prompts[0]), 64)], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
    steps = []
    engine_step = llm.engine.step
    llm.engine.step = lambda: steps.append(engine_step()) or steps[-1]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=os.environ.get("BENCH_TQDM", "1") == "1")
    seconds = time.perf_counter() - start
    decode_ms = sorted(1e3 * s.seconds for s in steps if not s.is_prefill) or [0.0]
    generated = sum(len(o.token_ids) for o in outputs)
    runner = llm.engine.runner
    result = {
        "seconds": seconds, "startup_seconds": startup,
        "output_tok_per_s": generated / seconds,
        "total_tok_per_s": (generated + sum(map(len, prompts))) / seconds,
        "prefill_seconds": sum(s.seconds for s in steps if s.is_prefill),
        "decode_steps": len(decode_ms), "decode_step_ms_median": decode_ms[len(decode_ms) // 2],
        "kv_location": {t: sum(o.kv_location == t for o in outputs) for t in ("gpu", "cpu")},
        "preemptions": llm.engine.scheduler.num_preemptions, "promotions": llm.engine.scheduler.num_promotions,
        "demotions": llm.engine.scheduler.num_demotions,
        "decoded_by_lane": dict(llm.engine.decoded_by_lane),  # the warm-up's few tokens included
        "lane_stats": llm.engine.stats.snapshot(),  # the cost check's inputs at the end, and its outcomes
        **llm.kv_cache_summary,
        "device_pool_gib": runner.num_gpu_blocks * llm.config.block_size
        * llm.model_config.kv_bytes_per_token(llm.dtype) / 2**30,
        "kv_bytes_per_token": llm.model_config.kv_bytes_per_token(llm.dtype),
    }
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result
