"""`make run` / `offload-engine demo`: a batch of long prompts on the embedded tiny model, both KV tiers, then a
greedy check: with random weights the text means nothing, but greedy tokens must equal transformers' on either tier.
"""
import time

import torch

from offload_engine.config import ModelConfig
from offload_engine.llm import LLM
from offload_engine.sampling_params import SamplingParams
from offload_engine.tiny_model import default_model_dir

# Two requests per tier; 256 prompt tokens span 16 device or 4 host blocks, and 32 new tokens let a wrong KV read
# change some argmax. Longer costs a 2-core CPU seconds on transformers' side and proves no more.
GREEDY_REQUESTS = 4
GREEDY_PROMPT_LEN = 256
GREEDY_MAX_TOKENS = 32
TIER_NAMES = {"gpu": "device", "cpu": "host"}


def run_demo(num_requests: int = 16, prompt_len: int = 1024, max_tokens: int = 64, device: str | None = None,
             model_dir: str | None = None) -> dict:
    """Prints the throughput and greedy-check lines and returns them as one dict. The check passed when
    `greedy_matches == greedy_requests`."""
    for flag, value in (("--requests", num_requests), ("--prompt-len", prompt_len), ("--max-tokens", max_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"demo {flag} must be an int >= 1, got {value!r}")
    model_dir = model_dir or default_model_dir()
    _check_prompt_len(model_dir, prompt_len)
    summary = _throughput(model_dir, device, num_requests, prompt_len, max_tokens)
    check = _greedy_check(model_dir, device, min(prompt_len, GREEDY_PROMPT_LEN), min(max_tokens, GREEDY_MAX_TOKENS))
    summary.update(check)
    return summary


def _check_prompt_len(model_dir: str, prompt_len: int) -> None:
    """A prompt must leave the model room for one new token; the demo runs at the model's full length, so the only
    thing to change is --prompt-len."""
    positions = ModelConfig.from_model_dir(model_dir).max_position_embeddings
    if prompt_len >= positions:
        raise ValueError(f"demo --prompt-len {prompt_len} does not fit the demo model's {positions} positions: "
                         f"use --prompt-len {positions - 1} or less")


def _half_on_device(model_dir: str, device: str | None, num_requests: int, seq_tokens: int, **engine_args) -> LLM:
    """An engine whose device pool holds about half the requests' budgets, so "auto" places the rest on the host."""
    budget_blocks = -(-seq_tokens // 16)
    return LLM(model_dir, device=device, kv_placement="auto", num_gpu_blocks=max(1, budget_blocks * num_requests // 2),
               num_cpu_blocks=budget_blocks * num_requests // 4 + 8, cpu_block_size=64, dtype="float32", **engine_args)


def _random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def _throughput(model_dir: str, device: str | None, num_requests: int, prompt_len: int, max_tokens: int) -> dict:
    with _half_on_device(model_dir, device, num_requests, prompt_len + max_tokens) as llm:
        prompts = _random_prompts(num_requests, prompt_len, llm.model_config.vocab_size, seed=0)
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                                                       ignore_eos=True))
        seconds = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outputs)
        tiers = {tier: sum(o.kv_location == tier for o in outputs) for tier in TIER_NAMES}
        summary = {"model": model_dir, "device": llm.config.device, "requests": len(outputs),
                   "prompt_tokens": num_requests * prompt_len, "generated_tokens": generated, "seconds": seconds,
                   "output_tok_per_s": generated / seconds, "kv_location": tiers, **llm.kv_cache_summary}
    print(f"\nmodel            {model_dir}\ndevice           {summary['device']} "
          f"({summary['attention_backend']} attention on the device tier)")
    print(f"requests         {summary['requests']} x {prompt_len} prompt tokens, {max_tokens} new tokens each")
    print(f"generated        {generated} tokens in {seconds:.2f} s = {summary['output_tok_per_s']:.1f} tok/s "
          f"(prompt + output: {(num_requests * prompt_len + generated) / seconds:.0f} tok/s)")
    print(f"KV lived on      device tier: {tiers['gpu']} requests, host tier: {tiers['cpu']} requests")
    print(f"pools            device {summary['device_blocks']} blocks x {summary['block_size']}, "
          f"host {summary['host_blocks']} blocks x {summary['cpu_block_size']} tokens")
    return summary


def _greedy_check(model_dir: str, device: str | None, prompt_len: int, max_tokens: int) -> dict:
    # Without promotion a host-tier request decodes on the host tier to its last token, so the check covers it.
    with _half_on_device(model_dir, device, GREEDY_REQUESTS, prompt_len + max_tokens, kv_promotion=False) as llm:
        prompts = _random_prompts(GREEDY_REQUESTS, prompt_len, llm.model_config.vocab_size, seed=1)
        # ignore_eos=False: both sides stop at the model's eos, so the token lists compare exactly.
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    expected = _transformers_greedy(model_dir, prompts, max_tokens)
    tiers = {tier: sum(o.kv_location == tier for o in outputs) for tier in TIER_NAMES}
    matches = sum(o.token_ids == want for o, want in zip(outputs, expected))
    print(f"greedy check     {matches}/{len(outputs)} requests match transformers token for token "
          f"(KV: {tiers['gpu']} on the device tier, {tiers['cpu']} on the host tier; "
          f"{prompt_len} prompt tokens, up to {max_tokens} new)")
    for i, (output, want) in enumerate(zip(outputs, expected)):
        if output.token_ids != want:
            print(f"  MISMATCH       request {i} ({TIER_NAMES[output.kv_location]} tier) "
                  f"{_first_difference(output.token_ids, want)}")
    return {"greedy_requests": len(outputs), "greedy_matches": matches, "greedy_kv_location": tiers}


def _transformers_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    continuations = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        continuations.append(out[0, len(prompt):].tolist())
    return continuations


def _first_difference(got: list[int], want: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    engine = got[at] if at < len(got) else "end of output"
    reference = want[at] if at < len(want) else "end of output"
    return f"first differs at new token {at}: engine {engine}, transformers {reference}"
