"""What SamplingParams changes in a step's logits besides temperature, top-k and top-p, in vLLM's order: repetition,
frequency and presence penalties and min_tokens' bans on the model's logits; then (sampler.py) temperature; then min_p
on the scaled logits; then top-k / top-p. And each chosen token's log-probability with the top-k (`logprobs`).

Only a step with such a row builds any of this: the others sample as before, in one pass (gpu_kernels/sample.py).
"""
from dataclasses import dataclass

import numpy as np
import torch

PROMPT_LOGITS_ROWS = 512  # prompt tokens whose logits (rows x vocab, float32) prompt_logprobs makes at once


@dataclass
class LogitsProcessing:
    """A step's per-row settings on the device, neutral in rows that have none (0 penalties, repetition 1, min_p 0).
    output_tokens / prompt_tokens: [rows, longest] int64, -1 padded (None: no row needs them); banned: (rows, token
    ids) int64 pairs that min_tokens keeps from being drawn (None: none)."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_ps: torch.Tensor | None
    output_tokens: torch.Tensor | None
    prompt_tokens: torch.Tensor | None
    banned: tuple[torch.Tensor, torch.Tensor] | None


def logits_processing(seqs: list, to_device, pending: dict[int, int] | None = None) -> LogitsProcessing | None:
    """The rows' settings (None where no row is SamplingParams.processed); seqs are engine Sequences (their params,
    tokens and min_tokens_bans); to_device(array, dtype) -> tensor; pending: seq_id -> the id of its newest token
    where the host holds only its place (async scheduling: penalties must count it)."""
    params = [seq.params for seq in seqs]
    if not any(p.processed for p in params):
        return None
    column = lambda name: to_device(np.array([getattr(p, name) for p in params], np.float32), torch.float32)
    penalized = any(p.penalized for p in params)
    repeated = any(p.repetition_penalty != 1 for p in params)
    outputs = [_known(seq, pending) if p.penalized else [] for seq, p in zip(seqs, params)]
    prompts = [seq.token_ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1 else []
               for seq, p in zip(seqs, params)]
    return LogitsProcessing(
        presence=column("presence_penalty"), frequency=column("frequency_penalty"),
        repetition=column("repetition_penalty"),
        min_ps=column("min_p") if any(p.min_p > 0 for p in params) else None,
        output_tokens=to_device(_padded(outputs), torch.int64) if penalized else None,
        prompt_tokens=to_device(_padded(prompts), torch.int64) if repeated else None,
        banned=_banned(seqs, to_device))


def _known(seq, pending: dict[int, int] | None) -> list[int]:
    """The completion's ids, a pending newest one (negative) replaced by its id from `pending`."""
    ids = seq.completion_token_ids
    if ids and ids[-1] < 0 and pending and seq.seq_id in pending:
        ids = ids[:-1] + [pending[seq.seq_id]]
    return ids


def _padded(rows: list[list[int]]) -> np.ndarray:
    out = np.full((len(rows), max(1, max(map(len, rows)))), -1, np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _banned(seqs: list, to_device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs: eos and stop tokens of rows that have made fewer than min_tokens tokens."""
    pairs = [(row, token) for row, seq in enumerate(seqs)
             if len(seq.token_ids) - seq.num_prompt_tokens < seq.params.min_tokens for token in seq.min_tokens_bans]
    if not pairs:
        return None
    rows, tokens = np.array(pairs, np.int64).T
    return to_device(rows, torch.int64), to_device(tokens, torch.int64)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32: how often each id is in the row (-1 padding counts nowhere)."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, torch.where(tokens < 0, vocab, tokens), torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


def penalize(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """float32 logits with the rows' penalties and bans applied (a new tensor)."""
    x = logits.float().clone()
    vocab = x.shape[1]
    if proc.output_tokens is not None:
        counts = _counts(proc.output_tokens, vocab)
        seen = counts > 0
        if proc.prompt_tokens is not None:
            repeated = seen | (_counts(proc.prompt_tokens, vocab) > 0)
            penalty = proc.repetition.unsqueeze(1)
            x = torch.where(repeated, torch.where(x > 0, x / penalty, x * penalty), x)
        x -= proc.frequency.unsqueeze(1) * counts + proc.presence.unsqueeze(1) * seen
    if proc.banned is not None:
        x[proc.banned] = -float("inf")
    return x


def apply_min_p(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drops (-inf) every token whose probability under the scaled logits is below min_p x the likeliest's."""
    probs = scaled.softmax(dim=-1)
    keep = probs >= min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(~keep, -float("inf"))


@dataclass
class TokenLogprobs:
    """Device tensors for the rows that asked: the chosen token's log-probability and rank (1 + tokens strictly
    likelier), and the top-k ids and log-probabilities (k = the most any row asked; rows cut theirs on the host)."""

    rows: list[int]
    ks: list[int]
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self) -> list[tuple]:
        """Per row that asked: (chosen logprob, rank, [(id, logprob)] of its top-k, best first)."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        ids, lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [(chosen[i], ranks[i], list(zip(ids[i][:k], lps[i][:k]))) for i, k in enumerate(self.ks)]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]) -> TokenLogprobs | None:
    """Log-probabilities of tokens[r] under logits[r] (the model's, unprocessed) for the rows whose k is not None."""
    rows = [r for r, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    lp = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max(ks[r] for r in rows)
    top = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    top_lps, top_ids = (top.values, top.indices) if k > 0 else top
    return TokenLogprobs(rows, [ks[r] for r in rows], chosen, ranks, top_ids, top_lps)


def record_logprobs(seqs: list, positions: list[int], tokens: list[int], found: TokenLogprobs | None):
    """Each asking row's entry at the position its token takes: seq.token_logprobs[position]."""
    if found is None:
        return
    for row, entry in zip(found.rows, found.to_host()):
        seqs[row].token_logprobs[positions[row]] = (tokens[row], *entry)


def record_prompt_logprobs(seqs: list, hidden: torch.Tensor, compute_logits) -> None:
    """For rows with SamplingParams.prompt_logprobs: each prompt token's log-probability given the tokens before it,
    from a prefill chunk's hidden states [T, H] (the rows' scheduled tokens in order; token p's predicts token p + 1),
    PROMPT_LOGITS_ROWS at a time."""
    begin = 0
    for seq in seqs:
        count, start = seq.num_scheduled_tokens, seq.num_computed_tokens
        k = seq.params.prompt_logprobs
        ends = min(start + count, seq.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
        for first in range(start, ends, PROMPT_LOGITS_ROWS) if k is not None else ():
            last = min(first + PROMPT_LOGITS_ROWS, ends)
            rows = hidden[begin + first - start: begin + last - start]
            nexts = seq.token_ids[first + 1: last + 1]
            found = token_logprobs(compute_logits(rows), torch.tensor(nexts, device=rows.device), [k] * len(nexts))
            record_logprobs([seq] * len(nexts), list(range(first + 1, last + 1)), nexts, found)
        begin += count
