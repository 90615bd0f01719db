"""gather_blocks: copies chosen blocks of a host cache into a packed buffer (prefix staging for prefill).

Layout: any [num_blocks, ...] contiguous cache; out [len(block_ids), ...] contiguous, same dtype. Blocks are
copied as bit patterns (no widening), in parallel over blocks on numba's threads.

Why not torch.index_select: a multi-threaded torch CPU op on the engine's thread starts torch's own OpenMP
team beside numba's, and on the 16-core GPU host that halved the decode kernel's speed for the rest of the
process (measured: 76 ms -> 165 ms of kernel time per Qwen3-0.6B step, benchmarks/profile_host_tier.py).
Keeping every bulk host copy on numba's pool, on the executor thread, avoids the second team.
"""
import torch
from numba import njit, prange

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@njit(parallel=True, nogil=True, cache=True)
def _gather_kernel(src, block_ids, out):
    for i in prange(block_ids.shape[0]):
        out[i, :] = src[block_ids[i], :]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = cache[block_ids[i]] for every i; returns out."""
    if not (cache.is_contiguous() and out.is_contiguous()) or cache.dtype != out.dtype:
        raise ValueError("gather_blocks needs contiguous cache and out tensors of one dtype")
    if out.shape[0] != block_ids.shape[0] or out.shape[1:] != cache.shape[1:]:
        raise ValueError(f"gather_blocks: out {tuple(out.shape)} does not hold {block_ids.shape[0]} blocks of "
                         f"{tuple(cache.shape[1:])}")
    ids = block_ids.to(torch.int64).contiguous().numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= cache.shape[0]):
        raise ValueError(f"gather_blocks: block ids must be in [0, {cache.shape[0]})")
    bits = _BITS[cache.element_size()]
    _gather_kernel(cache.view(bits).reshape(cache.shape[0], -1).numpy(), ids,
                   out.view(bits).reshape(out.shape[0], -1).numpy())
    return out
