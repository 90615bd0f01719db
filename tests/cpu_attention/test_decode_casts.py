"""The host kernel's own casts (numpy, so torch starts no OpenMP team on the executor) against torch's."""
import numpy as np
import pytest
import torch

from cpu_attention import paged_decode_attention
from cpu_attention.decode import narrowed

SPECIALS = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, 65504.0,
            65520.0, 1e-8, 6e-8, 2.0 ** -14 + 2.0 ** -25]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_narrowed_rounds_as_torch_does(dtype):
    values = torch.cat([torch.tensor(SPECIALS), torch.randn(200_000) * 300, torch.randn(10_000) * 1e-6])
    ours = torch.from_numpy(narrowed(values.numpy(), dtype)).view(dtype)
    theirs = values.to(dtype)
    both_nan = ours.isnan() & theirs.isnan()
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert bool(((ours.view(bits) == theirs.view(bits)) | both_nan).all())
    assert bool((ours.isnan() == theirs.isnan()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_strided_query_is_read_as_its_contiguous_copy_and_left_untouched(dtype):
    q = (torch.randn(3, 8, 64) * 4).to(dtype)[:, ::2]  # strided: every other head
    k_cache, v_cache = (torch.randn(6, 2, 16, 64).to(dtype) for _ in range(2))
    tables, lens = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32), torch.tensor([20, 32, 1])
    before = q.clone()
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.0883)
    expected, expected_lse = paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.0883)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse) and torch.equal(q, before)
