"""The admission check's horizon: when host rows would move up, and what the host lane gains until then."""
import math

import pytest

from offload_engine import SamplingParams
from offload_engine.engine.sched import placement
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.host_stay import promotion_delays, promotion_order
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sched.placement import (PROMOTION_HEADROOM_TOKENS, PROMOTION_HOLD_STEPS, choose_tier,
                                                   promotions)
from offload_engine.engine.sequence import BlockLocation, Sequence

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def _seq(prompt: int, new_tokens: int) -> Sequence:
    return Sequence(list(range(prompt)), SamplingParams(max_tokens=new_tokens), budget=prompt + new_tokens)


def _placed(blocks: BlockManager, tier: BlockLocation, prompt: int, new_tokens: int) -> Sequence:
    seq = _seq(prompt, new_tokens)
    blocks.allocate(seq, tier)
    return seq


def test_host_rows_move_up_as_the_device_rows_that_make_room_for_them_end():
    blocks = BlockManager(100, 16, 1000, 16, False)
    # Device rows: 40 and 48 blocks now, 45 and 50 at their ends, 10 and 32 steps away; 12 blocks free.
    device = [_placed(blocks, GPU, 640, 80), _placed(blocks, GPU, 768, 32)]
    device[0].token_ids += [1] * 70  # 10 tokens left
    assert [s.tokens_left for s in device] == [10, 32] and blocks.pool(GPU).num_free == 12
    first, second, short = _seq(600, 500), _seq(600, 400), _seq(100, 3)
    step, rate = 0.01, 10.0  # a device step, and a host row's tokens a second
    # The device rows' growth to their budgets (5 + 2 blocks) is reserved: 5 blocks are free for host rows.
    # `first` needs 38 (its next token included): the row ending in 10 steps frees 45, and `first` moves up then,
    # holding its whole budget (69 blocks) from then on. So `second` fits only once `first` has ended too (499
    # more steps), not when the other device row ends (0.32 s, 50 blocks). `short` ends on the host (0.3 s) first.
    delays = promotion_delays(promotion_order([short, second, first]), device, blocks, step, rate)
    assert delays == pytest.approx([0.1, 0.1 + 499 * step, math.inf])
    # A row that never fits the device pool whole never moves up.
    assert promotion_delays([_seq(1600, 100)], device, blocks, step, rate) == [math.inf]


def test_the_forecast_takes_host_rows_in_the_order_promotions_takes_them():
    blocks = BlockManager(400, 16, 1000, 16, False)
    rows = [_placed(blocks, CPU, 100, tokens) for tokens in (50, 300, 300, 10)]
    for row in rows:
        row.num_computed_tokens = len(row)  # prefilled: promotions() passes over rows still in prefill
    assert promotion_order(rows) == [rows[1], rows[2], rows[0], rows[3]]
    assert list(promotions(rows, blocks)) == promotion_order(rows)


def test_a_promotion_leaves_room_for_the_next_tokens_of_every_device_row():
    """A row moved into room a demotion had just freed overflowed the device again a few steps later, and the next
    row near its end went back down: promotions keep PROMOTION_HEADROOM_TOKENS of room for each row."""
    assert PROMOTION_HEADROOM_TOKENS == 64  # the arithmetic below is in 16-token blocks: 4 blocks of headroom
    blocks = BlockManager(100, 16, 1000, 16, False)
    device = _placed(blocks, GPU, 1200, 1000)  # 75 blocks; 79 with the headroom
    host = _placed(blocks, CPU, 320, 1000)  # 20 blocks, 21 with its next token, 24 with the headroom
    host.num_computed_tokens = len(host)
    rows = [device, host]
    assert blocks.pool(GPU).num_free == 25 and list(promotions(rows, blocks)) == []  # 4 + 24 > 25
    assert list(promotions(rows, blocks, extra_room=3)) == [host]  # 28 blocks: room for both
    device.budget = len(device) + 16  # one block left of its budget: it needs no more than that
    assert list(promotions(rows, blocks)) == [host]
    host.budget = len(host) + 1  # ends after its next token: that is all the room it needs (21 blocks)
    device.budget = len(device) + 64
    assert list(promotions(rows, blocks)) == [host]


