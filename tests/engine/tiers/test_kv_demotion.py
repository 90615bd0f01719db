"""Demotion: a device sequence the device pool has no room for moves its KV to the host tier and goes on there."""
import pytest
import torch

from cpu_attention import CpuAttentionExecutor
from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner.memory_profile import layer_views
from offload_engine.engine.sched import placement
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.engine.tiers import kv_demotion, kv_promotion
from offload_engine.engine.tiers.move_staging import MoveStaging
from tests.conftest import TEST_DEVICE
from tests.engine.tiers.test_kv_promotion import _tokens_of
from tests.oracle import hf_greedy, random_prompts

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Staged (a layer per group or every layer in one group) or written directly by the device (the pool's twin on
# the test device stands in for the pinned pool that CUDA maps: HostKVPool.device_stacked), in one kernel or with
# the device blocks the next steps reuse first.
@pytest.mark.parametrize("way", ["staged, group per layer", "staged, one group", "mapped, one kernel",
                                 "mapped, reused blocks first"])
def test_demotion_then_promotion_gives_back_the_same_bits(dtype, way, monkeypatch):
    group_bytes = 1 << 30 if way.endswith("one group") else 1
    monkeypatch.setattr(kv_demotion, "GROUP_BYTES", group_bytes)
    monkeypatch.setattr(kv_promotion, "GROUP_BYTES", group_bytes)
    gen = torch.Generator().manual_seed(8)
    layers, hkv, d, host_bs, dev_bs = 3, 2, 8, 8, 4
    device_stacked = torch.randn(layers, 2, 20, dev_bs, hkv, d, generator=gen).to(dtype).to(TEST_DEVICE)
    device = layer_views(device_stacked)  # the engine's layout (memory_profile.allocate_device_pool)
    original = [tuple(t.clone() for t in pair) for pair in device]
    host = [tuple(torch.full((12, hkv, host_bs, d), float("nan"), dtype=dtype) for _ in "kv") for _ in range(layers)]
    # Lengths at, just past and well inside block boundaries of both tiers; blocks shuffled in both pools.
    lengths, dev_tables, host_tables = (8, 13, 1), ([3, 9], [0, 17, 4, 12], [19]), ([5, 2], [11, 0], [7])
    moves = []
    for n, dev_table, host_table in zip(lengths, dev_tables, host_tables):
        seq = Sequence(list(range(n + 1)), SamplingParams(), budget=n + 4)
        seq.num_computed_tokens, seq.block_table = n, host_table
        moves.append((seq, dev_table))
    staging = MoveStaging(torch.device(TEST_DEVICE), num_slots=2)  # three groups: slots are reused
    with CpuAttentionExecutor(num_threads=1, warm=False) as executor:
        if way.startswith("mapped"):
            mapped = torch.stack([torch.stack(layer) for layer in host]).to(TEST_DEVICE)
            # Blocks of all three sequences, the first, a middle and the last of one: ones the next steps reuse.
            first = [9, 0, 4, 19] if way.endswith("first") else []
            at_between = []
            kv_demotion.write_mapped(moves, device_stacked, mapped, dev_bs, first_blocks=first,
                                     between=lambda: at_between.append(mapped.cpu().clone()))
            assert len(at_between) == (1 if first else 0)  # the device lane waits for nothing when none is first
            if first:
                _assert_only_first_blocks_crossed(at_between[0], original, moves, set(first), dev_bs)
            for layer, pair in enumerate(host):
                for which, cache in enumerate(pair):
                    cache.copy_(mapped[layer, which].cpu())
        else:
            for write in kv_demotion.copy_to_host(moves, device_stacked, host, executor, dev_bs, staging):
                write.result()
        untouched = sorted(set(range(12)) - {b for table in host_tables for b in table})
        assert all(torch.isnan(c[untouched].float()).all() for pair in host for c in pair)  # no stray block written
        for (seq, dev_table), n in zip(moves, lengths):
            for layer in range(layers):
                for which in (0, 1):
                    want = _tokens_of(original[layer][which].cpu(), dev_table, n, head_major=False)
                    assert torch.equal(_tokens_of(host[layer][which], seq.block_table, n, head_major=True), want)
        # And back up, into other device blocks, wiped first.
        for pair in device:
            for t in pair:
                t.fill_(float("nan"))
        back = []
        for (seq, dev_table), new_table in zip(moves, ([1, 2], [5, 6, 7, 8], [10])):
            host_table, seq.block_table = seq.block_table, new_table
            back.append((seq, host_table))
        kv_promotion.copy_to_device(back, host, device_stacked, executor, dev_bs, staging)
    for (seq, old_table), n in zip(moves, lengths):
        for layer in range(layers):
            for which in (0, 1):
                want = _tokens_of(original[layer][which].cpu(), dev_tables[lengths.index(n)], n, head_major=False)
                got = _tokens_of(device[layer][which].cpu(), seq.block_table, n, head_major=False)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _assert_only_first_blocks_crossed(host_stacked, original, moves, first, dev_bs):
    """When write_mapped calls between(): a token is in its host row iff its device block is one of `first`."""
    for seq, dev_table in moves:
        host_bs = host_stacked.shape[4]
        for t in range(seq.num_computed_tokens):
            block, row = seq.block_table[t // host_bs], t % host_bs
            got = host_stacked[:, :, block, :, row]  # [L, 2, Hkv, D]
            want = torch.stack([torch.stack([pair[w][dev_table[t // dev_bs], t % dev_bs].cpu() for w in (0, 1)])
                                for pair in original])
            if dev_table[t // dev_bs] in first:
                assert torch.equal(got, want)
            else:
                assert torch.isnan(got.float()).all()


def _run(model_dir, prompts, max_tokens, **kwargs):
    llm = LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", cpu_block_size=16, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _assert_exact(model_dir, prompts, outputs, max_tokens):
    refs = hf_greedy(model_dir, prompts, max(max_tokens))
    for output, ref, n in zip(outputs, refs, max_tokens):
        assert len(output.token_ids) == n  # nothing lost, nothing cut short
        assert output.token_ids[: len(ref)] == ref[:n]


def _assert_all_blocks_free(llm):
    for tier in (GPU, CPU):
        pool = llm.engine.blocks.pool(tier)
        assert pool.num_free == pool.num_blocks


def test_sequences_that_outgrow_the_device_pool_are_demoted_not_recomputed(qwen3_dir):
    # Prompts of 30 take 2 blocks of 16 each: all four fit the 8-block device pool at admission, as under
    # "gpu", and outgrow it during decode (30 + 20 tokens need 4 blocks each).
    prompts = random_prompts((30, 31, 29, 30), 256, seed=100)
    max_tokens = (20, 20, 20, 20)
    llm, outputs = _run(qwen3_dir, prompts, max_tokens, num_gpu_blocks=8, num_cpu_blocks=40, kv_promotion=False)
    scheduler = llm.engine.scheduler
    assert [o.kv_location for o in outputs] == ["gpu"] * 4  # packed as "gpu" packs
    assert scheduler.num_demotions >= 1 and scheduler.num_preemptions == 0
    assert any(o.kv_demoted for o in outputs) and not all(o.kv_demoted for o in outputs)
    _assert_exact(qwen3_dir, prompts, outputs, max_tokens)
    _assert_all_blocks_free(llm)
    llm.close()


def test_demoted_sequences_move_back_up_when_room_frees(qwen3_dir):
    prompts = random_prompts((30, 31, 29, 30, 5), 256, seed=101)
    max_tokens = (4, 30, 30, 30, 40)
    llm, outputs = _run(qwen3_dir, prompts, max_tokens, num_gpu_blocks=8, num_cpu_blocks=40)
    assert any(o.kv_demoted and o.kv_promoted for o in outputs), [(o.kv_demoted, o.kv_promoted) for o in outputs]
    assert llm.engine.scheduler.num_preemptions == 0
    _assert_exact(qwen3_dir, prompts, outputs, max_tokens)
    _assert_all_blocks_free(llm)
    llm.close()



def test_host_rows_swap_places_with_device_rows_nearer_their_end_and_stay_exact(qwen3_dir, monkeypatch):
    """Once every request is admitted, host rows with more tokens left move up past the promotion headroom and the
    device rows nearest their end go down for them (placement.promotions, `rotate`): every row's tokens stay
    transformers' greedy ones, whichever lanes it decoded in."""
    swaps = []
    swaps_in = placement._swaps_in
    monkeypatch.setattr(placement, "_swaps_in", lambda *args: swaps.append(swaps_in(*args)) or swaps[-1])
    # Four prompts of ~40 fill 12 of the 14 device blocks with 30 tokens to go; four of ~20 with 60 to go start on
    # the host, and swap places with device rows as those outgrow the pool and near their end.
    prompts = random_prompts((40, 41, 39, 40, 20, 19, 21, 20), 256, seed=105)
    max_tokens = (30, 30, 30, 30, 60, 60, 60, 60)
    llm, outputs = _run(qwen3_dir, prompts, max_tokens, num_gpu_blocks=14, num_cpu_blocks=128)
    assert any(swaps) and llm.engine.scheduler.num_preemptions == 0
    _assert_exact(qwen3_dir, prompts, outputs, max_tokens)
    _assert_all_blocks_free(llm)
    llm.close()

def test_both_pools_tight_fall_back_to_recompute_and_lose_nothing(qwen3_dir):
    # Four prompts of 30 fill the 8-block device pool and all need a third block in the same step: the
    # newest is demoted into 2 of the host pool's 3 blocks, and the next one, which would need 2 more, is
    # preempted and recomputed. Decided in one scheduling pass, so no timing can change it.
    prompts = random_prompts((30, 30, 30, 30), 256, seed=102)
    max_tokens = (20, 20, 20, 20)
    llm, outputs = _run(qwen3_dir, prompts, max_tokens, num_gpu_blocks=8, num_cpu_blocks=3)
    scheduler = llm.engine.scheduler
    assert scheduler.num_demotions >= 1 and scheduler.num_preemptions >= 1
    _assert_exact(qwen3_dir, prompts, outputs, max_tokens)
    _assert_all_blocks_free(llm)
    llm.close()


def test_auto_admits_to_the_device_exactly_what_gpu_admits():
    """The device lane's batch under "auto" is never smaller than under "gpu": admission is the same rule."""
    from offload_engine.engine.sched.scheduler import Scheduler

    admitted = {}
    for policy in ("gpu", "auto"):
        blocks = BlockManager(num_gpu_blocks=10, block_size=4, num_cpu_blocks=32, cpu_block_size=4)
        scheduler = Scheduler(blocks, policy, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=64,
                              eos_token_ids=())
        for n in (9, 7, 12, 3, 11):  # prompts of 3, 2, 3, 1, 3 blocks; budgets of 4 blocks more each
            scheduler.add(Sequence(list(range(n)), SamplingParams(max_tokens=16), budget=n + 16))
        scheduler.schedule_prefill()
        admitted[policy] = [len(s) for s in scheduler.running if s.location == GPU]
    assert admitted["auto"] == admitted["gpu"] == [9, 7, 12, 3]


def _decoding(scheduler, blocks, prompt_len, tokens_left, tier):
    """A running sequence of prompt_len tokens on tier whose next token starts a new block."""
    from offload_engine.engine.sequence import SequenceStatus

    seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=64), budget=prompt_len + 1 + tokens_left)
    blocks.allocate(seq, tier)
    seq.num_computed_tokens, seq.status = prompt_len, SequenceStatus.RUNNING
    seq.token_ids.append(7)  # sampled last step: its KV is this step's to write
    scheduler.running.append(seq)
    return seq


def test_demotion_takes_the_row_nearest_its_end_and_promotion_the_row_furthest_from_it():
    from offload_engine.engine.sched.scheduler import Scheduler

    blocks = BlockManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          eos_token_ids=(), kv_promotion=True)
    # Three device rows fill the pool and each needs a third block now: demoting one (2 blocks) makes room.
    old, near_end, new = (_decoding(scheduler, blocks, 8, left, GPU) for left in (20, 3, 12))
    assert scheduler.schedule_decode(GPU) == [old, new]
    assert [seq for seq, _ in scheduler.take_demotions()[0]] == [near_end] and near_end.location == CPU
    # Among equals the newest goes, as "gpu" preempts.
    blocks = BlockManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          eos_token_ids=(), kv_promotion=True)
    rows = [_decoding(scheduler, blocks, 8, 5, GPU) for _ in range(3)]
    assert scheduler.schedule_decode(GPU) == rows[:2] and rows[2].location == CPU
    # Promotion: device room (5 blocks) for one of three host rows: the one with more tokens to go, though newest.
    # (Each moves up with room for its whole budget here: PROMOTION_HEADROOM_TOKENS is more than any has left.)
    scheduler.finish(rows[0])
    scheduler.finish(rows[1])
    blocks.allocate(Sequence(list(range(4)), SamplingParams(max_tokens=4), budget=4), GPU)
    few_left, many_left = (_decoding(scheduler, blocks, 8, left, CPU) for left in (2, 9))
    assert blocks.pool(GPU).num_free == 5  # room for the budget of one row of 9 tokens with 9 to go (18 tokens)
    assert [seq for seq, _ in scheduler.schedule_promotions()] == [many_left]
    assert few_left.location == rows[2].location == CPU  # rows[2]: 5 tokens left


@pytest.mark.parametrize("host_lane", ["keeps up", "would not step"])
def test_a_row_the_host_lane_would_not_step_is_demoted_newest_first_as_gpu_preempts(host_lane):
    """A demoted row the host lane would not step with (it makes fewer tokens a second than it costs the device
    lane) sits parked until device room frees, so the newest row goes, to come back at the head of the queue with
    most of its tokens to go; a lane that keeps up takes the row nearest its end, which finishes there."""
    from offload_engine.engine.sched.scheduler import Scheduler
    from tests.engine.sched.test_lane_costs import _lanes

    # Three device rows at 10 ms a step (300 tok/s), 15 ms beside the host lane: a host step costs ~100 tok/s.
    # A host step of one row takes 2 ms (500 tok/s) or 20 ms (50 tok/s).
    fixed = 0.002 if host_lane == "keeps up" else 0.020
    stats = _lanes(3, 0.010, fixed=fixed, per_byte=1e-9, busy_step=0.015)
    blocks = BlockManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          eos_token_ids=(), kv_promotion=True, stats=stats)
    old, near_end, new = (_decoding(scheduler, blocks, 8, left, GPU) for left in (20, 3, 12))
    demoted = near_end if host_lane == "keeps up" else new
    assert scheduler.schedule_decode(GPU) == [s for s in (old, near_end, new) if s is not demoted]
    assert [seq for seq, _ in scheduler.take_demotions()[0]] == [demoted] and demoted.location == CPU
    assert scheduler.num_preemptions == 0 and not stats.checks  # a prediction, not a host step's check


def test_a_full_pool_waits_for_a_demotions_copy_rather_than_demoting_again():
    from offload_engine.engine.sched.scheduler import Scheduler
    from tests.engine.sched.test_block_manager import _Copy

    blocks = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          eos_token_ids=(), kv_promotion=False)
    # Two rows of 2 blocks and one of 4 fill the pool, and each needs a block now: the one nearest its end goes.
    first_row, near_end, last_row = (_decoding(scheduler, blocks, n, left, GPU) for n, left in ((8, 20), (16, 3),
                                                                                                   (8, 12)))
    assert scheduler.schedule_decode(GPU) == [first_row, last_row]
    demoted, first = scheduler.take_demotions(spare_blocks=0)
    assert [seq for seq, _ in demoted] == [near_end] and sorted(first) == sorted(
        first_row.block_table[-1:] + last_row.block_table[-1:])  # the two blocks this step took
    copy = _Copy()
    blocks.pool(GPU).hold_until(copy)
    assert blocks.pool(GPU).num_free == 0 and blocks.pool(GPU).num_landing == 2
    # Four tokens on, both rows need a block again and none is free: the scheduler waits for the copy, whose two
    # blocks are then free, instead of demoting another row.
    for seq in (first_row, last_row):
        seq.token_ids += [7] * 4
        seq.num_computed_tokens = len(seq) - 1
    assert scheduler.schedule_decode(GPU) == [first_row, last_row]
    assert copy.waited == 1 and scheduler.num_demotions == 1 and scheduler.num_preemptions == 0


def test_moves_split_so_one_layer_of_a_batch_fits_a_staging_slot(monkeypatch):
    from offload_engine.engine.tiers import move_staging

    monkeypatch.setattr(move_staging, "GROUP_BYTES", 100)
    seqs = []
    for n in (16, 20, 64, 1, 200, 5):  # host blocks of 16 tokens, 10 bytes a block and layer
        seq = Sequence(list(range(n + 1)), SamplingParams(), budget=n + 2)
        seq.num_computed_tokens = n
        seqs.append((seq, []))
    batches = move_staging.split_moves(seqs, host_block_size=16, bytes_per_block=10)
    assert [[s.num_computed_tokens for s, _ in b] for b in batches] == [[16, 20, 64, 1], [200], [5]]
