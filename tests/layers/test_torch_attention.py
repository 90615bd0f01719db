"""The torch path honours the same contract as the kernels (token-major layout), against float64, on TEST_DEVICE."""
import math

import pytest
import torch

from offload_engine.layers import torch_attention
from tests.reference import attention_reference, on_test_device, paged_decode_reference, random_paged_kv, relative_error


@pytest.mark.parametrize("group", [1, 4])
def test_paged_decode(group):
    lens = [0, 1, 7, 8, 9, 30]
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 2, 16, 8, torch.float32, "token_major", seed=group)
    q = torch.randn(len(lens), 2 * group, 16)
    out, lse = torch_attention.paged_decode_attention(
        *on_test_device(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)), 0.3)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = paged_decode_reference(q, keys, values, 0.3)
    assert relative_error(out, ref_out) < 1e-5
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    assert torch.allclose(lse[1:].double(), ref_lse[1:], atol=1e-4)


def test_paged_prefill_with_cached_prefix():
    lens = [12, 5, 20]  # total KV per sequence, chunk included
    chunk = [4, 5, 1]
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 2, 16, 4, torch.float32, "token_major", seed=3)
    q = torch.randn(sum(chunk), 4, 16)
    cu = torch.tensor([0, 4, 9, 10], dtype=torch.int32)
    out, lse = torch_attention.paged_prefill_attention(
        *on_test_device(q, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32)), 0.25, 5)
    out, lse = out.cpu(), lse.cpu()
    for b in range(3):
        rows = slice(cu[b].item(), cu[b + 1].item())
        ref_out, ref_lse = attention_reference(q[rows], keys[b], values[b], 0.25, first_query_position=lens[b] - chunk[b])
        assert relative_error(out[rows], ref_out) < 1e-5
        assert torch.allclose(lse[rows].double(), ref_lse, atol=1e-4)


def test_merge_passes_empty_partials_through():
    out_a, out_b = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    lse_a = torch.tensor([[0.5, -math.inf], [-math.inf, -math.inf], [1.0, 2.0]])
    lse_b = torch.tensor([[-math.inf, 0.1], [-math.inf, -math.inf], [1.5, 0.0]])
    out, lse = (t.cpu() for t in torch_attention.merge_attn_states(*on_test_device(out_a, lse_a, out_b, lse_b)))
    assert torch.equal(out[0, 0], out_a[0, 0]) and torch.equal(out[0, 1], out_b[0, 1])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    wa = 1 / (1 + math.exp(1.5 - 1.0))
    assert torch.allclose(out[2, 0], wa * out_a[2, 0] + (1 - wa) * out_b[2, 0], atol=1e-6)