def test_a_new_request_waits_behind_a_host_row_that_waits_for_device_room():
    """As "gpu" re-admits a preempted sequence before later requests, a row demoted to the host tier takes device
    room before a new request does, even one whose prompt fits what is free now."""
    blocks = BlockManager(100, 16, 1000, 16, False)
    device = _placed(blocks, GPU, 1200, 100)  # 75 blocks: 25 free
    demoted = _placed(blocks, CPU, 1000, 200)  # needs 63 device blocks to move up
    newcomer = _seq(300, 100)  # 19 blocks: fits now
    running = [device, demoted]
    assert blocks.can_allocate(newcomer, GPU)
    assert choose_tier(newcomer, "auto", blocks, running, LaneStats(1000)) is CPU  # the unmeasured lane is tried
    assert choose_tier(newcomer, "auto", blocks, [r for r in running if r is not demoted]) is GPU
    assert choose_tier(newcomer, "gpu", blocks, running) is GPU


def test_a_request_is_held_behind_host_rows_for_a_bounded_number_of_steps():
    """A host row that does not move up (always in a host step) must not keep a request whose prompt fits off the
    device for good: it would decode alone at the end of the batch."""
    blocks = BlockManager(100, 16, 1000, 16, False)
    running = [_placed(blocks, GPU, 1200, 100), _placed(blocks, CPU, 1000, 200)]
    newcomer = _seq(300, 100)
    start = 1000
    for step in range(start, start + PROMOTION_HOLD_STEPS):  # held: offered the host tier (no stats) instead
        assert choose_tier(newcomer, "auto", blocks, running, step=step) is not GPU
    assert newcomer.held_since == start
    assert choose_tier(newcomer, "auto", blocks, running, step=start + PROMOTION_HOLD_STEPS) is GPU
    # Waiting for room is not a hold: a request whose prompt does not fit yet starts no clock.
    too_long = _seq(500, 10)  # 32 blocks, 25 free
    assert choose_tier(too_long, "auto", blocks, running, kv_promotion=True, step=start) is not GPU
    assert too_long.held_since is None
    # With promotions off (kv_promotion=False) there is nothing to wait for.
    assert choose_tier(_seq(300, 100), "auto", blocks, running, kv_promotion=False, step=start) is GPU


def test_move_cost_is_seeded_from_the_link_then_measured():
    stats = LaneStats(kv_bytes_per_token=1000)
    assert stats.move_seconds_per_token == 0.0  # nothing known: moves look free
    seeded = LaneStats(kv_bytes_per_token=1000, link_seconds_per_byte=1 / 50e9)
    assert math.isclose(seeded.move_seconds_per_token, 1000 / 50e9)
    seeded.move_done(2000, 0.004)
    assert math.isclose(seeded.move_seconds_per_token, 2e-6)
    seeded.move_done(0, 1.0)  # nothing moved: nothing learnt
    assert math.isclose(seeded.move_seconds_per_token, 2e-6)
    assert seeded.snapshot()["moves_measured"] == 1



