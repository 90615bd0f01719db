from offload_engine.engine.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.sampling_params import SamplingParams

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def _seq(tokens):
    return Sequence(tokens, SamplingParams(), budget=len(tokens) + 16)


def _computed(blocks, seq):
    seq.num_computed_tokens = len(seq)
    blocks.register_computed_blocks(seq)


def test_each_tier_has_its_own_pool_and_block_size():
    blocks = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=3, cpu_block_size=8)
    a, b = _seq(list(range(10))), _seq(list(range(100, 110)))
    blocks.allocate(a, GPU)
    blocks.allocate(b, CPU)
    assert (a.location, len(a.block_table), b.location, len(b.block_table)) == (GPU, 3, CPU, 2)
    assert blocks.pool(GPU).num_free == 1 and blocks.pool(CPU).num_free == 1
    blocks.deallocate(a)
    assert blocks.pool(GPU).num_free == 4 and a.admitted_to == GPU


def test_prefix_reuse_within_a_tier_only_and_never_the_last_token():
    blocks = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=8, cpu_block_size=4)
    first = _seq(list(range(12)))
    blocks.allocate(first, CPU)
    _computed(blocks, first)
    same_on_gpu = _seq(list(range(12)))
    blocks.allocate(same_on_gpu, GPU)
    assert same_on_gpu.num_computed_tokens == 0  # tiers do not share blocks
    same = _seq(list(range(12)))
    blocks.allocate(same, CPU)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks are reused.
    assert same.num_computed_tokens == 8 and same.block_table[:2] == first.block_table[:2]
    assert same.block_table[2] != first.block_table[2]
    diverging = _seq(list(range(4)) + [99] + list(range(5, 12)))
    blocks.allocate(diverging, CPU)
    assert diverging.num_computed_tokens == 4


def test_freed_blocks_stay_reusable_until_handed_out_again():
    blocks = BlockManager(num_gpu_blocks=3, block_size=4, num_cpu_blocks=0, cpu_block_size=4)
    first = _seq(list(range(9)))
    blocks.allocate(first, GPU)
    _computed(blocks, first)
    blocks.deallocate(first)
    again = _seq(list(range(9)))
    blocks.allocate(again, GPU)
    assert again.num_computed_tokens == 8
    blocks.deallocate(again)
    other = _seq(list(range(50, 62)))  # takes every block: the old registrations are gone
    blocks.allocate(other, GPU)
    blocks.deallocate(other)
    third = _seq(list(range(9)))
    blocks.allocate(third, GPU)
    assert third.num_computed_tokens == 0


def test_append_needs_a_block_only_at_a_boundary():
    blocks = BlockManager(num_gpu_blocks=2, block_size=4, num_cpu_blocks=0, cpu_block_size=4)
    seq = _seq(list(range(4)))
    blocks.allocate(seq, GPU)
    seq.token_ids.append(7)  # 5 tokens: needs a second block
    assert blocks.can_append(seq)
    blocks.append_slot(seq)
    assert len(seq.block_table) == 2 and blocks.pool(GPU).num_free == 0
    seq.token_ids += [8, 9, 10]  # 8 tokens: still fits
    assert blocks.can_append(seq)
    seq.token_ids.append(11)
    assert not blocks.can_append(seq)
