"""The streamed share of a host step: how many of each row's full host blocks cross PCIe, to be attended on the
device, while the CPU kernel attends the rest (docs/design.md, "Streaming host KV"). Both paths read host memory at
once, so the share is set for both to finish together, from each path's seconds per byte as measured (LaneStats). It
streams where that pays: the host lane's gain in tok/s beats what the copies cost the device lane's steps beside it.
Streamed blocks are a prefix of a row's host blocks, never the block its new token goes to; the staging buffer bounds
how many blocks a step streams.
"""
from offload_engine.engine.sequence import Sequence

# Beside device rows, after this many host steps of one choice the next takes the other: both sides of the device
# lane's cost (stream_slowdown_ratio) stay measured, so a stale sample cannot lock the choice in either way.
STREAM_PROBE_STEPS = 16


def full_host_blocks(seq: Sequence, block_size: int) -> int:
    """Host blocks of seq's that this decode step writes nothing into: those before its newest token's block."""
    return (seq.num_host_tokens - 1) // block_size


def balanced_share(kernel_seconds_per_byte: float | None, stream_seconds_per_byte: float | None) -> float:
    """The share s at which s bytes streamed take as long as (1 - s) bytes read by the kernel; 0 until both known."""
    if not kernel_seconds_per_byte or not stream_seconds_per_byte:
        return 0.0
    return kernel_seconds_per_byte / (kernel_seconds_per_byte + stream_seconds_per_byte)


class StreamShare:
    def __init__(self, capacity_blocks: int, block_size: int):
        """capacity_blocks: host blocks one step can stream per layer (the staging buffer's); 0: streaming is off."""
        self.capacity_blocks, self.block_size = capacity_blocks, block_size
        self.fixed: float | None = None  # pins the share (tests, A/B runs); None: balanced from the measured rates
        self.choice: bool | None = None  # whether the last host step beside device rows streamed...
        self.repeats = 0  # ...and how many before it in a row chose the same

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    def share(self, stats, host_rows: list[Sequence] = (), device_rows: int = 0) -> float:
        """The share of full host blocks to stream in a host step of host_rows beside device_rows device rows: the
        pinned one; else balanced from LaneStats' rates, always without device rows, and beside them where streaming
        pays, except that a host step after STREAM_PROBE_STEPS of one choice takes the other (a probe)."""
        if not self.enabled:
            return 0.0
        if self.fixed is not None:
            return self.fixed
        share = balanced_share(stats.host_read_seconds_per_byte, stats.stream_seconds_per_byte)
        if not share or not device_rows:
            return share
        streams = streaming_pays(host_rows, device_rows, share, stats)
        stats.record_check("stream", streams)
        if streams == self.choice:
            self.repeats += 1
        else:
            self.choice, self.repeats = streams, 0
        if self.repeats >= STREAM_PROBE_STEPS:
            streams, self.choice, self.repeats = not streams, not streams, 0
            stats.record_check("stream_probe", streams)
        return share if streams else 0.0

    def blocks(self, seqs: list[Sequence], share: float) -> list[int]:
        """Per row, how many leading host blocks to stream: `share` of its full ones, scaled down to the capacity."""
        if share <= 0:
            return [0] * len(seqs)
        full = [full_host_blocks(seq, self.block_size) for seq in seqs]
        wanted = [int(share * n) for n in full]
        total = sum(wanted)
        if total > self.capacity_blocks:
            wanted = [w * self.capacity_blocks // total for w in wanted]
        return wanted


def streaming_pays(host_rows: list[Sequence], device_rows: int, share: float, stats) -> bool:
    """Whether the host lane's gain in tok/s (its step shortened by the share the kernel no longer reads) beats the
    device lane's loss (its tok/s x (1 - 1/stream_slowdown_ratio)); True without device rows or measurements."""
    kernel, fixed, device = stats.host_read_seconds_per_byte, stats.host_fixed.value, stats.device_tok_s.value
    if not device_rows or not host_rows or kernel is None or fixed is None or not device or not stats.kv_bytes_per_token:
        return True
    host_bytes = sum(seq.num_host_tokens for seq in host_rows) * stats.kv_bytes_per_token
    plain, streamed = fixed + kernel * host_bytes, fixed + kernel * host_bytes * (1 - share)
    gain = len(host_rows) * (1 / streamed - 1 / plain)
    return gain > device * (1 - 1 / stats.stream_slowdown_ratio)
