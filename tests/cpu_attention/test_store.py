"""cpu_attention.store_kvcache: exactly the addressed head-major slots change, bit for bit."""
import pytest
import torch

from cpu_attention import paged_decode_attention, store_kvcache
from tests.reference import paged_decode_reference, relative_error

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _random_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, gen):
    return torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("n", (40, 90), ids=("serial", "parallel"))  # around PARALLEL_MIN_TOKENS
@pytest.mark.parametrize("slot_dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_writes_exactly_the_addressed_slots(dtype, slot_dtype, n):
    gen = torch.Generator().manual_seed(11)
    num_blocks, num_kv_heads, block_size, head_dim = 6, 3, 16, 24
    k_cache = _random_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, gen)
    v_cache = _random_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, gen)
    k_cache[0, 0, 0, 0] = v_cache[1, 1, 1, 1] = float("nan")  # untouched slots must keep even their NaNs
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::5] = -1
    key = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots.to(slot_dtype))

    expected_k, expected_v = before_k.clone(), before_v.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[i]
            expected_v[slot // block_size, :, slot % block_size] = value[i]
    assert torch.equal(_bits(k_cache), _bits(expected_k)) and torch.equal(_bits(v_cache), _bits(expected_v))
    assert not torch.equal(_bits(k_cache), _bits(before_k))  # the test itself would notice a no-op


def test_bad_slot_raises_before_any_write():
    k_cache = torch.zeros(2, 1, 4, 8)
    v_cache = torch.zeros(2, 1, 4, 8)
    key = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, k_cache, v_cache, torch.tensor([0, 1, 8]))
    with pytest.raises(ValueError):
        store_kvcache(key, key, k_cache, v_cache, torch.tensor([0, -2, 1]))
    assert torch.all(k_cache == 0) and torch.all(v_cache == 0)


def test_rejects_mismatched_inputs():
    k_cache = v_cache = torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    good = torch.ones(2, 2, 8, dtype=torch.bfloat16)
    for key, cache_k, slot in [(good.float(), k_cache, slots), (torch.ones(2, 1, 8, dtype=torch.bfloat16), k_cache,
                                                                 slots),
                               (good, k_cache.transpose(1, 2), slots), (good, k_cache, slots.float()),
                               (good, k_cache, torch.tensor([0, 1, 2]))]:
        with pytest.raises(ValueError):
            store_kvcache(key, key, cache_k, cache_k, slot)


def test_stored_tokens_decode_like_the_reference():
    gen = torch.Generator().manual_seed(12)
    num_kv_heads, block_size, head_dim, lens = 2, 8, 32, [19, 8]
    k_cache = torch.full((8, num_kv_heads, block_size, head_dim), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    tables = torch.tensor([[5, 0, 3], [6, -1, -1]], dtype=torch.int32)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16) for n in lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16) for n in lens]
    for b, n in enumerate(lens):  # one token per call, as decode writes them
        for pos in range(n):
            slot = torch.tensor([int(tables[b, pos // block_size]) * block_size + pos % block_size])
            store_kvcache(keys[b][pos:pos + 1], values[b][pos:pos + 1], k_cache, v_cache, slot)
    q = torch.randn(2, 4, head_dim, generator=gen).to(torch.bfloat16)
    out, _ = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.2)
    assert relative_error(out, paged_decode_reference(q, keys, values, 0.2)[0]) < 1e-2
