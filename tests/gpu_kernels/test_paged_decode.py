"""paged_decode_attention matches float64 attention over each sequence's contiguous K/V."""
import math

import pytest
import torch

from gpu_kernels import paged_decode_attention
from gpu_kernels.paged_decode import _tile_config, choose_num_splits
from tests.conftest import TEST_DEVICE
from tests.reference import on_test_device, paged_decode_reference, random_paged_kv, relative_error

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def run_decode(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_splits=None, seed=0,
               strided_q=False, config=None):
    k_cache, v_cache, block_tables, keys, values = random_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, layout="token_major", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = len(context_lens)
    if strided_q:  # q sliced out of a fused qkv projection: a non-contiguous view (on the device too)
        fused = torch.randn(batch, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        q, q_in = fused[:, :num_q_heads], fused.to(TEST_DEVICE)[:, :num_q_heads]
    else:
        q = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(dtype)
        q_in = q.to(TEST_DEVICE)
    scale = head_dim ** -0.5
    out, lse = paged_decode_attention(q_in, *on_test_device(k_cache, v_cache, block_tables,
                                                            torch.tensor(context_lens, dtype=torch.int32)),
                                      scale, num_splits=num_splits, config=config)
    ref_out, ref_lse = paged_decode_reference(q, keys, values, scale)
    return out.cpu(), lse.cpu(), ref_out, ref_lse


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly for the empty rows"
    assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() < LSE_TOLERANCE[dtype]
    assert torch.all(out[empty.any(dim=1)] == 0), "a row with context 0 must give out 0"


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
def test_gqa_ratios_and_block_boundaries(num_q_heads, num_kv_heads):
    # Contexts at, just past and just short of the 8-token block boundary, plus an empty row.
    context_lens = [8, 9, 15, 1, 0, 24]
    out, lse, ref_out, ref_lse = run_decode(context_lens, num_q_heads, num_kv_heads, 64, 8, torch.float32)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_dtypes_head_dim_128(dtype):
    out, lse, ref_out, ref_lse = run_decode([16, 33, 0, 70], 8, 2, 128, 16, dtype, seed=1)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_odd_head_dim_and_tiny_blocks(dtype):
    # D = 24 pads to a 32-wide tile; block_size 4 and 1 put several pages into one key tile.
    for block_size in (4, 1):
        out, lse, ref_out, ref_lse = run_decode([5, 12, 0, 23], 4, 2, 24, block_size, dtype, seed=2)
        assert_matches(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("num_splits", (1, 2, 3, 7))
def test_split_k_with_short_and_empty_rows(num_splits):
    # Splits past the short rows' contexts produce empty partials that the reduction must ignore.
    context_lens = [100, 3, 0, 47]
    out, lse, ref_out, ref_lse = run_decode(context_lens, 4, 1, 64, 8, torch.bfloat16, num_splits, seed=3,
                                            strided_q=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("config", [(32, 4, 1), (16, 2, 2)])
def test_a_tile_config_given_in_place_of_the_default(config):
    # The sweep's configurations (benchmarks/sweep_decode_tiles.py) must compute the same attention.
    out, lse, ref_out, ref_lse = run_decode([70, 33, 0, 16], 4, 2, 64, 16, torch.bfloat16, 3, seed=9, config=config)
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


def test_default_split_count_uses_several_splits_for_a_long_context():
    q = torch.empty(1, 2, 64, device=TEST_DEVICE)
    block_n = _tile_config(q, 64)[0]  # key tiles are wider on the GPU than under the interpreter
    context = 6 * block_n
    assert choose_num_splits(1, 1, math.ceil(context / 16) + 1, 16, block_n, q.device) > 1
    out, lse, ref_out, ref_lse = run_decode([context], 2, 1, 64, 16, torch.float32, seed=4)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_wide_block_table_as_in_a_cuda_graph():
    # A graph-captured table is sized for the longest possible context: the split count follows that width,
    # while each row divides its actual context over the splits.
    context_lens = [40, 2, 0]
    k_cache, v_cache, block_tables, keys, values = random_paged_kv(
        context_lens, 2, 64, 4, torch.float16, layout="token_major", seed=6)
    wide = torch.cat([block_tables, torch.full((3, 40), -1, dtype=torch.int32)], dim=1)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(7)).half()
    out, lse = paged_decode_attention(*on_test_device(q, k_cache, v_cache, wide,
                                                      torch.tensor(context_lens, dtype=torch.int32)), 0.125)
    ref_out, ref_lse = paged_decode_reference(q, keys, values, 0.125)
    assert_matches(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.float16)


def test_all_rows_empty():
    out, lse, ref_out, ref_lse = run_decode([0, 0], 4, 2, 32, 4, torch.float16, num_splits=2, seed=5)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_bad_inputs_raise_value_error():
    k_cache, v_cache, block_tables, _, _ = random_paged_kv([5], 2, 16, 4, torch.float32, layout="token_major")
    k_cache, v_cache, block_tables = on_test_device(k_cache, v_cache, block_tables)
    context_lens = torch.tensor([5], dtype=torch.int32, device=TEST_DEVICE)
    q = torch.randn(1, 4, 16, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, block_tables, context_lens, 0.25)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.half(), k_cache, v_cache, block_tables, context_lens, 0.25)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, block_tables.long(), context_lens, 0.25)


def test_the_split_count_keeps_a_launch_within_its_programs_per_sm():
    """On 132 SMs (8 KV heads, 2,048 blocks of 16 a row): one row takes the most splits; 8 rows 16, not the 17 that
    rounding up would give (a tail of programs past one launch's worth); 64 rows 2; 512 rows 1."""
    from unittest import mock

    from gpu_kernels import paged_decode

    with mock.patch.object(paged_decode, "sm_count", lambda device: 132):
        splits = [choose_num_splits(batch, 8, 2048, 16, 64, torch.device("cuda")) for batch in (1, 8, 64, 512)]
    assert splits == [paged_decode.MAX_SPLITS, 16, 2, 1]
