"""Token sampling: greedy, temperature, top-k and top-p, in one pass over the logits (gpu_kernels/sample.py); the rarer
settings (penalties, min_tokens, min_p) change the logits first where a row has them (logits_processing.py). A row at
temperature t takes argmax(x / t + G), G Gumbel noise from Philox under the row's 64-bit key: an exact draw from
softmax(x / t). A seeded request's key comes from its seed and its token's position, so its tokens depend on neither
batch, chunking, lane nor CUDA graphs. Top-k and top-p filter the scaled logits first (a sort).
"""
from dataclasses import dataclass

import numpy as np
import torch

from gpu_kernels.sample import sample_tokens
from offload_engine.layers.logits_processing import LogitsProcessing, apply_min_p, penalize
from offload_engine.layers.philox import philox_uniform

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor | None  # [B] float32, 0 for greedy rows; None when every row is greedy
    keys: torch.Tensor | None  # [B] int64 Philox keys (sampling_keys)
    top_ks: torch.Tensor | None = None  # [B] int64, the vocabulary's size where off; only with needs_filter
    top_ps: torch.Tensor | None = None  # [B] float32, 1 where off; only with needs_filter
    needs_filter: bool = False  # some row has top-k or top-p on: only then is the vocabulary sorted
    processing: LogitsProcessing | None = None  # penalties, min_tokens, min_p (logits_processing.py)

    @property
    def all_greedy(self) -> bool:
        return self.temperatures is None


def sample(logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64 (into `out` where given). No host syncs: it runs inside CUDA graphs."""
    processing = batch.processing
    if processing is not None:
        logits = penalize(logits, processing)
    if batch.all_greedy:
        return torch.argmax(logits, dim=-1, out=out) if out is not None else logits.argmax(dim=-1)
    temperatures = batch.temperatures
    min_ps = processing.min_ps if processing is not None else None
    if batch.needs_filter or min_ps is not None:
        sampled = temperatures > 0
        scaled = logits / torch.where(sampled, temperatures, 1.0).unsqueeze(1)
        if min_ps is not None:
            scaled = apply_min_p(scaled, torch.where(sampled, min_ps, 0.0))  # greedy rows keep every logit
        logits = _filter_top_k_top_p(scaled, batch.top_ks, batch.top_ps) if batch.needs_filter else scaled
        temperatures = sampled.to(torch.float32)  # already scaled: the kernel divides by 1
    if logits.is_cuda:
        return sample_tokens(logits, temperatures, batch.keys, out=out)
    ids = _sample_with_torch(logits, temperatures, batch.keys)
    return out.copy_(ids) if out is not None else ids


def _sample_with_torch(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """What gpu_kernels/sample.py computes, for CPU tensors."""
    scores = logits.float()
    rows = (temperatures > 0).nonzero().squeeze(1)
    if rows.numel():
        noise = -torch.log(-torch.log(philox_uniform(keys[rows], logits.shape[1])))
        scores = scores.index_copy(0, rows, scores[rows] / temperatures[rows].unsqueeze(1) + noise)
    return scores.argmax(dim=-1)


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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads nearby inputs (seeds, positions) over unrelated keys."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sampling_keys(seeds: list[int | None], positions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each row's int64 Philox key: seeded rows' from seed and position, the others drawn from the lane's `rng`."""
    keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=len(seeds), dtype=np.int64,
                        endpoint=True)
    seeded = [row for row, seed in enumerate(seeds) if seed is not None]
    if seeded:
        with np.errstate(over="ignore"):
            seed_words = np.array([seeds[row] % 2**64 for row in seeded], dtype=np.uint64)
            steps = positions[seeded].astype(np.uint64)
            keys[seeded] = _mix(_mix(seed_words) + _GOLDEN * (steps + np.uint64(1))).view(np.int64)
    return keys


def largest_sampling_step(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, SamplingBatch]:
    """Logits and settings of the sampler's most memory-hungry step (every row through top-k and top-p), which
    start-up runs to size and reserve the sampler's memory."""
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=device)
    batch = SamplingBatch(temperatures=full(1.0, torch.float32), keys=torch.randint(0, 2**62, (rows,), device=device),
                          top_ks=full(50, torch.int64), top_ps=full(0.9, torch.float32), needs_filter=True)
    return torch.randn(rows, vocab, device=device), batch
