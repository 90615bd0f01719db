"""Linear layers, including the fused ones whose weights arrive as separate checkpoint tensors.

Fusing q/k/v and gate/up turns three (two) GEMMs into one; `load_shard` copies one checkpoint tensor
into its rows of the fused weight, so the loader never needs to know the fusion.
"""
import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """One linear layer holding several checkpoint projections stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets, offset = {}, 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"checkpoint shard {shard!r} has {tensor.shape[0]} rows, the model expects {size}")
        param.data[offset : offset + size].copy_(tensor)
