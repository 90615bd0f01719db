"""Peers on the same model and workload: Hugging Face transformers' `generate`.

Two caches: the default dynamic cache (all KV on the device, as much of it as the whole GPU holds), and
`cache_implementation="offloaded"` (KV kept on the host, each layer's KV streamed to the device and back every
step). A peer that cannot run a workload is recorded with the reason, never skipped silently.

A peer gets a time budget: it runs whole batches while time is left, and the batch running when the budget
ends stops there (generate's `max_time`). Its rate is then output tokens over seconds for the tokens it
produced, which, if anything, flatters it: a cut-short batch never reaches the longest contexts. Each batch's first
token is timed too (a streamer's second `put`: the first is the prompt), so its prefill can be set apart from its
decode: `prefill_seconds` and `decode_tok_per_s` (tokens after each batch's first over the time after it).
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

        prefills = []  # per batch run: seconds to its first token

        def run(batch, max_time=None):
            ids, first = torch.tensor(batch, device=device), FirstToken()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, max_time=max_time, streamer=first,
                                 **kwargs)
            prefills.append(first.seconds())
            return out.shape[0] * (out.shape[1] - ids.shape[1])

        with torch.inference_mode():
            run(prompts[:1], max_time=5.0)  # warm up
            prefills.clear()
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
        prefill = sum(p for p in prefills if p is not None)
        after_first = generated - sum(len(prompts[i : i + batch_size]) for i in range(0, batches * batch_size,
                                                                                      batch_size))
        return {"seconds": seconds, "output_tok_per_s": generated / seconds, "batch_size": batch_size,
                "output_tokens": generated, "batches_run": batches, "cut_short_by_time_budget": cut_short,
                "prefill_seconds": prefill,
                "decode_tok_per_s": after_first / (seconds - prefill) if seconds > prefill else None}
    except Exception as error:  # out of memory, or a cache this machine cannot run
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        model = None  # frees the weights before the next run loads its own
        if device == "cuda":
            torch.cuda.empty_cache()


class FirstToken:
    """A generate streamer that notes when the first new token arrives (its second `put`; the first is the prompt)."""

    def __init__(self):
        self.began, self.first, self.puts = time.perf_counter(), None, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass

    def seconds(self) -> float | None:
        return None if self.first is None else self.first - self.began
