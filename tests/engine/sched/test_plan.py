"""Scheduler.plan: one frozen StepPlan per step, made from a LaneState alone (engine/sched/plan.py)."""
import dataclasses

import pytest

from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.plan import LaneState, StepPlan, Wait
from offload_engine.engine.sched.scheduler import Scheduler
from offload_engine.engine.sequence import BlockLocation, Sequence, SequenceStatus
from offload_engine.sampling_params import SamplingParams

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def _scheduler(gpu_blocks=8, cpu_blocks=16, placement="auto", promotion=True) -> Scheduler:
    blocks = BlockManager(num_gpu_blocks=gpu_blocks, block_size=4, num_cpu_blocks=cpu_blocks, cpu_block_size=4)
    return Scheduler(blocks, placement, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                     eos_token_ids=(), kv_promotion=promotion)


def _decoding(scheduler: Scheduler, prompt_len: int, tokens_left: int, tier: BlockLocation) -> Sequence:
    """A running row of prompt_len tokens on `tier`, its newest sampled token's KV this step's to write."""
    seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=64), budget=prompt_len + 1 + tokens_left)
    scheduler.blocks.allocate(seq, tier)
    seq.num_computed_tokens, seq.status = prompt_len, SequenceStatus.RUNNING
    seq.token_ids.append(7)
    scheduler.running.append(seq)
    return seq


def _waiting(scheduler: Scheduler, prompt_len: int) -> Sequence:
    seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=4), budget=prompt_len + 4)
    scheduler.add(seq)
    return seq


