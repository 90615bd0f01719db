"""The admission check counts what a host-tier prompt's prefill costs beyond a device-tier one's
(LaneStats.prefill_done, placement.host_lane_pays)."""
from offload_engine.engine.lane_stats import LaneStats
from offload_engine.engine.placement import host_lane_pays
from tests.engine.test_lane_costs import KV_BYTES, _device_rows, _host_seq, _lanes, _measured, _pools


def test_the_extra_is_measured_against_device_tier_prefill_steps():
    stats = LaneStats(KV_BYTES)
    stats.prefill_done(4000, 1000, 1.0)  # no device-tier step yet: nothing to compare with
    assert stats.host_prefill_seconds_per_token is None and not stats.device_prefill_measured
    stats.prefill_done(2000, 0, 0.02)  # 10 us a token
    stats.prefill_done(3000, 1000, 0.03 + 0.05)  # its host-tier thousand took 50 us a token more
    assert abs(stats.host_prefill_seconds_per_token - 50e-6) < 1e-12
    stats.prefill_done(0, 0, 1.0)  # an empty step changes nothing
    assert abs(stats.host_prefill_seconds_per_token - 50e-6) < 1e-12
    # Under prefill/decode separation device-tier prompts prefill elsewhere: nothing to compare with here.
    elsewhere = LaneStats(KV_BYTES)
    elsewhere.device_prefill_elsewhere = True
    assert elsewhere.host_prefill_seconds_per_token == 0.0 and elsewhere.device_prefill_measured


def test_until_a_host_tier_prefill_is_measured_one_prompt_prefills_at_a_time():
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
