"""Rotary position embedding (the rotate-half form of Llama/Qwen), with Llama-3 frequency scaling."""
import math

import torch
from torch import nn

from offload_engine.layers.fused import use_fused


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: dict):
        super().__init__()
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = rope["rope_type"]
        if rope_type == "llama3":
            inv_freq = _llama3_scaled(inv_freq, rope)
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported: use 'default' or 'llama3'")
        positions = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        # cos/sin in float32 whatever the model dtype: positions past ~2k lose their phase in bf16.
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] rotated by their token positions [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


    def norm_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None,
                        store=None):
        """q and k normalized per head (Qwen3's q_norm, k_norm; or None) and rotated, one kernel each on CUDA. store:
        a gpu_kernels.KVStore the k kernel also writes k and v into (where layers.fused.stores_kv_ahead says so)."""
        if use_fused(q, "norm_rope"):
            from gpu_kernels import norm_rope

            fused = lambda x, norm, store=None: norm_rope(x, positions, self.cos, self.sin,
                                                          None if norm is None else norm.weight,
                                                          0.0 if norm is None else norm.eps, store)
            return fused(q, q_norm), fused(k, k_norm, store)
        if store is not None:
            raise ValueError("a K/V store inside the rotation needs the fused norm_rope kernel (layers/fused.py)")
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return self(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor, torch.where(wavelen < original / high, inv_freq, blended))
