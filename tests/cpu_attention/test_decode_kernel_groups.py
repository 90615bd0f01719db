"""The decode kernel's per-group passes (quads, a pair, a single head; four rows, then the n % 4 tail rows)
against the float64 reference, for every way a group splits into them.

The kernel compiles once per cache dtype, whatever the shapes, so these many shapes cost no extra compiles.
"""
import pytest
import torch

from cpu_attention import paged_decode_attention
from tests.cpu_attention.test_decode import LSE_ATOL, TOLERANCE, _run_and_check
from tests.reference import paged_decode_reference, random_paged_kv, relative_error

# 1: single only, 2: pair only, 3: pair + single, 4: quad only, 6: quad + pair, 8: two quads
GROUPS = (1, 2, 3, 4, 6, 8)
# (block_size, context lengths): none divides its block size except the empty row. With 16, whole blocks run
# only four-row passes and the last block ends in tails of 1-3 rows (or is 1-3 rows long); with 7 every block
# ends in a 3-row tail and the last one may be shorter than four rows. Every table row is -1 padded
# (random_paged_kv leaves a spare column; the empty row is all -1).
CONTEXTS = {16: [1, 2, 3, 0, 17, 34, 51, 70], 7: [5, 6, 0, 15, 29, 2]}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("block_size", sorted(CONTEXTS))
@pytest.mark.parametrize("group", GROUPS)
def test_every_group_split_matches_reference(group, block_size, dtype):
    _run_and_check(CONTEXTS[block_size], group, 64, block_size, dtype, seed=100 * group + block_size)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("group", GROUPS)
def test_block_max_sees_every_row_of_every_head(group, dtype):
    """Each query head gets one planted score of 100 against scores of ~N(0, 1), so a block max that skipped
    the planted row would leave exp(score - max) = exp(~100), past float32's range: only a max over every
    row of every head passes. Sequence b plants head i's peak at row 8 i + b, so over the seven sequences
    each head's peak takes every position in the blocks of 7 rows (four-row passes and the 3-row tail)."""
    num_kv_heads, head_dim, block_size = 2, 16, 7
    lens = [8 * group + 8] * 7
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype,
                                                             layout="head_major", seed=group)
    q = torch.zeros(len(lens), num_kv_heads * group, head_dim, dtype=dtype)
    for b in range(len(lens)):
        for hq in range(num_kv_heads * group):
            h, i = hq // group, hq % group
            q[b, hq, i] = 1.0  # head hq scores row t by k[t, h, i] alone
            row = 8 * i + b
            keys[b][row, h, i] = 100.0
            k_cache[tables[b, row // block_size], h, row % block_size, i] = 100.0
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 1.0)
    ref_out, ref_lse = paged_decode_reference(q, keys, values, 1.0)
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=LSE_ATOL[dtype])
