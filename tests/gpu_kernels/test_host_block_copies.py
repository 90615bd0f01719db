"""gather_host_blocks moves each token of a promotion from its head-major host block into its device slot, and
scatter_host_blocks each token of a demotion the other way, in every layer, K and V; neither touches anything else."""
import pytest
import torch

from gpu_kernels import host_block_copies
from gpu_kernels.host_block_copies import compile_host_block_copies, gather_host_blocks, scatter_host_blocks
from tests.reference import on_test_device


def reference(host, token_slots, blocks, rows, slots, to_host):
    """A plain loop: token t is host block blocks[rows[t] // B], offset rows[t] % B, and device slot slots[t]."""
    host, token_slots = host.clone(), token_slots.clone()
    host_block = host.shape[4]
    for row, slot in zip(rows.tolist(), slots.tolist()):
        block = blocks[row // host_block].item()
        if to_host:
            host[:, :, block, :, row % host_block] = token_slots[:, :, slot]
        else:
            token_slots[:, :, slot] = host[:, :, block, :, row % host_block]
    return host, token_slots


@pytest.mark.parametrize("to_host", (False, True), ids=("gather", "scatter"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("num_kv_heads,host_block,head_dim", [(2, 4, 64), (3, 8, 24), (1, 16, 128)])
def test_every_token_lands_in_its_place_and_nothing_else_moves(to_host, dtype, num_kv_heads, host_block, head_dim):
    gen = torch.Generator().manual_seed(11)
    layers, host_blocks, device_slots = 3, 10, 64
    # Random (never zero) pools: an untouched slot or host row must keep its exact old value.
    host = torch.randn((layers, 2, host_blocks, num_kv_heads, host_block, head_dim), generator=gen).to(dtype)
    token_slots = torch.randn((layers, 2, device_slots, num_kv_heads, head_dim), generator=gen).to(dtype)
    # Two sequences, as step_inputs.host_copy_plan lays them out: 2.5 and 1 host blocks (partial last
    # blocks), their host blocks scattered, their tokens in scattered slots.
    lengths = (2 * host_block + host_block // 2, host_block - 1)
    blocks = torch.randperm(host_blocks, generator=gen)[:3 + 1]
    rows = torch.cat([torch.arange(lengths[0]), 3 * host_block + torch.arange(lengths[1])])
    slots = torch.randperm(device_slots, generator=gen)[:rows.shape[0]]
    want_host, want_slots = reference(host, token_slots, blocks, rows, slots, to_host)

    host, token_slots, blocks, rows, slots = on_test_device(host, token_slots, blocks, rows, slots)
    copy = scatter_host_blocks if to_host else gather_host_blocks
    copy(host, token_slots, blocks, rows, slots, programs=3)  # fewer programs than units
    assert torch.equal(host.cpu(), want_host) and torch.equal(token_slots.cpu(), want_slots)


@pytest.mark.parametrize("copy", (gather_host_blocks, scatter_host_blocks))
def test_no_tokens_is_a_no_op_and_bad_shapes_are_refused(copy):
    host = torch.randn((2, 2, 4, 2, 8, 16))
    token_slots = torch.randn((2, 2, 16, 2, 16))
    before = host.clone(), token_slots.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    copy(host, token_slots, empty, empty, empty)
    assert torch.equal(host, before[0]) and torch.equal(token_slots, before[1])
    with pytest.raises(ValueError, match="token_slots must be"):
        copy(host, torch.randn((2, 2, 16, 3, 16)), empty, empty, empty)
    with pytest.raises(ValueError, match="rows must be"):
        copy(host, token_slots, empty, empty.int(), empty)
    with pytest.raises(ValueError, match="one dtype"):
        copy(host, token_slots.half(), empty, empty, empty)


def test_start_up_compiles_and_launches_both_directions_and_moves_nothing(monkeypatch):
    """compile_host_block_copies (the engine's start-up) launches each direction over no tokens: nothing changes,
    and the moves after it compile nothing (a compile in a run's first move held the engine's thread)."""
    gen = torch.Generator().manual_seed(12)
    host = torch.randn((2, 2, 4, 2, 8, 16), generator=gen).to(torch.bfloat16)
    token_slots = torch.randn((2, 2, 16, 2, 16), generator=gen).to(torch.bfloat16)
    want_host, want_slots = host.clone(), token_slots.clone()
    host, token_slots = on_test_device(host, token_slots)
    compile_host_block_copies(host, token_slots)
    assert torch.equal(host.cpu(), want_host) and torch.equal(token_slots.cpu(), want_slots)
    if token_slots.is_cuda:
        def compile_again(*args, **kwargs):
            raise AssertionError("a move compiled the copy kernel again")
        monkeypatch.setattr(host_block_copies._copy_kernel, "_do_compile", compile_again)
    for copy in (gather_host_blocks, scatter_host_blocks):
        index = torch.arange(3, dtype=torch.int64, device=token_slots.device)
        copy(host, token_slots, index[:1], index, index + 5)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("num_kv_heads,host_block,head_dim", [(2, 4, 64), (3, 6, 24), (1, 16, 128)])
def test_whole_block_writes_put_each_token_in_its_row_zero_the_padding_and_touch_nothing_else(
        dtype, num_kv_heads, host_block, head_dim):
    gen = torch.Generator().manual_seed(5)
    tokens, pool_blocks, num_heads = 3 * host_block + 2, 9, 2 * num_kv_heads
    # K and V as a layer has them: v a view of the fused projection (a token stride of its own), k a tensor.
    qkv = torch.randn((tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=gen).to(dtype)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    k = torch.randn((tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    pools = [torch.randn((pool_blocks, num_kv_heads, host_block, head_dim), generator=gen).to(dtype) for _ in "kv"]
    # Three whole blocks in scattered pool blocks: shuffled tokens, the last block padded after 2 rows.
    targets = torch.randperm(pool_blocks, generator=gen)[:3]
    token_rows = torch.cat([torch.randperm(tokens, generator=gen)[:2 * host_block + 2],
                            torch.full((host_block - 2,), -1)])
    want = [p.clone() for p in pools]
    for j, block in enumerate(targets.tolist()):
        for r in range(host_block):
            token = token_rows[j * host_block + r].item()
            for pool, source in zip(want, (k, v)):
                pool[block, :, r] = source[token] if token >= 0 else 0

    k, v, *pools, token_rows, targets = on_test_device(k, v, *pools, token_rows, targets)
    host_block_copies.write_host_blocks_whole(k, v, *pools, token_rows, targets, programs=2)
    for got, expected in zip(pools, want):
        assert torch.equal(got.cpu(), expected)


def test_whole_block_writes_of_no_blocks_are_a_no_op_and_bad_shapes_are_refused():
    k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    pools = [torch.randn(4, 2, 8, 16) for _ in "kv"]
    before = [p.clone() for p in pools]
    empty = torch.zeros(0, dtype=torch.int64)
    host_block_copies.write_host_blocks_whole(k, v, *pools, empty, empty)
    assert all(torch.equal(p, b) for p, b in zip(pools, before))
    with pytest.raises(ValueError, match="v must be"):
        host_block_copies.write_host_blocks_whole(k, v.transpose(1, 2), *pools, empty, empty)
    with pytest.raises(ValueError, match="token_rows must be"):
        host_block_copies.write_host_blocks_whole(k, v, *pools, empty, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        host_block_copies.write_host_blocks_whole(k, v.half(), *pools, empty, empty)
