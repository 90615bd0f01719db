"""transformers' greedy `generate` in float32: the engine's independent reference."""
import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=512)
def _greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations, stopping at the model's eos like the engine does without ignore_eos."""
    return [list(_greedy(model_dir, tuple(p), max_new_tokens)) for p in prompts]


def random_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
