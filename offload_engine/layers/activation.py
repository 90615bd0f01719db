import torch
from torch import nn

from gpu_kernels.silu_and_mul import silu_and_mul
from offload_engine.layers.fused import use_fused


class SiluAndMul(nn.Module):
    """SwiGLU on a fused gate/up projection: silu(gate) * up (one Triton kernel on CUDA: gpu_kernels/silu_and_mul.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x, "silu_and_mul") and x.dim() == 2 and x.stride(-1) == 1:
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
