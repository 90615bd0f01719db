from offload_engine.engine.sched.block_manager import BlockManager
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


class _Copy:
    """Stands in for a demotion copy's CUDA event."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_a_demotions_freed_blocks_are_held_until_its_copy_lands_except_those_handed_out_first():
    blocks = BlockManager(num_gpu_blocks=9, block_size=4, num_cpu_blocks=8, cpu_block_size=4)
    gpu = blocks.pool(GPU)
    staying, demoted = _seq(list(range(14))), _seq(list(range(100, 120)))
    blocks.allocate(staying, GPU)  # 4 blocks
    blocks.allocate(demoted, GPU)  # 5 blocks: the pool is full
    assert gpu.num_free == 0
    demoted.num_computed_tokens = 20
    old = blocks.move(demoted, CPU, hold=True)
    assert len(old) == 5 and gpu.num_free == 5 and not gpu.free  # usable now, but held
    taken = gpu.take_free()  # the step's new block: a held one, so its KV must cross first
    first = gpu.hand_out_held(spare=2)
    assert first[0] == taken and len(first) == 3 and set(first) <= set(old)
    assert set(gpu.free) == set(first[1:]) and gpu.num_free == 4  # (two still held: usable until bound)
    copy = _Copy()
    gpu.hold_until(copy)
    assert gpu.num_free == 2 and gpu.num_landing == 2  # the other two wait for the copy
    gpu.reclaim()
    assert gpu.num_free == 2  # not landed yet
    copy.done = True
    gpu.reclaim()
    assert gpu.num_free == 4 and gpu.num_landing == 0 and copy.waited == 1


def test_a_landing_block_revived_by_a_prefix_hit_is_freed_only_after_it_has_landed():
    blocks = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=8, cpu_block_size=4)
    gpu = blocks.pool(GPU)
    demoted = _seq(list(range(9)))
    blocks.allocate(demoted, GPU)
    _computed(blocks, demoted)  # its two full blocks registered
    old = blocks.move(demoted, CPU, hold=True)
    assert gpu.hand_out_held(spare=0) == []
    copy = _Copy()
    gpu.hold_until(copy)
    same = _seq(list(range(9)))
    blocks.allocate(same, GPU)  # the registered blocks are found again while their copy still reads them
    assert same.block_table[:2] == old[:2] and same.num_computed_tokens == 8
    blocks.deallocate(same)  # released again before the copy has landed: still not free
    assert set(gpu.free).isdisjoint(old)
    assert blocks.settle(GPU) and copy.waited == 1
    assert gpu.num_free == 4 and not blocks.settle(GPU)


def test_without_a_copy_beside_the_device_lane_held_blocks_are_free_at_once():
    blocks = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=8, cpu_block_size=4)
    demoted = _seq(list(range(9)))
    blocks.allocate(demoted, GPU)
    demoted.num_computed_tokens = 9
    blocks.move(demoted, CPU, hold=True)
    gpu = blocks.pool(GPU)
    gpu.hand_out_held(spare=0)
    gpu.hold_until(None)
    assert gpu.num_free == 4 and gpu.num_landing == 0 and len(gpu.free) == 4
