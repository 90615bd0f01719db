"""store_kvcache on the host: the new tokens' K/V rows into the head-major caches, in place.

Caches [num_blocks, Hkv, block_size, D]: token i with slot s = block * block_size + offset lands in
cache[block, h, offset, :] for every kv head h; slot -1 is skipped. Elements are copied as bit patterns, so one
compiled kernel per element size serves the three dtypes. A numba loop, not torch indexing: nothing allocated per
call, and the GIL released, like the decode kernel it runs beside.
"""
import numpy as np
import torch
from numba import njit, prange

_BITS = {2: torch.int16, 4: torch.int32}


PARALLEL_MIN_TOKENS = 64  # a decode step writes one token per sequence: too few to wake numba's thread pool


@njit(nogil=True, cache=True)
def _first_bad_slot(slots, num_slots):
    """1 + the index of the first slot outside [-1, num_slots), or 0: checked before any write (all or nothing)."""
    for i in range(slots.shape[0]):
        if slots[i] < -1 or slots[i] >= num_slots:
            return i + 1
    return 0


@njit(nogil=True, cache=True, inline="always")
def _store_token(key, value, k_cache, v_cache, i, slot):
    block_size = k_cache.shape[2]
    block, offset = slot // block_size, slot % block_size
    for h in range(k_cache.shape[1]):  # explicit loops: numba's slice assignment is ~6x slower here
        for d in range(k_cache.shape[3]):
            k_cache[block, h, offset, d] = key[i, h, d]
        for d in range(k_cache.shape[3]):
            v_cache[block, h, offset, d] = value[i, h, d]


@njit(nogil=True, cache=True)
def _store_serial(key, value, k_cache, v_cache, slots):
    for i in range(slots.shape[0]):
        if slots[i] >= 0:
            _store_token(key, value, k_cache, v_cache, i, slots[i])


@njit(nogil=True, cache=True, parallel=True)
def _store_parallel(key, value, k_cache, v_cache, slots):
    """Prefill writes thousands of tokens a layer, far more than one thread moves at host bandwidth
    (docs/decisions/host-kernel.md, "Parallel host store"). Slots are distinct (each names one token's place), so
    tokens can be written by any thread."""
    for i in prange(slots.shape[0]):
        if slots[i] >= 0:
            _store_token(key, value, k_cache, v_cache, i, slots[i])


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """key/value [N, Hkv, D] (the caches' dtype) into caches [num_blocks, Hkv, block_size, D] at slot_mapping [N]."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    bits = _BITS[k_cache.element_size()]
    slots = slot_mapping.to(torch.int64).contiguous()
    slots_np = slots.numpy()
    bad = _first_bad_slot(slots_np, k_cache.shape[0] * k_cache.shape[2])
    if bad:
        raise ValueError(f"store_kvcache: slot_mapping[{bad - 1}] = {int(slots[bad - 1])} is outside the cache "
                         f"(valid: -1 to skip, or 0..{k_cache.shape[0] * k_cache.shape[2] - 1})")
    kernel = _store_parallel if slots_np.shape[0] >= PARALLEL_MIN_TOKENS else _store_serial
    kernel(_bits_view(key.contiguous(), bits), _bits_view(value.contiguous(), bits), _bits_view(k_cache, bits),
           _bits_view(v_cache, bits), slots_np)


def _bits_view(t: torch.Tensor, bits: torch.dtype) -> np.ndarray:
    return t.view(bits).numpy()


def _check_inputs(key, value, k_cache, v_cache, slot_mapping) -> None:
    named = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"store_kvcache: {name} must be a CPU torch tensor")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and
                                                                     v_cache.is_contiguous()):
        raise ValueError(f"store_kvcache: caches must be equal contiguous [blocks, Hkv, block_size, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, k_cache.shape[1], k_cache.shape[3])
    if slot_mapping.dim() != 1 or tuple(key.shape) != expected or key.shape != value.shape:
        raise ValueError(f"store_kvcache: key/value must be [N, Hkv, D] = {expected} with slot_mapping [N], got "
                         f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(slot_mapping.shape)}")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype or k_cache.element_size() not in _BITS:
        raise ValueError(f"store_kvcache: key, value and caches must share a 16- or 32-bit dtype, got {key.dtype}, "
                         f"{value.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kvcache: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
