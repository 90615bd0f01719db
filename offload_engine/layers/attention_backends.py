"""The device tier's attention backends behind one interface (docs/design.md, "Kernel contracts"), on the token-major
`[num_blocks, block_size, Hkv, D]` layout. "torch" runs anywhere; "triton" is our own kernels (CUDA, or CPU tensors
under TRITON_INTERPRET=1); "flash-attn" uses flash-attn's paged functions where its block size allows, Triton elsewhere.
"""
import importlib.util
import os
from types import SimpleNamespace

import torch

from offload_engine.layers import torch_attention

FLASH_ATTN_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def select_backend(name: str, device: torch.device, block_size: int) -> SimpleNamespace:
    """Resolves "auto" (flash-attn, else Triton on CUDA; torch on the CPU) and checks a forced choice."""
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif flash_attn_available() and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0:
            name = "flash-attn"
        else:
            name = "triton"
    if name == "torch":
        return _namespace("torch", torch_attention)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs device='cuda' (on the CPU it runs only under "
                             "TRITON_INTERPRET=1, which is how the tests check it)")
        import kernels

        return _namespace("triton", kernels)
    if name == "flash-attn":
        if not flash_attn_available():
            raise ValueError("attention_backend='flash-attn' was forced but flash_attn is not importable: "
                             "pip install flash-attn, or use 'triton'")
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"flash-attn needs block_size to be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}, "
                             f"got {block_size}: set block_size=256 or use attention_backend='triton'")
        from offload_engine.layers import flash_attn_backend

        return _namespace("flash-attn", flash_attn_backend)
    raise ValueError(f"unknown attention_backend {name!r}")


def _namespace(name, module) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        store_kvcache=module.store_kvcache,
        paged_decode_attention=module.paged_decode_attention,
        paged_prefill_attention=module.paged_prefill_attention,
        merge_attn_states=module.merge_attn_states,
    )
