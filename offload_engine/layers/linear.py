"""Linear layers: replicated, column-parallel (fused q/k/v and gate/up among them: one GEMM) and row-parallel; with
one rank (tp = Partition()) each is the plain layer. `load_weight(param, tensor, shard)` copies this rank's part of the
whole checkpoint tensor, or of a lazy slice that reads only what is narrowed (loader.py)."""
import torch
from torch import nn

from gpu_kernels import skinny_gemm
from offload_engine.distributed.parallel_state import Partition, all_reduce
from offload_engine.layers.fused import use_fused

WHOLE = Partition()
SKINNY_ROWS = skinny_gemm.MAX_ROWS  # decode steps of at most this many rows may take it


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): torch's GEMM, or, for a decode step's few rows and a weight of the shapes it reads
    faster (gpu_kernels.skinny_gemm.pays), the kernel that streams the weight once (layers/fused.py, "skinny_gemm")."""
    if (x.dim() == 2 and x.shape[0] <= SKINNY_ROWS and x.stride(-1) == 1 and use_fused(x, "skinny_gemm")
            and skinny_gemm.pays(*weight.shape, x.device)):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_weight(self, param: nn.Parameter, tensor, shard: str | None = None) -> None:
        param.data.copy_(_narrowed(tensor, tuple(param.shape), 0, 0, param.shape[0]))


class ColumnParallelLinear(Linear):
    """Holds output features [rank * out / size, (rank + 1) * out / size); its output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Partition = WHOLE):
        super().__init__(in_features, tp.share(out_features), bias)
        self.tp, self.out_features = tp, out_features

    def load_weight(self, param: nn.Parameter, tensor, shard: str | None = None) -> None:
        whole = (self.out_features, *param.shape[1:])
        param.data.copy_(_narrowed(tensor, whole, 0, self.tp.start(self.out_features), param.shape[0]))


class FusedLinear(ColumnParallelLinear):
    """Column-parallel over checkpoint projections stacked along the output; each rank holds its share of every
    part, in the parts' order (its own q, k and v heads side by side)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False, tp: Partition = WHOLE):
        super().__init__(in_features, sum(shard_sizes.values()), bias, tp)
        self.shard_sizes, self.shard_offsets, offset = dict(shard_sizes), {}, 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, tp.share(size))  # in this rank's weight
            offset += tp.share(size)

    def load_weight(self, param: nn.Parameter, tensor, shard: str | None = None) -> None:
        whole = self.shard_sizes[shard]
        offset, size = self.shard_offsets[shard]
        part = _narrowed(tensor, (whole, *param.shape[1:]), 0, self.tp.start(whole), size)
        param.data[offset : offset + size].copy_(part)


class RowParallelLinear(Linear):
    """Holds input features [rank * in / size, (rank + 1) * in / size); one all-reduce sums the ranks' outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Partition = WHOLE):
        super().__init__(tp.share(in_features), out_features, bias)
        self.tp, self.in_features = tp, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = all_reduce(linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)  # once, not once per rank

    def load_weight(self, param: nn.Parameter, tensor, shard: str | None = None) -> None:
        if param is self.bias:  # whole on every rank
            return super().load_weight(param, tensor)
        whole = (param.shape[0], self.in_features)
        param.data.copy_(_narrowed(tensor, whole, 1, self.tp.start(self.in_features), param.shape[1]))


def _narrowed(tensor, whole: tuple, dim: int, start: int, length: int) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(whole):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the config implies {tuple(whole)}")
    return tensor.narrow(dim, start, length)
