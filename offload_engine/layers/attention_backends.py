"""The device tier's attention backends behind one interface (docs/design.md, "Kernel contracts"), on the token-major
`[num_blocks, block_size, Hkv, D]` layout. "torch" runs anywhere; "triton" is our own kernels (gpu_kernels/: CUDA, or CPU
tensors under TRITON_INTERPRET=1); "flash-attn" is flash-attn 4 (any block size) or 2 (blocks of a multiple of 256).

A backend is a namespace of the kernel functions, and each operation names who serves it (`decode_name`,
`prefill_name`). Two operations stay on Triton whatever serves the rest, where it runs: prefill steps replayed by
prefill graphs (`tiled_prefill_attention`, cut by their tile map) and the streamed share's decode over a strided view
(`strided_decode_attention`). "auto" takes, per operation and shape class, what measured faster (AUTO_CHOICE).
flash-attn runs float16 and bfloat16 only: "auto" keeps other dtypes on Triton.
"""
import os
from types import SimpleNamespace

import torch

from offload_engine.layers import torch_attention

FLASH_ATTN_2_BLOCK_MULTIPLE = 256
FLASH_ATTN_4_MIN_CAPABILITY = 9  # Hopper
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
# "auto" on CUDA (docs/decisions/device-kernels.md, "flash-attn 4"): decode on Triton, which read KV as fast as
# flash-attn 4 or faster at every measured shape (it does not split the keys on Hopper); eager prefill on flash-attn 4
# where it is installed and a step's keys reach `long_prefill_keys` (1.2-1.3x the engine's prefill on 32k-262k
# prompts), on Triton below (equal kernels, and Triton's launches cost less on short chunks).
AUTO_CHOICE = {"decode": "triton", "prefill": "flash-attn", "long_prefill_keys": 8192}


def flash_attn_version(device: torch.device) -> int | None:
    """The flash-attn this process can run on `device`: 4 (Hopper or later), 2, or None."""
    if device.type != "cuda":
        return None
    from offload_engine.layers.flash_attn_backend import installed_version

    version = installed_version()
    if version == 4 and torch.cuda.get_device_capability(device)[0] < FLASH_ATTN_4_MIN_CAPABILITY:
        return None
    return version


def flash_attn_4_head_dim(head_dim: int, device: torch.device) -> bool:
    """Whether flash-attn 4 runs this head size in 16-bit (its own check, `_validate_head_dims`): multiples of 8 up to
    256 on Hopper; up to 128, or 256, on later GPUs."""
    if head_dim % 8 or head_dim < 8:
        return False
    return head_dim <= 256 if torch.cuda.get_device_capability(device)[0] == 9 else head_dim <= 128 or head_dim == 256


def select_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128) -> SimpleNamespace:
    """Resolves "auto" (per operation on CUDA; torch on the CPU) and checks a forced choice ("flash_attn" is
    "flash-attn", as vLLM users may spell it)."""
    name = "flash-attn" if name == "flash_attn" else name
    if name == "auto":
        if device.type != "cuda":
            return _torch_backend()
        import gpu_kernels

        if (AUTO_CHOICE["prefill"] == "flash-attn" and dtype in FLASH_ATTN_DTYPES
                and flash_attn_version(device) == 4 and flash_attn_4_head_dim(head_dim, device)):
            from offload_engine.layers.flash_attn_backend import FlashAttn4

            return _by_key_span(gpu_kernels, FlashAttn4, AUTO_CHOICE["long_prefill_keys"])
        return _backend(gpu_kernels, gpu_kernels, "triton", "triton", gpu_kernels)
    if name == "torch":
        return _torch_backend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs device='cuda' (on the CPU it runs only under "
                             "TRITON_INTERPRET=1, which is how the tests check it)")
        import gpu_kernels

        return _backend(gpu_kernels, gpu_kernels, "triton", "triton", gpu_kernels)
    if name == "flash-attn":
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"attention_backend='flash-attn' runs float16 and bfloat16, not {dtype}: use "
                             "dtype='bfloat16' or attention_backend='triton'")
        return _flash_attn(device, block_size, head_dim)
    raise ValueError(f"unknown attention_backend {name!r}: use 'auto', 'flash-attn', 'triton' or 'torch'")


def _flash_attn(device: torch.device, block_size: int, head_dim: int) -> SimpleNamespace:
    version = flash_attn_version(device)
    if version is None:
        raise ValueError("attention_backend='flash-attn' was forced but no flash-attn runs here (it needs a CUDA "
                         "device; flash-attn 4 a Hopper or later GPU): pip install 'offload-engine[flash-attn]', or "
                         "use 'auto' or 'triton'")
    if version == 4 and not flash_attn_4_head_dim(head_dim, device):
        raise ValueError(f"flash-attn 4 does not run heads of {head_dim} on this GPU (multiples of 8 up to 256 on "
                         "Hopper, up to 128 or 256 later): use attention_backend='triton'")
    if version == 2 and block_size % FLASH_ATTN_2_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn 2 needs block_size to be a multiple of {FLASH_ATTN_2_BLOCK_MULTIPLE}, got "
                         f"{block_size}: set block_size=256, install flash-attn 4, or use attention_backend='triton'")
    import gpu_kernels
    from offload_engine.layers.flash_attn_backend import implementation

    chosen = implementation(version)
    backend = _backend(chosen, chosen, "flash-attn", "flash-attn", gpu_kernels)
    backend.flash_attn_prefill = chosen.paged_prefill_attention
    return backend


def _by_key_span(triton, flash_attn, long_keys: int) -> SimpleNamespace:
    """Decode on Triton; eager prefill on flash-attn where a step's keys may reach long_keys (its table's width x
    block size: known on the host, no sync), on Triton below. Triton's identity-table hint (`contiguous`) goes to
    Triton only."""
    short, long = triton.paged_prefill_attention, flash_attn.paged_prefill_attention

    def paged_prefill_attention(q, k_cache, v_cache, block_tables, *args, contiguous: bool = False):
        if block_tables.shape[1] * k_cache.shape[1] >= long_keys:
            return long(q, k_cache, v_cache, block_tables, *args)
        return short(q, k_cache, v_cache, block_tables, *args, contiguous=contiguous)

    backend = _backend(triton, triton, "triton", f"flash-attn from {long_keys} keys, triton below", triton)
    backend.paged_prefill_attention, backend.flash_attn_prefill = paged_prefill_attention, long
    return backend


def _torch_backend() -> SimpleNamespace:
    backend = _backend(torch_attention, torch_attention, "torch", "torch", torch_attention)
    backend.tiled_prefill_attention = None  # no tile map: prefill graphs need Triton's kernel
    return backend


def _backend(decode, prefill, decode_name: str, prefill_name: str, ours) -> SimpleNamespace:
    """`ours`: gpu_kernels (Triton) or torch_attention: the K/V store, the merge, tiled prefill and strided decode."""
    return SimpleNamespace(
        name=decode_name if decode_name == prefill_name else f"{decode_name}+{prefill_name}",
        decode_name=decode_name, prefill_name=prefill_name,
        store_kvcache=ours.store_kvcache, merge_attn_states=ours.merge_attn_states,
        paged_decode_attention=decode.paged_decode_attention,
        paged_prefill_attention=prefill.paged_prefill_attention,
        tiled_prefill_attention=ours.paged_prefill_attention,
        strided_decode_attention=ours.paged_decode_attention,
        # flash-attn's prefill where it may serve eager prefill steps (compiled at start-up; zeroed caches), or None
        flash_attn_prefill=None,
        prefill_takes_contiguous=prefill is ours and ours.__name__ == "gpu_kernels",
    )
