"""The device tier's attention backends behind one interface (docs/design.md, "Kernel contracts"), on the token-major
`[num_blocks, block_size, Hkv, D]` layout. "torch" runs anywhere; "triton" is our own kernels (CUDA, or CPU tensors
under TRITON_INTERPRET=1); "flash-attn" is flash-attn 4 (any block size) or 2 (blocks of a multiple of 256).

A backend is a namespace of the kernel functions, and each operation names who serves it (`decode_name`,
`prefill_name`). Two operations stay on Triton whatever serves the rest, where it runs: prefill steps replayed by
prefill graphs (`tiled_prefill_attention`, cut by their tile map) and the streamed share's decode over a strided view
(`strided_decode_attention`). "auto" takes, per operation, what measured faster (AUTO_CHOICE; docs/results.md).
"""
import os
from types import SimpleNamespace

import torch

from offload_engine.layers import torch_attention

FLASH_ATTN_2_BLOCK_MULTIPLE = 256
FLASH_ATTN_4_MIN_CAPABILITY = 9  # Hopper
# "auto" on CUDA, per operation: decode on Triton, which read KV at least as fast as flash-attn 4 at blocks of 16 in
# issue 62's runs (1.0-1.2x; 11x at 1 x 128k, where flash-attn 4 did not split), and prefill on flash-attn 4 where it
# is installed: 616-632 TFLOP/s causal there, SDPA's rate, where our kernel reaches 0.72 of SDPA's on long chunks
# (docs/results.md). To be confirmed side by side by bench_gpu_attention.py on each GPU.
AUTO_CHOICE = {"decode": "triton", "prefill": "flash-attn"}


def flash_attn_version(device: torch.device) -> int | None:
    """The flash-attn this process can run on `device`: 4 (Hopper or later), 2, or None."""
    if device.type != "cuda":
        return None
    from offload_engine.layers.flash_attn_backend import installed_version

    version = installed_version()
    if version == 4 and torch.cuda.get_device_capability(device)[0] < FLASH_ATTN_4_MIN_CAPABILITY:
        return None
    return version


def select_backend(name: str, device: torch.device, block_size: int) -> SimpleNamespace:
    """Resolves "auto" (per operation on CUDA; torch on the CPU) and checks a forced choice ("flash_attn" is
    "flash-attn", as vLLM users may spell it)."""
    name = "flash-attn" if name == "flash_attn" else name
    if name == "auto":
        if device.type != "cuda":
            return _torch_backend()
        import kernels

        prefill = kernels
        if AUTO_CHOICE["prefill"] == "flash-attn" and flash_attn_version(device) == 4:
            from offload_engine.layers.flash_attn_backend import FlashAttn4

            prefill = FlashAttn4
        return _backend(kernels, prefill, "triton", getattr(prefill, "name", "triton"), kernels)
    if name == "torch":
        return _torch_backend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs device='cuda' (on the CPU it runs only under "
                             "TRITON_INTERPRET=1, which is how the tests check it)")
        import kernels

        return _backend(kernels, kernels, "triton", "triton", kernels)
    if name == "flash-attn":
        return _flash_attn(device, block_size)
    raise ValueError(f"unknown attention_backend {name!r}: use 'auto', 'flash-attn', 'triton' or 'torch'")


def _flash_attn(device: torch.device, block_size: int) -> SimpleNamespace:
    version = flash_attn_version(device)
    if version is None:
        raise ValueError("attention_backend='flash-attn' was forced but no flash-attn runs here (it needs a CUDA "
                         "device; flash-attn 4 a Hopper or later GPU): pip install 'offload-engine[flash-attn]', or "
                         "use 'auto' or 'triton'")
    if version == 2 and block_size % FLASH_ATTN_2_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn 2 needs block_size to be a multiple of {FLASH_ATTN_2_BLOCK_MULTIPLE}, got "
                         f"{block_size}: set block_size=256, install flash-attn 4, or use attention_backend='triton'")
    import kernels
    from offload_engine.layers.flash_attn_backend import implementation

    chosen = implementation(version)
    return _backend(chosen, chosen, "flash-attn", "flash-attn", kernels)


def _torch_backend() -> SimpleNamespace:
    backend = _backend(torch_attention, torch_attention, "torch", "torch", torch_attention)
    backend.tiled_prefill_attention = None  # no tile map: prefill graphs need Triton's kernel
    return backend


def _backend(decode, prefill, decode_name: str, prefill_name: str, ours) -> SimpleNamespace:
    """`ours`: kernels (Triton) or torch_attention: the K/V store, the merge, tiled prefill and strided decode."""
    return SimpleNamespace(
        name=decode_name if decode_name == prefill_name else f"{decode_name}+{prefill_name}",
        decode_name=decode_name, prefill_name=prefill_name,
        store_kvcache=ours.store_kvcache, merge_attn_states=ours.merge_attn_states,
        paged_decode_attention=decode.paged_decode_attention,
        paged_prefill_attention=prefill.paged_prefill_attention,
        tiled_prefill_attention=ours.paged_prefill_attention,
        strided_decode_attention=ours.paged_decode_attention,
    )
