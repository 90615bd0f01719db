"""Promotion: host-tier sequences move their KV into device-pool room that no waiting request takes."""
import pytest
import torch

from cpu_attention import CpuAttentionExecutor
from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner.memory_profile import layer_views
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence, SequenceStatus
from offload_engine.engine.tiers import kv_promotion
from offload_engine.engine.tiers.move_staging import MoveStaging
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def _tokens_of(cache: torch.Tensor, block_table: list[int], num_tokens: int, head_major: bool) -> torch.Tensor:
    """[num_tokens, Hkv, D] read token by token from either tier's layout (the reference for the copy)."""
    size = cache.shape[2] if head_major else cache.shape[1]
    rows = [cache[block_table[t // size], :, t % size] if head_major else cache[block_table[t // size], t % size]
            for t in range(num_tokens)]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Staged or read directly by the device (the pool's twin on the test device stands in for the pinned pool that
# CUDA maps: HostKVPool.device_stacked), with a layer per group or every layer in one group.
@pytest.mark.parametrize("way", ["staged, group per layer", "staged, one group", "mapped, group per layer",
                                 "mapped, one group"])
def test_copy_moves_every_token_to_its_new_device_slot(dtype, way, monkeypatch):
    monkeypatch.setattr(kv_promotion, "GROUP_BYTES", 1 << 30 if way.endswith("one group") else 1)
    gen = torch.Generator().manual_seed(7)
    layers, hkv, d, host_bs, dev_bs = 3, 2, 8, 8, 4
    host = [tuple(torch.randn(12, hkv, host_bs, d, generator=gen).to(dtype) for _ in "kv") for _ in range(layers)]
    device_stacked = torch.full((layers, 2, 20, dev_bs, hkv, d), float("nan"), dtype=dtype, device=TEST_DEVICE)
    device = layer_views(device_stacked)  # the engine's layout (memory_profile.allocate_device_pool)
    # Lengths at, just past and well inside block boundaries of both tiers; host blocks shuffled.
    lengths, host_tables, dev_tables = (8, 13, 1), ([5, 2], [11, 0], [7]), ([3, 9], [0, 17, 4, 12], [19])
    moves = []
    for n, host_table, dev_table in zip(lengths, host_tables, dev_tables):
        seq = Sequence(list(range(n + 1)), SamplingParams(), budget=n + 4)
        seq.num_computed_tokens, seq.block_table = n, dev_table
        moves.append((seq, host_table))
    if way.startswith("mapped"):
        mapped = torch.stack([torch.stack(layer) for layer in host]).to(TEST_DEVICE)
        kv_promotion.read_mapped(moves, mapped, device_stacked, dev_bs)
    else:
        with CpuAttentionExecutor(num_threads=1, warm=False) as executor:
            # Two slots for three groups: the third reuses the first once its copy has read it.
            kv_promotion.copy_to_device(moves, host, device_stacked, executor, dev_bs,
                                        MoveStaging(torch.device(TEST_DEVICE), num_slots=2))
    device = [(k.cpu(), v.cpu()) for k, v in device]
    for (seq, host_table), n in zip(moves, lengths):
        for layer in range(layers):
            for which in (0, 1):
                want = _tokens_of(host[layer][which], host_table, n, head_major=True)
                got = _tokens_of(device[layer][which], seq.block_table, n, head_major=False)
                assert torch.equal(got, want)
    written = sum(int((~torch.isnan(k.float())).all(dim=(2, 3)).sum()) for k, _ in device) // layers
    assert written == sum(lengths)  # no slot beyond the sequences' tokens was touched


def test_move_re_homes_the_blocks_and_registers_them_for_prefix_reuse():
    blocks = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=4, cpu_block_size=8)
    seq = Sequence(list(range(11)), SamplingParams(), budget=20)
    blocks.allocate(seq, CPU)
    seq.num_computed_tokens = 10  # decoding: all but the newest token have KV
    old = blocks.move(seq, GPU)
    assert len(old) == 2 and blocks.pool(CPU).num_free == 4
    assert seq.location == GPU and seq.admitted_to == CPU and len(seq.block_table) == 3
    assert blocks.pool(GPU).num_free == 5 and seq.num_hashed_blocks == 2
    again = Sequence(list(range(9)), SamplingParams(), budget=12)
    blocks.allocate(again, GPU)
    assert again.num_computed_tokens == 8 and again.block_table[:2] == seq.block_table[:2]


def _promoted_run(model_dir, prompts, max_tokens, **kwargs):
    llm = LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
              cpu_block_size=16, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_host_sequences_move_up_when_the_device_lane_runs_dry_and_stay_exact(qwen3_dir):
    # Budgets of 44-45 tokens take 3 device blocks each: the first two fill the 6-block pool, the long
    # ones go to the host and move up once the short ones have finished.
    prompts = random_prompts((40, 41, 39, 42), 256, seed=60)
    max_tokens = (4, 4, 24, 24)
    llm, outputs = _promoted_run(qwen3_dir, prompts, max_tokens)
    assert [o.kv_location for o in outputs] == ["gpu", "gpu", "cpu", "cpu"]
    assert [o.kv_promoted for o in outputs][:3] == [False, False, True]
    assert llm.engine.scheduler.num_promotions >= 1 and llm.engine.scheduler.num_preemptions == 0
    for output, ref, n in zip(outputs, hf_greedy(qwen3_dir, prompts, 24), max_tokens):
        assert output.token_ids == ref[:n]
    gpu = llm.engine.blocks.pool(GPU)
    assert gpu.num_free == gpu.num_blocks  # every moved sequence gave its device blocks back


def test_without_promotion_host_sequences_stay_on_the_host(qwen3_dir):
    prompts = random_prompts((40, 41, 39, 42), 256, seed=60)
    llm, outputs = _promoted_run(qwen3_dir, prompts, (4, 4, 24, 24), kv_promotion=False)
    assert not any(o.kv_promoted for o in outputs) and llm.engine.scheduler.num_promotions == 0
    assert [o.kv_location for o in outputs] == ["gpu", "gpu", "cpu", "cpu"]


def test_kv_promotion_must_be_a_bool(qwen3_dir):
    with pytest.raises(ValueError, match="kv_promotion"):
        LLM(qwen3_dir, device=TEST_DEVICE, kv_promotion="yes")



def test_host_sequences_that_room_frees_up_for_sit_out_the_next_host_step():
    from offload_engine.engine.sched.scheduler import Scheduler

    blocks = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          eos_token_ids=(), kv_promotion=True)
    ending = Sequence(list(range(12)), SamplingParams(max_tokens=4), budget=16)  # 4 device blocks: the whole pool
    first, second = (Sequence(list(range(n)), SamplingParams(max_tokens=4), budget=n + 4) for n in (8, 9))
    for seq, tier in ((ending, GPU), (first, CPU), (second, CPU)):
        blocks.allocate(seq, tier)
        seq.num_computed_tokens, seq.status = len(seq) - 1, SequenceStatus.RUNNING  # decoding
        scheduler.running.append(seq)
    # `ending` has 4 tokens left: within a 5-step horizon its 4 blocks free up, enough for `first` (3 blocks)
    # but not for both (3 + 4).
    assert scheduler.promotion_hold_back(horizon_steps=5) == {first.seq_id}
    assert scheduler.promotion_hold_back(horizon_steps=2) == frozenset()
    host_batch = scheduler.schedule_decode(CPU, hold_back=scheduler.promotion_hold_back(5))
    assert host_batch == [second]
    scheduler.finish(ending)
    assert [seq for seq, _ in scheduler.schedule_promotions()] == [first] and first.location == GPU


class _SlowCopy:
    """A promotion's event (CUDA's own, or none where the copy was synchronous) that reports the copy still running
    for the first `polls` queries."""

    def __init__(self, event, polls: int):
        self.event, self.polls, self.landed, self.queries = event, polls, False, 0

    def query(self) -> bool:
        self.queries += 1
        self.landed = self.landed or (self.queries > self.polls and (self.event is None or self.event.query()))
        return self.landed

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.landed = True


@pytest.mark.parametrize("polls", [0, 3, 1000])  # lands at once, after a few device steps, only when waited for
@pytest.mark.parametrize("group_bytes", [1, 1 << 40])  # a copy per sequence, or every promotion of a step in one
def test_promoted_sequences_sit_out_both_lanes_until_their_copy_lands(qwen3_dir, polls, group_bytes, monkeypatch):
    from offload_engine.engine import llm_engine
    from offload_engine.engine.runner.model_runner import ModelRunner

    monkeypatch.setattr(llm_engine, "PROMOTION_GROUP_BYTES", group_bytes)
    # CUDA promotions copy beside the device lane's steps (ModelRunner.promote returns their event, and the runner
    # says so before the step is planned); here the event is made to report the copy running for longer (on CPU the
    # copy itself is synchronous, and the runner is made to say it is not).
    monkeypatch.setattr(ModelRunner, "promotes_beside_device_lane", True)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
              cpu_block_size=16)
    engine, copies = llm.engine, []
    promote = engine.runner.promote

    def slow_promote(moves):
        event = promote(moves)
        assert (event is None) == (TEST_DEVICE == "cpu")
        copies.append((_SlowCopy(event, polls), [seq for seq, _ in moves]))
        return copies[-1][0]

    def checked(step):
        def checked_step(seqs):
            for copy, rows in copies:
                assert copy.landed or not set(map(id, rows)) & set(map(id, seqs)), "decoded before its KV landed"
            return step(seqs)
        return checked_step

    engine.runner.promote = slow_promote
    for name in ("prefill", "decode_host", "launch_device_decode"):
        setattr(engine.runner, name, checked(getattr(engine.runner, name)))
    # The short rows fill the 6 device blocks; the long ones (3 blocks each at their budgets, which a promotion
    # leaves room for) start on the host tier and move up together when the short ones end.
    prompts = random_prompts((40, 41, 30, 31), 256, seed=60)
    max_tokens = (4, 4, 16, 16)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert copies and all(copy.landed for copy, _ in copies) and not engine.promoting
    assert group_bytes > 1 or all(len(rows) == 1 for _, rows in copies)
    assert [o.kv_promoted for o in outputs][2:] == [True, True]  # both long ones moved up (the test's point)
    for output, ref, n in zip(outputs, hf_greedy(qwen3_dir, prompts, 16), max_tokens):
        assert output.token_ids == ref[:n]
    llm.close()
