"""One measured engine run: a fixed set of requests through `LLM.generate`, with step-level timings."""
import os
import time

import torch

from offload_engine import LLM, SamplingParams


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def weight_bytes(llm) -> int:
    """Bytes one decode step reads of the weights: every parameter once (a tied head counts once)."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in llm.engine.runner.model.parameters()}
    return sum(params.values())


def measure(model_dir: str, prompts: list[list[int]], output_lens: list[int], *, lane_stats_before: bool = False,
            inspect=None, **llm_kwargs) -> dict:
    """Output and total tok/s of generating output_lens[i] tokens (ignore_eos) after prompts[i]. lane_stats_before:
    also give the lane stats as they stood right before the timed call ("lane_stats_before"), for deltas over it.
    inspect: a function of the LLM whose dict joins the result, called before the LLM closes."""
    start = time.perf_counter()
    llm = LLM(model_dir, **llm_kwargs)
    startup = time.perf_counter() - start
    vocab = llm.model_config.vocab_size
    # Warm up kernels and graphs on prompts that share no prefix with the measured ones (a cached prefix would
    # change what is measured): one short, and enough of the measured length to fill a prefill chunk, so that
    # the prefill kernels for those shapes are compiled and tuned before the clock starts. Without the second
    # part, prefill took 0.3-1.8 s of a 23 s run by chance of a fresh Triton cache (H100 host, 2026-11-22).
    length = len(prompts[0])
    count = min(len(prompts), llm.config.max_num_batched_tokens // max(length, 1) + 1)
    warm = [[vocab - 1] * min(length, 64)] + [[vocab - 2 - i] * length for i in range(count)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    scheduler = llm.engine.scheduler
    moves_before = (scheduler.num_preemptions, scheduler.num_promotions, scheduler.num_demotions,
                    scheduler.num_split_growths)
    lanes_before = dict(llm.engine.decoded_by_lane)
    steps_before = dict(llm.engine.steps_by_lane)
    stats_before = llm.engine.stats.snapshot() if lane_stats_before else None
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
    steps = []
    engine_step = llm.engine.step
    llm.engine.step = lambda: steps.append(engine_step()) or steps[-1]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=os.environ.get("BENCH_TQDM", "1") == "1")
    seconds = time.perf_counter() - start
    in_order = [1e3 * s.seconds for s in steps if not s.is_prefill]
    decode_ms = sorted(in_order) or [0.0]
    generated = sum(len(o.token_ids) for o in outputs)
    runner = llm.engine.runner
    result = {
        "seconds": seconds, "startup_seconds": startup,
        "output_tok_per_s": generated / seconds,
        "total_tok_per_s": (generated + sum(map(len, prompts))) / seconds,
        "prefill_seconds": sum(s.seconds for s in steps if s.is_prefill),
        "decode_steps": len(decode_ms), "decode_step_ms_median": decode_ms[len(decode_ms) // 2],
        # where a decode's time goes beyond its median step: the steps' sum, and the first and last ones in order
        "decode_steps_seconds": sum(in_order) / 1e3, "decode_step_ms_first": in_order[:8],
        "decode_step_ms_last": in_order[-8:],
        "kv_location": {t: sum(o.kv_location == t for o in outputs) for t in ("gpu", "cpu", "split")},
        "kv_device_tokens": sum(o.kv_device_tokens for o in outputs),  # of split requests
        # the measured call's own moves and tokens, without the warm-up's
        "preemptions": scheduler.num_preemptions - moves_before[0],
        "promotions": scheduler.num_promotions - moves_before[1],
        "demotions": scheduler.num_demotions - moves_before[2],
        # host rows that took spare device room as a part (promotion in parts, when it is on)
        "split_growths": scheduler.num_split_growths - moves_before[3], "promote_in_parts": scheduler.promote_in_parts,
        "decoded_by_lane": {lane: n - lanes_before[lane] for lane, n in llm.engine.decoded_by_lane.items()},
        "steps_by_lane": {lane: n - steps_before[lane] for lane, n in llm.engine.steps_by_lane.items()},
        "weight_bytes": weight_bytes(llm),
        "lane_stats": llm.engine.stats.snapshot(),  # the cost check's inputs at the end, and its outcomes
        **llm.kv_cache_summary,
        "device_pool_gib": runner.num_gpu_blocks * llm.config.block_size
        * llm.model_config.kv_bytes_per_token(llm.dtype) / 2**30,
        "kv_bytes_per_token": llm.model_config.kv_bytes_per_token(llm.dtype),
        "prefill_segment_tokens": runner.segment_tokens,  # of a host-tier or split prompt's layer-major step
    }
    if lane_stats_before:
        result["lane_stats_before"] = stats_before
    if inspect is not None:
        result.update(inspect(llm))
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result
