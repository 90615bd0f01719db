"""gather_host_blocks moves each token of a promotion from its head-major host block into its device slot, in every
layer, K and V, and touches no other slot."""
import pytest
import torch

from kernels.gather_host_blocks import gather_host_blocks
from tests.reference import on_test_device


def reference(host, token_slots, sources, rows, slots):
    """A plain loop: token t is host block sources[rows[t] // B], offset rows[t] % B."""
    expected = token_slots.clone()
    host_block = host.shape[4]
    for t, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
        block = sources[row // host_block].item()
        expected[:, :, slot] = host[:, :, block, :, row % host_block]
    return expected


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("num_kv_heads,host_block,head_dim", [(2, 4, 64), (3, 8, 24), (1, 16, 128)])
def test_every_token_lands_in_its_slot_and_nothing_else_moves(dtype, num_kv_heads, host_block, head_dim):
    gen = torch.Generator().manual_seed(11)
    layers, host_blocks, device_slots = 3, 10, 64
    # Random (never zero) pools: an untouched slot must keep its exact old value.
    host = torch.randn((layers, 2, host_blocks, num_kv_heads, host_block, head_dim), generator=gen).to(dtype)
    token_slots = torch.randn((layers, 2, device_slots, num_kv_heads, head_dim), generator=gen).to(dtype)
    # Two sequences, as kv_promotion._plan lays them out: 2.5 and 1 host blocks (partial last blocks), their host
    # blocks scattered, their tokens to scattered slots.
    lengths = (2 * host_block + host_block // 2, host_block - 1)
    sources = torch.randperm(host_blocks, generator=gen)[:3 + 1]
    rows = torch.cat([torch.arange(lengths[0]), 3 * host_block + torch.arange(lengths[1])])
    slots = torch.randperm(device_slots, generator=gen)[:rows.shape[0]]
    expected = reference(host, token_slots, sources, rows, slots)

    host, token_slots, sources, rows, slots = on_test_device(host, token_slots, sources, rows, slots)
    gather_host_blocks(host, token_slots, sources, rows, slots, programs=3)  # fewer programs than units
    assert torch.equal(token_slots.cpu(), expected)


def test_no_tokens_is_a_no_op_and_bad_shapes_are_refused():
    host = torch.randn((2, 2, 4, 2, 8, 16))
    token_slots = torch.randn((2, 2, 16, 2, 16))
    before = token_slots.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    gather_host_blocks(host, token_slots, empty, empty, empty)
    assert torch.equal(token_slots, before)
    with pytest.raises(ValueError, match="token_slots must be"):
        gather_host_blocks(host, torch.randn((2, 2, 16, 3, 16)), empty, empty, empty)
    with pytest.raises(ValueError, match="rows must be"):
        gather_host_blocks(host, token_slots, empty, empty.int(), empty)
