"""silu_and_mul (the fused SwiGLU kernel) against a float64 reference with torch's rounding points, and against the
unfused module it replaces on CUDA."""
import pytest
import torch

from gpu_kernels import silu_and_mul
from offload_engine.layers import fused
from offload_engine.layers.activation import SiluAndMul
from tests.conftest import TEST_DEVICE

# Two roundings of the dtype: float32 exp may differ by an ulp, which can move a rounded value by one step, and
# Triton's interpreter truncates bf16 casts instead of rounding them (test_fused_norms.py tolerates the same).
ULP = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(x.dtype)
    return (silu.double() * up).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d", [(1, 64), (5, 1000), (33, 3072)])  # 1000: tiles with a ragged last; 3072: 0.6B
def test_silu_and_mul_matches_float64(dtype, rows, d):
    gen = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, 2 * d, generator=gen) * 4).to(dtype)
    got = silu_and_mul(x.to(TEST_DEVICE)).cpu()
    expected = _reference(x)
    assert got.dtype == dtype and got.shape == (rows, d)
    assert torch.allclose(got.double(), expected.double(), rtol=ULP[dtype], atol=ULP[dtype])


def test_strided_rows_and_empty_batches():
    x = torch.randn(6, 2 * 96 + 10)[:, :2 * 96]  # rows with a stride past their width
    assert torch.allclose(silu_and_mul(x.to(TEST_DEVICE)).cpu(), _reference(x), atol=1e-5)
    assert silu_and_mul(torch.randn(0, 128, device=TEST_DEVICE)).shape == (0, 64)
    with pytest.raises(ValueError, match="2 \\* D"):
        silu_and_mul(torch.randn(4, 7))


def test_module_takes_the_kernel_on_cuda_and_matches_the_unfused_path(monkeypatch):
    x = (torch.randn(9, 2 * 640) * 3).to(torch.bfloat16).to(TEST_DEVICE)
    module = SiluAndMul()
    with_kernel = module(x)
    monkeypatch.setattr(fused, "DISABLED", {"silu_and_mul"})
    unfused = module(x)
    assert torch.allclose(with_kernel.double(), unfused.double(), rtol=ULP[torch.bfloat16], atol=ULP[torch.bfloat16])
