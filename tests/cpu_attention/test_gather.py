import pytest
import torch

from cpu_attention.gather import gather_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gathers_exactly_the_chosen_blocks(dtype):
    cache = torch.randn(9, 2, 4, 8).to(dtype)
    ids = torch.tensor([7, 0, 3, 3, 8])
    out = torch.full((5, 2, 4, 8), float("nan"), dtype=dtype)
    gather_blocks(cache, ids, out)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       cache[ids].view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="block ids"):
        gather_blocks(torch.randn(3, 4), torch.tensor([3]), torch.empty(1, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_writes_exactly_the_chosen_blocks(dtype):
    from cpu_attention.gather import scatter_blocks

    cache = torch.randn(9, 2, 4, 8).to(dtype)
    before = cache.clone()
    packed = torch.randn(3, 2, 4, 8).to(dtype)
    ids = torch.tensor([6, 0, 4])
    scatter_blocks(packed, ids, cache)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(cache[ids].view(bits), packed.view(bits))
    untouched = [i for i in range(9) if i not in (6, 0, 4)]
    assert torch.equal(cache[untouched].view(bits), before[untouched].view(bits))
