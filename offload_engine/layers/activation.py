import torch
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU on a fused gate/up projection: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
