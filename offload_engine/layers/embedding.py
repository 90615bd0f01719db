"""The token embedding and the LM head, vocab-parallel under tensor parallelism: each rank holds one contiguous
vocabulary range, padded to a multiple of the ranks with zero rows no id reaches. The embedding sums the ranks'
lookups; the head all-gathers the logits, so every rank samples the same ids and no token crosses between ranks.
"""
import torch
from torch import nn

from offload_engine.distributed.parallel_state import Partition, all_gather, all_reduce
from offload_engine.layers.linear import linear

WHOLE = Partition()


class _VocabRows(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: Partition):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        padded = -(-vocab_size // tp.size) * tp.size
        self.rows = tp.share(padded)  # this rank's vocabulary range: [first, first + rows)
        self.first = tp.start(padded)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.real_rows = max(0, min(self.rows, vocab_size - self.first))  # the rest is padding
        self.weight.data[self.real_rows :].zero_()

    def load_weight(self, param: nn.Parameter, tensor, shard: str | None = None) -> None:
        whole = (self.vocab_size, param.shape[1])
        if tuple(tensor.shape) != whole:
            raise ValueError(f"has shape {tuple(tensor.shape)}, the config implies {whole}")
        param.data[: self.real_rows].copy_(tensor.narrow(0, self.first, self.real_rows))


class VocabEmbedding(_VocabRows):
    def __init__(self, vocab_size: int, hidden_size: int, tp: Partition = WHOLE):
        super().__init__(vocab_size, hidden_size, tp)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(token_ids, self.weight)
        local = token_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        hidden = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(_VocabRows):
    """Projects hidden states to float32 logits; only the rows that will be sampled are passed in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Partition = WHOLE):
        super().__init__(vocab_size, hidden_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(hidden, self.weight).float()
        logits = all_gather(linear(hidden, self.weight), dim=-1)
        if logits.shape[-1] != self.vocab_size:  # the padding's columns go; the sampler wants whole rows
            logits = logits[..., : self.vocab_size].contiguous()
        return logits.float()