def test_once_no_request_waits_a_host_row_swaps_past_the_headroom_with_a_device_row_nearer_its_end(monkeypatch):
    """With `rotate`, a host row the headroom keeps out moves up when its next token fits and the row the next
    demotion would take holds at least as much KV and has fewer tokens left: the device pool then holds the rows
    furthest from their end, which hold the least KV, and runs more of them."""
    blocks = BlockManager(100, 16, 1000, 16, False)
    device = _placed(blocks, GPU, 1200, 20)  # 75 blocks; 76 with its next token, 77 at its budget
    host = _placed(blocks, CPU, 320, 1000)  # 20 blocks, 21 with its next token, 24 with the headroom
    device.num_computed_tokens, host.num_computed_tokens = 1200, 320
    rows = [device, host]
    assert blocks.pool(GPU).num_free == 25
    assert list(promotions(rows, blocks)) == []  # the headroom: 2 + 24 > 25
    assert list(promotions(rows, blocks, rotate=True)) == [host]  # the next tokens: 1 + 21 <= 25
    monkeypatch.setattr(placement, "SWAP_GAP_TOKENS", 1000 - 20 + 1)  # a wider gap than theirs
    assert list(promotions(rows, blocks, rotate=True)) == []
    monkeypatch.undo()
    # No swap with a device row that has as many tokens left (its headroom: 4 blocks; 4 + 24 > 25)...
    device.budget = len(device) + 1000
    assert list(promotions(rows, blocks, rotate=True)) == []
    # ...or less KV than the host row: a 300-token row with 20 left beside one of 1,000 with 1,000 left, 25 blocks
    # free (headroom: 1 + 4 + 24 > 25; next tokens: 21 <= 25).
    small = BlockManager(19 + 63 + 25, 16, 1000, 16, False)
    others = [_placed(small, GPU, 300, 20), _placed(small, GPU, 1000, 1000), _placed(small, CPU, 320, 1000)]
    for row in others:
        row.num_computed_tokens = len(row)
    assert small.pool(GPU).num_free == 25 and list(promotions(others, small, rotate=True)) == []
    # ...or where the next tokens of both do not fit (400 tokens: 26 blocks with the next one; 1 + 26 > 25).
    device.budget = len(device) + 20
    host.token_ids += [7] * 80
    host.num_computed_tokens, host.budget = len(host), len(host) + 1000
    assert list(promotions(rows, blocks, rotate=True)) == []
    del host.token_ids[320:]
    host.num_computed_tokens, host.budget = len(host), len(host) + 1000
    assert list(promotions(rows, blocks, rotate=True)) == [host]


def test_the_swap_completes_as_the_pool_overflows_and_waits_while_a_request_does():
    """The scheduler swaps only while no request waits for room (device room is theirs first); the row it promotes
    past the headroom overflows the pool within a few steps, and the demotion takes the row nearest its end."""
    from offload_engine.engine.sched.scheduler import Scheduler
    from tests.engine.tiers.test_kv_demotion import _decoding

    def build(waiting: bool):
        blocks = BlockManager(num_gpu_blocks=9, block_size=4, num_cpu_blocks=16, cpu_block_size=4)
        scheduler = Scheduler(blocks, "auto", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                              eos_token_ids=(), kv_promotion=True)
        # Device rows of 9 and 13 tokens (2 + 3 blocks, a block more each for this step's token), 20 and 8 tokens
        # left; a host row of 5 tokens with 30 left, which needs 2 device blocks with its next token.
        rows = [_decoding(scheduler, blocks, n, left, tier) for n, left, tier in ((8, 20, GPU), (12, 8, GPU),
                                                                                 (4, 30, CPU))]
        if waiting:
            scheduler.add(Sequence(list(range(40)), SamplingParams(max_tokens=4), budget=44))
        return scheduler, rows

    scheduler, _ = build(waiting=True)
    assert scheduler.schedule_promotions() == []
    scheduler, (far, near_end, host) = build(waiting=False)
    assert [seq for seq, _ in scheduler.schedule_promotions()] == [host]
    for _ in range(8):  # the pool overflows in the fifth step
        batch = scheduler.schedule_decode(GPU)
        if scheduler.num_demotions:
            break
        for seq in batch:  # the step's tokens: each row's next token has KV and one more is sampled
            seq.num_computed_tokens += 1
            seq.token_ids.append(7)
    assert [seq for seq, _ in scheduler.take_demotions()[0]] == [near_end]
    assert far.location == host.location == GPU and near_end.location == CPU and scheduler.num_preemptions == 0
