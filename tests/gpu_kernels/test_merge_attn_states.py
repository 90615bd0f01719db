"""merge_attn_states of attention over two disjoint key sets equals attention over their union."""
import math

import pytest
import torch

from gpu_kernels import merge_attn_states as merge_on_device
from tests.reference import attention_reference, on_test_device, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """The kernel on TEST_DEVICE, for inputs and results on the CPU."""
    out, lse = merge_on_device(*on_test_device(out_a, lse_a, out_b, lse_b))
    return out.cpu(), lse.cpu()


def partials(num_tokens, num_q_heads, num_kv_heads, head_dim, len_a, len_b, dtype, seed=0):
    """(out_a, lse_a, out_b, lse_b, ref_out, ref_lse): attention of random queries over keys split a | b."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len_a + len_b, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len_a + len_b, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out_a, lse_a = attention_reference(q, k[:len_a], v[:len_a], scale)
    out_b, lse_b = attention_reference(q, k[len_a:], v[len_a:], scale)
    ref_out, ref_lse = attention_reference(q, k, v, scale)
    return out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float(), ref_out, ref_lse


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("head_dim", (64, 24))
def test_merge_equals_attention_over_the_union(dtype, head_dim):
    out_a, lse_a, out_b, lse_b, ref_out, ref_lse = partials(5, 8, 2, head_dim, 13, 29, dtype)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_empty_partial_passes_the_other_through_exactly():
    out_a, lse_a, _, _, _, _ = partials(4, 4, 4, 32, 9, 0, torch.bfloat16, seed=1)
    garbage = torch.full_like(out_a, math.nan)  # whatever an empty side holds must not leak in
    empty = torch.full_like(lse_a, -math.inf)
    for out, lse in (merge_attn_states(out_a, lse_a, garbage, empty), merge_attn_states(garbage, empty, out_a, lse_a)):
        assert torch.equal(out, out_a)
        assert torch.equal(lse, lse_a)


def test_both_empty_gives_zero_and_minus_inf_without_nan():
    garbage = torch.full((3, 2, 16), math.nan, dtype=torch.float16)
    empty = torch.full((3, 2), -math.inf)
    out, lse = merge_attn_states(garbage, empty, garbage.clone(), empty.clone())
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_mixed_rows_and_strided_inputs():
    # Per (token, head) some rows empty on one side, some on both; inputs are non-contiguous views.
    out_a, lse_a, out_b, lse_b, _, _ = partials(6, 4, 2, 64, 7, 11, torch.float32, seed=2)
    lse_a[0], lse_b[1] = -math.inf, -math.inf
    lse_a[2, :2], lse_b[2, :2] = -math.inf, -math.inf
    out_a[0], out_b[1] = 0.0, 0.0
    out_a_t = out_a.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] view with swapped strides
    lse_b_t = lse_b.t().contiguous().t()
    out, lse = merge_attn_states(out_a_t, lse_a, out_b, lse_b_t)
    assert torch.equal(out[0], out_b[0]) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(out[1], out_a[1]) and torch.equal(lse[1], lse_a[1])
    assert torch.all(out[2, :2] == 0) and torch.all(torch.isneginf(lse[2, :2]))
    weights = torch.stack([lse_a[3:], lse_b[3:]]).double().softmax(0)
    expected = weights[0, ..., None] * out_a[3:].double() + weights[1, ..., None] * out_b[3:].double()
    assert relative_error(out[3:], expected) < 1e-6
    assert (lse[3:].double() - torch.logaddexp(lse_a[3:].double(), lse_b[3:].double())).abs().max() < 1e-5


def test_bad_inputs_raise_value_error():
    out, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match="float32"):
        merge_attn_states(out, lse.double(), out, lse)
    with pytest.raises(ValueError, match="lse_a"):
        merge_attn_states(out, lse[:1], out, lse)
