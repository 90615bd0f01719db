"""flash-attn behind our kernel contract (docs/design.md, "Kernel contracts"), imported only where it is installed.

flash-attn 4 (`flash_attn.cute`, Hopper and later) reads the token-major paged caches `[blocks, block_size, Hkv, D]`
at any block size through `page_table` and `seqused_k`, takes GQA and chunks aligned to the end of their keys
(causal), and returns the log-sum-exp the merges need. flash-attn 2 needs blocks of a multiple of 256: its functions
serve such caches, and Triton the others (staging caches of a host block's size). Contract as our kernels': rows
without keys come back with out 0 and lse -inf; block tables' -1 padding is never read. flash-attn 4 may load a
partial last page whole, so the caches it reads hold finite values past each row's end (the device pool is zeroed
when allocated; staging caches are zeroed for it).
"""
import functools
import importlib
import importlib.util
import math

import torch

import gpu_kernels
from gpu_kernels import merge_attn_states, store_kvcache  # noqa: F401  (part of the backend interface)

FA2_PAGE_MULTIPLE = 256


def installed_version() -> int | None:
    """4 where flash_attn.cute imports, 2 where only flash-attn 2's interface does, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    for version, module in ((4, "flash_attn.cute.interface"), (2, "flash_attn.flash_attn_interface")):
        try:
            importlib.import_module(module)
            return version
        except Exception:  # noqa: BLE001 - an install for another CUDA or GPU fails in many ways: not usable here
            continue
    return None


def _varlen():
    from flash_attn.cute.interface import flash_attn_varlen_func

    return flash_attn_varlen_func


def _pages(block_tables: torch.Tensor) -> torch.Tensor:
    """The page table flash-attn 4 reads: int32, contiguous, padding (-1) pointed at page 0 (masked by seqused_k)."""
    return block_tables.clamp_min(0).to(torch.int32)


@functools.cache
def _default_splits(device: torch.device) -> int:
    return 1 if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 else 0


def _without_keys(out: torch.Tensor, lse: torch.Tensor, has_keys: torch.Tensor):
    """Rows (tokens) with no keys: out 0, lse -inf, whatever the kernel left there."""
    out = out.masked_fill(~has_keys.view(-1, *([1] * (out.dim() - 1))), 0.0)
    return out, lse.float().masked_fill(~has_keys.view(-1, 1), -math.inf)


def _empty(q: torch.Tensor):
    return torch.zeros_like(q), torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)


class FlashAttn4:
    """flash-attn 4's `flash_attn_varlen_func` on our contract."""

    name = "flash-attn"

    @staticmethod
    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int | None = None):
        """num_splits: along the keys; 0 lets flash-attn choose from the batch and the SMs (long contexts split),
        None: 0 where flash-attn 4 splits, 1 on Hopper, where it does not ("SplitKV not supported on SM 9.0")."""
        if q.shape[0] == 0:
            return _empty(q)
        splits = _default_splits(q.device) if num_splits is None else num_splits
        out, lse = _varlen()(q.unsqueeze(1), k_cache, v_cache, seqused_k=context_lens, page_table=_pages(block_tables),
                             softmax_scale=scale, causal=False, num_splits=splits, return_lse=True)
        return _without_keys(out.squeeze(1), lse.squeeze(-1), context_lens > 0)  # lse [B, Hq, 1] -> [B, Hq]

    @staticmethod
    def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                max_seqlen_q: int):
        if q.shape[0] == 0 or max_seqlen_q == 0:
            return _empty(q)
        out, lse = _varlen()(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                             seqused_k=context_lens, page_table=_pages(block_tables), softmax_scale=scale, causal=True,
                             return_lse=True)
        has_keys = torch.repeat_interleave(context_lens > 0, cu_seqlens_q.diff().long(), output_size=q.shape[0])
        return _without_keys(out, lse.transpose(0, 1).contiguous(), has_keys)  # lse [Hq, T] -> [T, Hq]


class FlashAttn2:
    """flash-attn 2's paged functions where the block size allows (a multiple of 256), Triton elsewhere."""

    name = "flash-attn"

    @staticmethod
    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        if k_cache.shape[1] % FA2_PAGE_MULTIPLE:
            return gpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        from flash_attn import flash_attn_with_kvcache

        out, lse = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens, block_table=block_tables.clamp_min(0),
            softmax_scale=scale, causal=True, return_softmax_lse=True)
        return out.squeeze(1), lse.squeeze(-1).float()

    @staticmethod
    def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q):
        if k_cache.shape[1] % FA2_PAGE_MULTIPLE:
            return gpu_kernels.paged_prefill_attention(
                q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q)
        from flash_attn import flash_attn_varlen_func

        cu_seqlens_k = torch.nn.functional.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        out, lse, _ = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=k_cache.shape[1] * block_tables.shape[1], softmax_scale=scale, causal=True,
            block_table=block_tables.clamp_min(0), return_attn_probs=True)
        return out, lse.transpose(0, 1).float()  # flash-attn's varlen lse is [H, T]


def implementation(version: int):
    return FlashAttn4 if version == 4 else FlashAttn2
