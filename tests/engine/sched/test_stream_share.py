"""The streamed share (engine/sched/stream_share.py): both paths finish together at the measured rates; a row
streams a prefix of its full host blocks, never the block its new token goes to; a step streams at most what the
staging holds; with streaming off nothing streams."""
import pytest

from offload_engine.engine.sched.lane_stats import STREAM_SLOWDOWN_PRIOR, LaneStats
from offload_engine.engine.sched.stream_share import STREAM_PROBE_STEPS, StreamShare, balanced_share, full_host_blocks
from offload_engine.engine.sequence import Sequence
from offload_engine.sampling_params import SamplingParams


def _seq(num_tokens, device_tokens=0):
    seq = Sequence(list(range(num_tokens)), SamplingParams(), num_tokens + 4)
    seq.num_device_tokens = device_tokens
    return seq


def test_the_balanced_share_makes_both_paths_take_as_long():
    kernel, link = 1 / 60e9, 1 / 45e9  # seconds per byte
    share = balanced_share(kernel, link)
    assert share * link == pytest.approx((1 - share) * kernel)
    assert balanced_share(None, link) == balanced_share(kernel, None) == 0.0


@pytest.mark.parametrize("tokens,device_tokens,full", [(1, 0, 0), (16, 0, 0), (17, 0, 1), (33, 0, 2), (64, 32, 1),
                                                       (65, 32, 2)])
def test_full_blocks_stop_before_the_new_tokens_block(tokens, device_tokens, full):
    assert full_host_blocks(_seq(tokens, device_tokens), 16) == full


def test_blocks_take_the_share_of_each_row_within_the_capacity():
    share = StreamShare(capacity_blocks=100, block_size=16)
    rows = [_seq(16 * 10 + 1), _seq(16 * 4 + 1), _seq(5)]
    assert share.blocks(rows, 0.5) == [5, 2, 0]
    assert share.blocks(rows, 1.0) == [10, 4, 0]
    assert share.blocks(rows, 0.0) == [0, 0, 0]
    small = StreamShare(capacity_blocks=7, block_size=16)
    assert sum(small.blocks(rows, 1.0)) <= 7 and small.blocks(rows, 1.0)[0] > small.blocks(rows, 1.0)[1]


def test_the_share_comes_from_lane_stats_and_off_means_none():
    stats = LaneStats(kv_bytes_per_token=1000, link_seconds_per_byte=1 / 50e9)
    share = StreamShare(capacity_blocks=100, block_size=16)
    assert share.share(stats) == 0.0  # the kernel's rate is not measured yet
    stats.host_reads(kernel_bytes=10**9, kernel_seconds=1 / 50, stream_bytes=0, stream_seconds=None)
    assert share.share(stats) == pytest.approx(0.5)  # 50 GB/s each: half and half
    stats.host_reads(kernel_bytes=10**9, kernel_seconds=1 / 50, stream_bytes=10**9, stream_seconds=1 / 25)
    assert share.share(stats) == pytest.approx(1 / 3)  # the link measured at 25 GB/s, the kernel at 50
    assert stats.stream_bytes == 10**9 and stats.host_kernel_bytes == 2 * 10**9
    off = StreamShare(capacity_blocks=0, block_size=16)
    off.fixed = 1.0
    assert not off.enabled and off.share(stats) == 0.0


def _measured(device_tok_s, kernel_gbps=50.0):
    stats = LaneStats(kv_bytes_per_token=100_000, link_seconds_per_byte=1 / 50e9)
    stats.host_step(kv_bytes=10**9, seconds=1 / kernel_gbps + 0.01, kernel_seconds=1 / kernel_gbps)
    stats.host_reads(kernel_bytes=10**9, kernel_seconds=1 / kernel_gbps, stream_bytes=0, stream_seconds=None)
    for _ in range(4):
        stats.device_step_done(rows=1, seconds=1 / device_tok_s, host_busy=False)
    return stats


def test_streaming_pays_where_the_host_lanes_gain_beats_the_device_lanes_loss():
    """Four 32k-token host rows: streaming half their KV saves ~0.3 s a step, 5.6 tok/s; that beats a device lane of
    10 tok/s slowed 6% (0.6 tok/s lost), not one of 1,000 tok/s (57 tok/s lost). Without device rows it always pays."""
    rows = [_seq(32768) for _ in range(4)]
    share = StreamShare(capacity_blocks=10**6, block_size=16)
    assert share.share(_measured(device_tok_s=10), rows, device_rows=1) == pytest.approx(0.5)
    busy = _measured(device_tok_s=1000)
    assert share.share(busy, rows, device_rows=1) == 0.0
    assert share.share(busy, rows, device_rows=0) == pytest.approx(0.5)


def test_a_refused_share_is_probed_and_the_measured_cost_replaces_the_prior():
    rows = [_seq(32768) for _ in range(4)]
    share, busy = StreamShare(capacity_blocks=10**6, block_size=16), _measured(device_tok_s=1000)
    shares = [share.share(busy, rows, device_rows=1) for _ in range(STREAM_PROBE_STEPS + 1)]
    assert shares[:-1] == [0.0] * STREAM_PROBE_STEPS and shares[-1] > 0
    assert busy.stream_slowdown_ratio == STREAM_SLOWDOWN_PRIOR
    for _ in range(4):  # beside a plain host step 10% slower than idle, beside a streaming one 10% slower still
        busy.device_step_done(rows=1, seconds=1.1 / 1000, host_busy=True)
        busy.device_step_done(rows=1, seconds=1.21 / 1000, host_busy=True, host_streams=True)
    assert busy.stream_slowdown_ratio == pytest.approx(1.1) and busy.slowdown == pytest.approx(1.155)


def test_a_streamed_share_is_probed_plain_so_a_stale_sample_cannot_lock_streaming_in():
    """Where streaming pays, every STREAM_PROBE_STEPS + 1'th host step beside device rows runs plain, so the samples of
    device steps beside a plain host step stay fresh; each choice is counted in the checks."""
    rows = [_seq(32768) for _ in range(4)]
    share, stats = StreamShare(capacity_blocks=10**6, block_size=16), _measured(device_tok_s=10)
    shares = [share.share(stats, rows, device_rows=1) for _ in range(2 * STREAM_PROBE_STEPS + 2)]
    plain = [k for k, s in enumerate(shares) if s == 0.0]
    assert plain == [STREAM_PROBE_STEPS, 2 * STREAM_PROBE_STEPS + 1]
    assert stats.checks[("stream", True)] == len(shares) and stats.checks[("stream_probe", False)] == 2
    assert [share.share(stats, rows, device_rows=0) for _ in range(3 * STREAM_PROBE_STEPS)] == [shares[0]] * (
        3 * STREAM_PROBE_STEPS)  # without device rows there is no cost to measure, and no probe


def test_device_steps_faster_beside_streaming_read_as_no_slowdown():
    """A ratio below 1 (beside a plain host step measured slower than beside a streaming one) is noise: taken as it
    is, it would make streaming pay whatever the host lane gained."""
    stats = _measured(device_tok_s=1000)
    for _ in range(4):
        stats.device_step_done(rows=1, seconds=1.2 / 1000, host_busy=True)
        stats.device_step_done(rows=1, seconds=1.05 / 1000, host_busy=True, host_streams=True)
    assert stats.stream_slowdown_ratio == 1.0
    rows = [_seq(32768) for _ in range(4)]
    assert StreamShare(capacity_blocks=10**6, block_size=16).share(stats, rows, device_rows=1) > 0  # no cost: pays
