"""Promotion in parts (Scheduler.promote_in_parts; on unless OFFLOAD_ENGINE_PROMOTE_IN_PARTS=0): a host row takes
spare device room for its leading blocks and becomes a split row; once the rest fits, the split row is promoted, its
host part copied after its device part. Greedy tokens equal transformers' along the path host -> split -> device."""
import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.engine.sched import placement
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def _host_row(blocks: BlockManager, num_tokens: int, budget: int) -> Sequence:
    seq = Sequence(list(range(num_tokens + 1)), SamplingParams(), budget=budget)
    blocks.allocate(seq, CPU)
    seq.num_computed_tokens = num_tokens  # decoding: all but the newest token have KV
    return seq


def test_a_host_row_grows_a_device_part_then_moves_the_rest_after_it():
    blocks = BlockManager(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8, cpu_block_size=8)
    seq = _host_row(blocks, 30, budget=40)
    assert len(seq.block_table) == 4 and not seq.is_split
    growth, old = blocks.grow_device_part(seq, 2)
    assert seq.is_split and seq.location == CPU and seq.num_device_tokens == 16 and seq.num_host_tokens == 15
    assert growth.num_computed_tokens == 16 and len(growth.block_table) == 4 and seq.device_prefix == growth.block_table
    assert len(old) == 2 and seq.num_hashed_blocks == 4  # the device part's 4-token blocks, registered
    prefix = list(seq.device_prefix)
    move, old = blocks.promote_split(seq)
    assert seq.location == GPU and not seq.is_split and seq.num_device_tokens == 0
    assert move.num_computed_tokens == 14 and len(move.block_table) == 4  # tokens 16-29: the copy's source order
    assert seq.block_table == prefix + move.block_table and len(old) == 2
    assert blocks.pool(CPU).num_free == 8 and blocks.pool(GPU).num_free == 8
    assert seq.num_hashed_blocks == 7  # registered on from the device part's blocks


def test_a_split_row_whose_device_part_holds_all_its_kv_is_promoted_with_nothing_to_copy():
    """Found under load (tests/engine/test_load.py) once parts were on: a row of exactly one full host block takes
    it as its device part; promoted, its move carries no computed token (its old host block holds only the newest
    token's slot, not yet written), and the copy skips it (it once reached the host gather with zero blocks and
    failed)."""
    from offload_engine.engine.tiers import tier_moves

    blocks = BlockManager(num_gpu_blocks=4, block_size=16, num_cpu_blocks=4, cpu_block_size=16)
    seq = _host_row(blocks, 16, budget=30)
    blocks.grow_device_part(seq, 1)
    assert seq.is_split and seq.num_device_tokens == seq.num_computed_tokens == 16
    move = blocks.promote_split(seq)
    assert move[0].num_computed_tokens == 0 and move[0].block_table == [] and seq.location == GPU
    assert tier_moves.promote(None, [move]) is None  # returns before it touches a runner: nothing crosses


def test_promotions_take_a_split_row_at_the_room_its_host_part_needs():
    blocks = BlockManager(num_gpu_blocks=20, block_size=16, num_cpu_blocks=8, cpu_block_size=16)
    whole, split = _host_row(blocks, 40, budget=60), _host_row(blocks, 40, budget=60)
    blocks.grow_device_part(split, 2)
    taken = [blocks.pool(GPU).take_free() for _ in range(20 - 2 - 3)]  # 3 blocks free: too few for a whole row
    assert len(taken) == 15 and blocks.pool(GPU).num_free == 3
    rows = [whole, split]
    assert list(placement.promotions(rows, blocks)) == []
    assert list(placement.promotions(rows, blocks, in_parts=True)) == [split]  # 4 blocks of budget, 2 held


def test_spare_room_goes_to_a_whole_host_row_only_in_parts_once_and_at_least_half():
    blocks = BlockManager(num_gpu_blocks=6, block_size=16, num_cpu_blocks=8, cpu_block_size=16)
    seq = _host_row(blocks, 40, budget=60)
    assert placement.split_growth(seq, blocks, [seq]) == 0
    assert placement.split_growth(seq, blocks, [seq], in_parts=True) == 2  # its two full blocks; the third is not
    taken = [blocks.pool(GPU).take_free() for _ in range(5)]  # one block spare: 16 of 40 tokens, under half
    assert placement.split_growth(seq, blocks, [seq], in_parts=True) == 0
    for block_id in taken:
        blocks.pool(GPU).release(block_id)
    blocks.grow_device_part(seq, 1)  # its part taken: a full host block and room are left, but it is not grown again
    assert (seq.num_computed_tokens - seq.num_device_tokens) // 16 == 1 and blocks.pool(GPU).num_free >= 4
    assert placement.split_growth(seq, blocks, [seq], in_parts=True) == 0


@pytest.mark.parametrize("arch,cpu_block_size", [("qwen3", 16), ("llama", 32)])
def test_host_rows_promoted_in_parts_stay_exact(tiny_models, monkeypatch, arch, cpu_block_size):
    """Budgets of 43-66 tokens take 3-5 device blocks: the short rows fill the 6-block pool, the long ones go to the
    host. When a short row ends, the room is too small for a long row whole: with parts on (the default), the first
    takes it as a device part, and is promoted (its host part only) when the second short row ends."""
    monkeypatch.delenv("OFFLOAD_ENGINE_PROMOTE_IN_PARTS", raising=False)
    model_dir = tiny_models[arch]
    prompts = random_prompts((40, 41, 39, 42), 256, seed=60)
    max_tokens = (4, 4, 24, 24)
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
             cpu_block_size=cpu_block_size) as llm:
        promoted_split = []
        promote_split = llm.engine.blocks.promote_split
        llm.engine.blocks.promote_split = lambda seq: promoted_split.append(seq.seq_id) or promote_split(seq)
        outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                         for n in max_tokens], use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.promote_in_parts and scheduler.num_split_growths >= 1 and promoted_split
        assert [o.kv_location for o in outputs] == ["gpu", "gpu", "cpu", "cpu"]
        assert [o.kv_promoted for o in outputs] == [False, False, True, True]
        gpu = llm.engine.blocks.pool(GPU)
        assert gpu.num_free == gpu.num_blocks  # every moved row gave its device blocks back
    for output, ref, n in zip(outputs, hf_greedy(model_dir, prompts, 24), max_tokens):
        assert output.token_ids == ref[:n]


def test_promotion_in_parts_is_off_when_switched_off(qwen3_dir, monkeypatch):
    """OFFLOAD_ENGINE_PROMOTE_IN_PARTS=0, the A/B switch: the run above takes no device part."""
    monkeypatch.setenv("OFFLOAD_ENGINE_PROMOTE_IN_PARTS", "0")
    with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
             cpu_block_size=16) as llm:
        llm.generate(random_prompts((40, 41, 39, 42), 256, seed=60),
                     [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 4, 24, 24)],
                     use_tqdm=False)
        assert not llm.engine.scheduler.promote_in_parts and llm.engine.scheduler.num_split_growths == 0
