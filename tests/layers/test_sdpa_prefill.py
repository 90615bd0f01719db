"""contiguous_prefill_attention (a segment chunk over its staging cache, through torch's SDPA) matches causal float64
attention of the chunk's queries over every key up to its last, on fresh random data: GQA, chunks that start and
end mid-block, a chunk of one query, and the whole sequence as one chunk."""
import pytest
import torch

from offload_engine.layers.sdpa_prefill import contiguous_prefill_attention
from tests.conftest import TEST_DEVICE
from tests.reference import attention_reference, relative_error

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def check(num_keys, num_queries, num_q_heads, num_kv_heads, block_size, dtype, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_keys // block_size) + 2  # tokens past num_keys hold garbage the chunk must not see
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    k_cache.view(-1, num_kv_heads, head_dim)[num_keys:] = float("nan")
    q = torch.randn(num_queries, num_q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = contiguous_prefill_attention(q.to(TEST_DEVICE), k_cache.to(TEST_DEVICE), v_cache.to(TEST_DEVICE),
                                       num_keys, scale)
    keys, values = (c.view(-1, num_kv_heads, head_dim)[:num_keys] for c in (k_cache, v_cache))
    ref, _ = attention_reference(q, keys, values, scale, first_query_position=num_keys - num_queries)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out.cpu(), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (16, 8)])
def test_a_chunk_after_its_prefix_gqa(num_q_heads, num_kv_heads):
    check(num_keys=203, num_queries=37, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=16,
          dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_the_whole_sequence_as_one_chunk(dtype):
    check(num_keys=130, num_queries=130, num_q_heads=8, num_kv_heads=2, block_size=64, dtype=dtype, head_dim=128)


@pytest.mark.parametrize("num_keys, num_queries", [(64, 1), (65, 1), (128, 64), (129, 65)])
def test_block_boundaries_and_single_queries(num_keys, num_queries):
    check(num_keys, num_queries, num_q_heads=4, num_kv_heads=2, block_size=64, dtype=torch.float32, seed=num_keys)


def test_more_queries_than_keys_is_a_value_error():
    q = torch.zeros(5, 2, 8)
    cache = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="num_keys"):
        contiguous_prefill_attention(q, cache, cache, 4, 1.0)