def test_a_plan_is_frozen():
    plan = _scheduler().plan(LaneState())
    assert isinstance(plan, StepPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.wait = Wait.HOST_STEP


def test_a_waiting_prompt_makes_a_prefill_step_that_decodes_nothing():
    scheduler = _scheduler()
    row = _decoding(scheduler, 6, 10, GPU)
    prompt = _waiting(scheduler, 10)
    plan = scheduler.plan(LaneState())
    assert plan.is_prefill and plan.prefill == (prompt,) and prompt.num_scheduled_tokens == 10
    assert plan.device_rows == plan.host_rows == plan.demotions == () and len(row.block_table) == 2


def test_with_a_prefill_lane_device_tier_prompts_go_there_and_the_step_decodes():
    scheduler = _scheduler()
    row = _decoding(scheduler, 6, 10, GPU)
    prompt = _waiting(scheduler, 10)
    plan = scheduler.plan(LaneState(prefill_lane=True))
    assert plan.prefill_elsewhere == (prompt,) and not plan.is_prefill and plan.device_rows == (row,)
    assert prompt.in_flight  # until the lane takes it in


def test_a_prompts_last_token_on_the_prefill_lane_is_not_also_a_decode_row():
    """A prompt whose prefix hit leaves one token to compute is decodable (Sequence.in_prefill is False), but that
    token is prefilled on the lane this step: the row must not decode on the device in the same step."""
    scheduler = _scheduler()
    row = _decoding(scheduler, 6, 10, GPU)
    earlier = _decoding(scheduler, 8, 10, GPU)  # two full blocks of tokens 0-7, registered for reuse
    scheduler.blocks.register_computed_blocks(earlier)
    scheduler.finish(earlier)
    repeat = _waiting(scheduler, 9)  # tokens 0-8: a hit on both blocks, one token left to compute
    plan = scheduler.plan(LaneState(prefill_lane=True))
    assert plan.prefill_elsewhere == (repeat,) and repeat.num_scheduled_tokens == 1 and not repeat.in_prefill
    assert plan.device_rows == (row,)


def test_while_the_prefill_lane_computes_no_prompt_is_admitted():
    scheduler = _scheduler()
    prompt = _waiting(scheduler, 10)
    plan = scheduler.plan(LaneState(prefill_lane=True, prefill_lane_computing=True, prefill_lane_busy=True))
    assert plan.prefill == plan.prefill_elsewhere == () and list(scheduler.waiting) == [prompt]
    assert plan.wait == Wait.PREFILL_LANE


def test_a_decode_step_lists_each_lanes_rows_and_the_host_lane_starts_only_if_idle():
    scheduler = _scheduler()
    device = _decoding(scheduler, 6, 10, GPU)
    host = _decoding(scheduler, 6, 10, CPU)
    plan = scheduler.plan(LaneState())
    assert plan.device_rows == (device,) and plan.host_rows == (host,) and plan.wait == Wait.NOTHING
    host.in_flight = True  # what the engine does with plan.host_rows
    device.num_computed_tokens += 1
    device.token_ids.append(7)
    plan = scheduler.plan(LaneState(host_step_in_flight=True))
    assert plan.device_rows == (device,) and plan.host_rows == ()


@pytest.mark.parametrize("lanes, wait", [
    (LaneState(device_step_in_flight=True), Wait.DEVICE_STEP),
    (LaneState(promotions_landing=True), Wait.PROMOTIONS),
    (LaneState(host_step_in_flight=True), Wait.HOST_STEP),
    (LaneState(prefill_lane=True, prefill_lane_busy=True), Wait.PREFILL_LANE),
    (LaneState(), Wait.NOTHING),
])
def test_without_device_rows_the_plan_names_what_to_wait_for(lanes, wait):
    """The first of: the device step in flight, promotions' copies, the prefill lane, the host lane's step."""
    scheduler = _scheduler()
    plan = scheduler.plan(lanes)
    assert plan.device_rows == () and plan.wait == wait and plan.idle_host_rows == ()


@pytest.mark.parametrize("lanes, steps_host", [
    (LaneState(device_step_in_flight=True), False),
    (LaneState(promotions_landing=True), False),
    (LaneState(prefill_lane=True, prefill_lane_busy=True), True),
    (LaneState(), True),
])
def test_without_device_rows_a_host_lane_the_cost_check_held_back_steps_unless_the_device_lane_comes_first(
        lanes, steps_host, monkeypatch):
    scheduler = _scheduler(promotion=False)
    host = _decoding(scheduler, 8, 10, CPU)  # its next token starts a third block
    monkeypatch.setattr(scheduler, "host_step_pays", lambda: False)
    plan = scheduler.plan(lanes)
    assert plan.host_rows == ()
    assert plan.idle_host_rows == ((host,) if steps_host else ())
    assert len(host.block_table) == (3 if steps_host else 2)  # only a row that steps takes its next block
    if not lanes.device_step_in_flight and not lanes.promotions_landing and not lanes.prefill_lane_busy:
        assert plan.wait == Wait.HOST_STEP


def test_demotions_come_with_the_device_blocks_the_next_steps_may_write():
    """Three device rows fill the pool and each needs a third block: the row nearest its end is demoted, and its
    old device blocks are among those the next steps take first (their copy goes first)."""
    scheduler = _scheduler(gpu_blocks=6)
    old, near_end, new = (_decoding(scheduler, 8, left, GPU) for left in (20, 3, 12))
    old_blocks = list(near_end.block_table)
    plan = scheduler.plan(LaneState())
    assert plan.device_rows == (old, new) and near_end.location == CPU
    assert [(seq, blocks) for seq, blocks in plan.demotions] == [(near_end, old_blocks)]
    assert plan.first_freed_blocks and set(plan.first_freed_blocks) <= set(old_blocks)
    assert scheduler.plan(LaneState(device_step_in_flight=True)).demotions == ()  # handed out once


@pytest.mark.parametrize("sit_out", [False, True])
def test_promoted_rows_sit_out_the_step_when_their_copy_lands_later(sit_out):
    scheduler = _scheduler(gpu_blocks=8)
    host = _decoding(scheduler, 6, 10, CPU)
    plan = scheduler.plan(LaneState(promotions_sit_out=sit_out))
    assert [seq for seq, _ in plan.promotions] == [host] and host.location == GPU
    assert host.in_flight == sit_out
    assert plan.device_rows == (() if sit_out else (host,))
    if sit_out:
        assert plan.wait == Wait.PROMOTIONS


def test_no_promotion_starts_where_the_lanes_do_not_allow_one():
    scheduler = _scheduler(gpu_blocks=8)
    host = _decoding(scheduler, 6, 10, CPU)
    plan = scheduler.plan(LaneState(may_promote=False))
    assert plan.promotions == () and host.location == CPU and plan.host_rows == (host,)
