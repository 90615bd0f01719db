"""The host kernel's own casts (numpy, so torch starts no OpenMP team on the executor) against torch's."""
import numpy as np
import pytest
import torch

from cpu_attention.decode import narrowed, scaled_query

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
def test_scaled_query_is_a_contiguous_float32_copy(dtype):
    q = (torch.randn(6, 8, 64) * 4).to(dtype)[:, ::2]  # strided: every other head
    before = q.clone()
    scaled = scaled_query(q, 0.0883)
    assert scaled.dtype == np.float32 and scaled.flags["C_CONTIGUOUS"] and scaled.shape == (6, 4, 64)
    np.testing.assert_array_equal(scaled, (q.double() * np.float32(0.0883)).float().numpy())
    assert torch.equal(q, before)
