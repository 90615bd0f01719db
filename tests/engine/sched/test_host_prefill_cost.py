"""The admission check counts what a host-tier prompt's prefill costs beyond a device-tier one's
(LaneStats.prefill_done, placement.host_lane_pays)."""
import random

import pytest

from offload_engine.engine.sched.lane_stats import DevicePrefillSteps, LaneStats
from offload_engine.engine.sched.placement import MIN_PREFILL_SAMPLES, host_lane_pays
from tests.engine.sched.test_lane_costs import KV_BYTES, _device_rows, _host_seq, _lanes, _measured, _pools


def test_device_tier_prefill_steps_are_a_line_with_a_fixed_part_robust_to_stalls():
    """Steps of 20 ms + 5 us a token, with noise and two stalled steps: per token alone would charge a 1,024-token
    step 5 + 20000/n_mean us a token; the line gives each size its own time."""
    rng = random.Random(1)
    steps = DevicePrefillSteps()
    assert steps.seconds(1000) is None
    for i in range(30):
        tokens = rng.choice((1024, 2048, 6144, 16384))
        stall = 0.08 if i in (3, 17) else 0.0
        steps.add(tokens, 0.020 + 5e-6 * tokens + rng.uniform(-1e-3, 1e-3) + stall)
    for tokens in (1024, 3000, 16384):
        assert steps.seconds(tokens) == pytest.approx(0.020 + 5e-6 * tokens, abs=1.5e-3)
    # Steps all of one size give no slope: the line goes through the origin (per token), as seconds / tokens.
    same = DevicePrefillSteps()
    for seconds in (0.030, 0.034, 0.032):
        same.add(1024, seconds)
    assert same.seconds(2048) == pytest.approx(2 * 0.032)
    # A larger step that took less (a host step in flight slowed the smaller ones) gives no negative slope.
    flat = DevicePrefillSteps()
    for tokens, seconds in ((8192, 0.029), (1024, 0.032), (1024, 0.030), (1024, 0.035)):
        flat.add(tokens, seconds)
    assert flat.seconds(16384) == pytest.approx(flat.seconds(1024)) == pytest.approx(0.031)


def test_the_extra_is_measured_against_device_tier_steps_of_its_size_as_a_median():
    stats = LaneStats(KV_BYTES)
    stats.prefill_done(4000, 1000, 1.0)  # no device-tier step yet: nothing to compare with
    assert stats.host_prefill_seconds_per_token is None and not stats.device_prefill_measured
    for tokens in (2048, 8192, 2048, 8192):  # 20 ms + 2 us a token
        stats.prefill_done(tokens, 0, 0.020 + 2e-6 * tokens)
    assert stats.device_prefill_measured
    # A first host-tier prompt that stalled reads 100 us a token beyond a device-tier step of its size; the two
    # after it, 10 us a token beyond such steps, outvote it.
    stats.prefill_done(1024, 1024, 0.020 + 2e-6 * 1024 + 0.1024)
    assert stats.host_prefill_seconds_per_token == pytest.approx(100e-6)
    for _ in range(2):
        stats.prefill_done(3072, 1024, 0.020 + 2e-6 * 3072 + 0.01024)
    assert stats.host_prefill_seconds_per_token == pytest.approx(10e-6)
    assert stats.host_prefills_measured == stats.snapshot()["host_prefills_measured"] == 3
    stats.prefill_done(0, 0, 1.0)  # an empty step changes nothing
    assert stats.host_prefill_seconds_per_token == pytest.approx(10e-6)


def test_under_prefill_decode_separation_a_host_tier_prompt_costs_its_whole_prefill():
    """Device-tier prompts prefill on the prefill device and cost this one nothing, so a host-tier prompt's cost to
    this device is its whole prefill step, not what it adds to a device-tier one's (which read 0 and let 22 of 64
    requests onto the host tier under PD where one GPU admitted 1: nvidia-h200-x2/multi_gpu.json)."""
    elsewhere = LaneStats(KV_BYTES)
    elsewhere.device_prefill_elsewhere = True
    assert elsewhere.device_prefill_measured and elsewhere.host_prefill_seconds_per_token is None
    assert elsewhere.host_prefills_measured == 0  # one host-tier prompt at a time until measured
    for _ in range(MIN_PREFILL_SAMPLES):
        elsewhere.prefill_done(2048, 2048, 0.020 + 5e-6 * 2048)
    assert elsewhere.host_prefill_seconds_per_token == pytest.approx(0.020 / 2048 + 5e-6)
    assert elsewhere.host_prefills_measured == MIN_PREFILL_SAMPLES


def test_until_host_tier_prefills_are_measured_one_prompt_prefills_at_a_time_and_only_its_stay_is_checked():
    blocks = _pools(128)
    device = _device_rows(blocks, 4, 480, 1000)
    stats = _measured(fixed=0.02, per_byte=1e-8)
    for _ in range(40):
        stats.device_step_done(4, 0.010, host_busy=False)
    # No device-tier prefill measured yet: host-tier prompts wait for one.
    assert not host_lane_pays(_host_seq(480, 1000), device, blocks, stats)
    stats.prefill_done(1000, 0, 0.01)
    assert host_lane_pays(_host_seq(480, 1000), device, blocks, stats)
    in_prefill = _host_seq(480, 1000)
    assert not host_lane_pays(_host_seq(480, 1000), [*device, in_prefill], blocks, stats)
    in_prefill.num_computed_tokens = len(in_prefill)  # its prefill done, but not measured: still one at a time
    assert host_lane_pays(_host_seq(480, 1000), [*device, in_prefill], blocks, stats)
    # Measured fewer than MIN_PREFILL_SAMPLES times (dear samples, which would refuse it): the same.
    for _ in range(MIN_PREFILL_SAMPLES - 1):
        stats.prefill_done(1000, 1000, 0.01 + 1000 * 0.02)
    assert host_lane_pays(_host_seq(480, 1000), [*device, in_prefill], blocks, stats)
    stats.prefill_done(1000, 1000, 0.01 + 1000 * 0.02)
    assert not host_lane_pays(_host_seq(480, 1000), [*device, in_prefill], blocks, stats)
    # A stay too short to pay for its promotion is refused all the same (the device rows end in 32 steps).
    short_blocks = _pools(128)
    short = _device_rows(short_blocks, 4, 480, 32)
    stats.move_done(1000, 0.5)
    assert not host_lane_pays(_host_seq(480, 1000), short, short_blocks, stats)


def test_a_request_whose_prefill_costs_more_than_its_stay_saves_waits():
    """The request would decode ~1,000 tokens on the host (decode-heavy device rows). A cheap host-tier prefill
    leaves that paying; one that costs the device lane more than those tokens save does not."""
    blocks = _pools(128)
    device = _device_rows(blocks, 4, 480, 1000)
    cheap = _lanes(device_rows=4, device_step=0.010, fixed=0.02, per_byte=1e-8, prefill_per_token=1e-6)
    dear = _lanes(device_rows=4, device_step=0.010, fixed=0.02, per_byte=1e-8, prefill_per_token=0.02)
    assert host_lane_pays(_host_seq(480, 1000), device, blocks, cheap)
    assert not host_lane_pays(_host_seq(480, 1000), device, blocks, dear)
    # A busy lane takes a row only if it adds more than its own prefill costs.
    running = [*device, _host_seq(480, 1000)]
    running[-1].num_computed_tokens = 480
    assert host_lane_pays(_host_seq(480, 1000), running, blocks, cheap)
    assert not host_lane_pays(_host_seq(480, 1000), running, blocks, dear)
