"""Peers on the same model and workload: Hugging Face transformers' `generate`.

Two caches: the default dynamic cache (all KV on the device), and `cache_implementation="offloaded"` (KV
kept on the host, each layer's KV streamed to the device and back every step). A peer that cannot run a
workload is recorded with the reason, never skipped silently.
"""
import time

import torch


def hf_generate(model_dir: str, prompts: list[list[int]], output_len: int, cache: str | None,
                batch_size: int) -> dict:
    """Output tok/s of greedy generate over equal-length prompts in batches (no padding needed)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
        kwargs = {"cache_implementation": cache} if cache else {}
        run = lambda batch: model.generate(torch.tensor(batch, device=device), max_new_tokens=output_len,
                                           min_new_tokens=output_len, do_sample=False,
                                           attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long,
                                                                     device=device), **kwargs)
        with torch.inference_mode():
            run(prompts[:1])  # warm up
            start = time.perf_counter()
            for i in range(0, len(prompts), batch_size):
                run(prompts[i : i + batch_size])
            if device == "cuda":
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "output_tok_per_s": len(prompts) * output_len / seconds, "batch_size": batch_size}
    except Exception as error:  # out of memory, or a cache this machine cannot run
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
