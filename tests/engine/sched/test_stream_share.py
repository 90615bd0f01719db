"""The streamed share (engine/sched/stream_share.py): both paths finish together at the measured rates; a row
streams a prefix of its full host blocks, never the block its new token goes to; a step streams at most what the
staging holds; with streaming off nothing streams."""
import pytest

from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sched.stream_share import StreamShare, balanced_share, full_host_blocks
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
