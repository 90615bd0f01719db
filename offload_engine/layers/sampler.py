"""Token sampling: greedy, temperature, top-k, top-p, with per-request generators for seeded requests.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p exactly and needs
no cumulative search; a seeded request draws its E from its own generator, so its tokens do not depend on
what else shares the batch.
"""
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, already on the logits' device."""

    temperatures: torch.Tensor  # [B] float32, 0 for greedy rows
    top_ks: torch.Tensor  # [B] int64, vocab size when off
    top_ps: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]  # per row; None uses the engine's generator
    all_greedy: bool
    needs_filter: bool  # some row has top-k or top-p on: only then is the vocabulary sorted
    any_greedy: bool = True  # some row has temperature 0


def sample(logits: torch.Tensor, batch: SamplingBatch, default_generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    temps = batch.temperatures.clamp_min(1e-6).unsqueeze(1)
    scaled = logits / temps
    if batch.needs_filter:
        scaled = _filter_top_k_top_p(scaled, batch.top_ks, batch.top_ps)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    if batch.any_greedy:  # a full pass over the logits: only where some row needs it
        return torch.where(batch.temperatures == 0, logits.argmax(dim=-1), sampled)
    return sampled


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit outside the row's top-k and outside its smallest top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, -float("inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p: the most likely token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def largest_sampling_step(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, SamplingBatch]:
    """Random logits and settings for the sampler's most memory-hungry step: every row sampled through top-k
    and top-p. The engine runs it at start-up to size and reserve the sampler's memory."""
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=device)
    batch = SamplingBatch(temperatures=full(1.0, torch.float32), top_ks=full(50, torch.int64),
                          top_ps=full(0.9, torch.float32), generators=[None] * rows, all_greedy=False,
                          needs_filter=True)
    return torch.randn(rows, vocab, device=device), batch
