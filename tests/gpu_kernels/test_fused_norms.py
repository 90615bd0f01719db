"""rms_norm and norm_rope (the fused decode kernels) against float64 references with the unfused path's rounding
points, and against the unfused torch modules they replace on CUDA."""
import os

import pytest
import torch

from gpu_kernels import norm_rope, rms_norm
from offload_engine.layers.norm import RMSNorm
from offload_engine.layers.rotary import RotaryEmbedding
from tests.conftest import TEST_DEVICE

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One rounding of the dtype (the fused and unfused paths sum the mean in different orders, in float32).
ULP = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _reference_rms_norm(x, weight, eps, residual=None):
    """float64 arithmetic, rounding to the dtype where the unfused path rounds."""
    dtype = x.dtype
    if residual is not None:
        x = (x.double() + residual.double()).to(dtype)
    x64 = x.double()
    normed = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed.double() * weight.double()).to(torch.result_type(x, weight)), x


def _close(actual, expected, dtype):
    actual, expected = actual.cpu().double(), expected.cpu().double()
    assert torch.allclose(actual, expected, rtol=ULP[dtype], atol=ULP[dtype]), (actual - expected).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (7, 1024), (33, 96)])  # 96: a width that is no power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(dtype, rows, width, with_residual):
    gen = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype) if with_residual else None
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    out = rms_norm(x.to(TEST_DEVICE), weight.to(TEST_DEVICE), 1e-6,
                   residual.to(TEST_DEVICE) if with_residual else None)
    expected, summed = _reference_rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        out, new_residual = out
        if dtype == torch.bfloat16 and TRITON_INTERPRETED:  # its bfloat16 casts truncate; the GPU's round
            _close(new_residual, summed, dtype)
        else:
            assert torch.equal(new_residual.cpu(), summed)  # one rounding of an exact sum: bit-exact
    _close(out, expected, dtype)
    module = RMSNorm(width, 1e-6)
    module.weight.data = weight
    unfused = module(x, residual) if with_residual else module(x)
    _close(out, unfused[0] if with_residual else unfused, dtype)


def test_rms_norm_reads_strided_rows_and_rejects_bad_shapes():
    x = torch.randn(6, 80).to(TEST_DEVICE)[:, :64]  # rows 80 apart
    weight = torch.rand(64).to(TEST_DEVICE)
    _close(rms_norm(x, weight, 1e-5), _reference_rms_norm(x.cpu(), weight.cpu(), 1e-5)[0], torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:10], 1e-5)


def _reference_norm_rope(x, positions, cos, sin, weight, eps):
    dtype = x.dtype
    x64 = x.double()
    if weight is not None:
        normed = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        x64 = (normed.double() * weight.double()).to(dtype).double()
    c, s = cos[positions].double().unsqueeze(1), sin[positions].double().unsqueeze(1)
    x1, x2 = x64.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 16, 128), (5, 8, 128), (9, 3, 16), (4, 20, 24)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_matches_float64_and_the_unfused_modules(dtype, tokens, heads, dim, with_norm):
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    # A slice of a wider projection, as the attention layer's q and k are.
    wide = (torch.randn(tokens, heads + 5, dim, generator=gen) * 2).to(dtype)
    x = wide[:, 2 : 2 + heads]
    positions = torch.randint(0, 3000, (tokens,), generator=gen)
    rotary = RotaryEmbedding(dim, 4096, {"rope_theta": 1e6, "rope_type": "default"})
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype) if with_norm else None
    out = norm_rope(x.to(TEST_DEVICE), positions.to(TEST_DEVICE), rotary.cos.to(TEST_DEVICE),
                    rotary.sin.to(TEST_DEVICE), weight.to(TEST_DEVICE) if with_norm else None, 1e-6)
    assert out.shape == (tokens, heads, dim) and out.dtype == dtype
    _close(out, _reference_norm_rope(x, positions, rotary.cos, rotary.sin, weight, 1e-6), dtype)
    unfused = x
    if with_norm:
        norm = RMSNorm(dim, 1e-6)
        norm.weight.data = weight
        unfused = norm(x)
    _close(out, rotary(positions, unfused, unfused)[0], dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("heads,dim,block_size", [(2, 16, 16), (8, 128, 16), (3, 24, 32)])
def test_norm_rope_with_a_store_writes_exactly_what_store_kvcache_writes(dtype, heads, dim, block_size):
    """k rotated into its slot and v beside it, at block boundaries and across blocks; slot -1 writes nothing, and
    every other slot of both caches keeps its old (random) contents. Bit for bit what norm_rope without a store
    (checked against float64 above) and then store_kvcache give."""
    from gpu_kernels import KVStore

    gen = torch.Generator().manual_seed(heads * dim + block_size)
    tokens, num_blocks = 7, 5
    wide = torch.randn(tokens, 3 * heads, dim, generator=gen).to(dtype)  # k and v: slices of one projection
    k, v = wide[:, heads : 2 * heads], wide[:, 2 * heads :]
    positions = torch.randint(0, 3000, (tokens,), generator=gen)
    rotary = RotaryEmbedding(dim, 4096, {"rope_theta": 1e6, "rope_type": "default"})
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(dtype)
    # Last and first slot of a block, a skipped token, the block after, the pool's last slot.
    slots = torch.tensor([block_size - 1, block_size, -1, 3 * block_size + 5, 2, -1, num_blocks * block_size - 1])
    on = lambda t: t.to(TEST_DEVICE)
    rotated = norm_rope(on(k), on(positions), on(rotary.cos), on(rotary.sin), on(weight), 1e-6).cpu()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, heads, dim)[slots[keep]] = rotated[keep]
    expected_v.view(-1, heads, dim)[slots[keep]] = v[keep]
    caches = on(k_cache.clone()), on(v_cache.clone())
    out = norm_rope(on(k), on(positions), on(rotary.cos), on(rotary.sin), on(weight), 1e-6,
                    store=KVStore(on(v), *caches, on(slots)))
    assert torch.equal(out.cpu(), rotated)
    assert torch.equal(caches[0].cpu(), expected_k) and torch.equal(caches[1].cpu(), expected_v)
    assert not torch.equal(expected_k, k_cache)  # (the test writes something)
    with pytest.raises(ValueError, match="slot_mapping"):
        norm_rope(on(k), on(positions), on(rotary.cos), on(rotary.sin), on(weight), 1e-6,
                  store=KVStore(on(v), *caches, on(slots[:3])))
