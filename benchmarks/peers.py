"""Peers on the same model and workload: Hugging Face transformers' `generate`.

Two caches: the default dynamic cache (all KV on the device, as much of it as the whole GPU holds), and
`cache_implementation="offloaded"` (KV kept on the host, each layer's KV streamed to the device and back every
step). A peer that cannot run a workload is recorded with the reason, never skipped silently.

A peer gets a time budget: it runs whole batches while time is left, and the batch running when the budget
ends stops there (generate's `max_time`). Its rate is then output tokens over seconds for the tokens it
produced, which, if anything, flatters it: a cut-short batch never reaches the longest contexts.
"""
import time

import torch


def hf_generate(model_dir: str, prompts: list[list[int]], output_len: int, cache: str | None,
                batch_size: int, seconds_budget: float) -> dict:
    """Output tok/s of greedy generate over equal-length prompts in batches (no padding needed)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
        kwargs = {"cache_implementation": cache} if cache else {}

        def run(batch, max_time=None):
            ids = torch.tensor(batch, device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, max_time=max_time, **kwargs)
            return out.shape[0] * (out.shape[1] - ids.shape[1])

        with torch.inference_mode():
            run(prompts[:1], max_time=5.0)  # warm up
            start, generated, batches, cut_short = time.perf_counter(), 0, 0, False
            for i in range(0, len(prompts), batch_size):
                left = seconds_budget - (time.perf_counter() - start)
                if left <= 0:
                    break
                made = run(prompts[i : i + batch_size], max_time=left)
                cut_short |= made < len(prompts[i : i + batch_size]) * output_len
                generated, batches = generated + made, batches + 1
            if device == "cuda":
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "output_tok_per_s": generated / seconds, "batch_size": batch_size,
                "output_tokens": generated, "batches_run": batches, "cut_short_by_time_budget": cut_short}
    except Exception as error:  # out of memory, or a cache this machine cannot run
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        model = None  # frees the weights before the next run loads its own
        if device == "cuda":
            torch.cuda.empty_cache()
