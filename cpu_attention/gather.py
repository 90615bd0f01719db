"""Block copies between a host cache and a packed buffer, on numba's threads.

gather_blocks: chosen blocks of the cache into a packed buffer (prefix staging for prefill, staged promotion).
scatter_blocks: a packed buffer into chosen blocks of the cache (staged demotion from the device pool).
Layout: any [num_blocks, ...] contiguous cache; the buffer [len(block_ids), ...] contiguous, same dtype. Blocks
are copied as bit patterns (no widening), in parallel over blocks. Not torch.index_select: a multi-threaded torch
CPU op on the engine's thread starts torch's OpenMP team beside numba's and slows the decode kernel for the rest
of the process (docs/decisions/host-kernel.md, "Bulk host copies on numba's threads").
"""
import torch
from numba import njit, prange

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@njit(parallel=True, nogil=True, cache=True)
def _gather_kernel(src, block_ids, out):
    for i in prange(block_ids.shape[0]):
        out[i, :] = src[block_ids[i], :]


@njit(parallel=True, nogil=True, cache=True)
def _scatter_kernel(packed, block_ids, dst):
    for i in prange(block_ids.shape[0]):
        dst[block_ids[i], :] = packed[i, :]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = cache[block_ids[i]] for every i; returns out."""
    ids = _checked("gather_blocks", cache, block_ids, out)
    _gather_kernel(_rows(cache), ids, _rows(out))
    return out


def scatter_blocks(packed: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    """cache[block_ids[i]] = packed[i] for every i (ids distinct)."""
    ids = _checked("scatter_blocks", cache, block_ids, packed)
    _scatter_kernel(_rows(packed), ids, _rows(cache))


def _checked(name: str, cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor):
    if not (cache.is_contiguous() and packed.is_contiguous()) or cache.dtype != packed.dtype:
        raise ValueError(f"{name} needs contiguous cache and buffer tensors of one dtype")
    if packed.shape[0] != block_ids.shape[0] or packed.shape[1:] != cache.shape[1:]:
        raise ValueError(f"{name}: buffer {tuple(packed.shape)} does not hold {block_ids.shape[0]} blocks of "
                         f"{tuple(cache.shape[1:])}")
    ids = block_ids.to(torch.int64).contiguous().numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= cache.shape[0]):
        raise ValueError(f"{name}: block ids must be in [0, {cache.shape[0]})")
    return ids


def _rows(t: torch.Tensor):
    """[n, ...] as an [n, row] array of bit patterns of the element's width."""
    return t.view(_BITS[t.element_size()]).reshape(t.shape[0], -1).numpy()
