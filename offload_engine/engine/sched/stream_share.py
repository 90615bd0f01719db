"""The streamed share of a host step: how many of each row's full host blocks cross PCIe, to be attended on the
device, while the CPU kernel attends the rest (docs/design.md, "Streaming host KV"). Both paths read host memory at
once, so a step ends when the slower ends: the share is set so that both finish together, from each path's seconds
per byte as measured beside the other (LaneStats). Streamed blocks are a prefix of the row's host blocks, never the
block its new token goes to; the staging buffer bounds how many blocks a step streams.
"""
from offload_engine.engine.sequence import Sequence


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

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    def share(self, stats) -> float:
        """The share of full host blocks to stream this step, from LaneStats' rates (or the pinned one)."""
        if not self.enabled:
            return 0.0
        if self.fixed is not None:
            return self.fixed
        return balanced_share(stats.host_read_seconds_per_byte, stats.stream_seconds_per_byte)

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
