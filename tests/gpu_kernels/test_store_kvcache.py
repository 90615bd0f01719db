"""store_kvcache writes each token's K/V into its slot of the token-major cache and touches nothing else."""
import pytest
import torch

from gpu_kernels import store_kvcache
from tests.conftest import TEST_DEVICE
from tests.reference import on_test_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_qkv_views(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed, device="cpu"):
    """key/value as strided slices of one [N, Hq + 2 Hkv, D] projection, the way the attention layer sees them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    return key, value


def expected_caches(k_cache, v_cache, key, value, slot_mapping):
    """The reference scatter: a plain copy of the caches with rows slot -> token written."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    num_kv_heads, head_dim = k_cache.shape[2:]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_ref.view(-1, num_kv_heads, head_dim)[slot] = key[token]
            v_ref.view(-1, num_kv_heads, head_dim)[slot] = value[token]
    return k_ref, v_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", (torch.int32, torch.int64))
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 2, 64), (16, 3, 24), (1, 1, 128)])
def test_store_writes_slots_and_leaves_the_rest(dtype, slot_dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 12, 9
    gen = torch.Generator().manual_seed(7)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Random (never zero) caches: an untouched slot must keep its exact old value.
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    key, value = fused_qkv_views(num_tokens, 4, num_kv_heads, head_dim, dtype, seed=3)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 5]] = -1  # tokens of CPU-tier sequences are skipped
    slot_mapping = slots.to(slot_dtype)
    k_ref, v_ref = expected_caches(k_cache, v_cache, key, value, slot_mapping)

    k_cache, v_cache, slot_mapping = on_test_device(k_cache, v_cache, slot_mapping)
    store_kvcache(*fused_qkv_views(num_tokens, 4, num_kv_heads, head_dim, dtype, seed=3, device=TEST_DEVICE),
                  k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache.cpu(), k_ref)
    assert torch.equal(v_cache.cpu(), v_ref)


def test_all_skipped_and_empty_batches_change_nothing():
    k_cache = torch.randn(2, 4, 2, 16, device=TEST_DEVICE)
    v_cache = torch.randn(2, 4, 2, 16, device=TEST_DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 2, 16, device=TEST_DEVICE), torch.randn(3, 2, 16, device=TEST_DEVICE)
    store_kvcache(key, value, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=TEST_DEVICE))
    store_kvcache(key[:0], value[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=TEST_DEVICE))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_bad_inputs_raise_value_error():
    k_cache, v_cache, key, value, slots = on_test_device(torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16),
                                                         torch.randn(3, 2, 16), torch.randn(3, 2, 16),
                                                         torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        store_kvcache(key.half(), value.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key and value"):
        store_kvcache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="power of two"):
        store_kvcache(key, value, *on_test_device(torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)), slots)
