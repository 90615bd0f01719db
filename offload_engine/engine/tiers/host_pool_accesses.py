"""The device's direct accesses to the pinned host pool, and what waits for them.

Where the device addresses the pinned pool (HostKVPool.device_stacked), three kinds of device work touch host
blocks, each on its own stream, each marked by a CUDA event once queued:
- promotions read host blocks, on the moves stream (ModelRunner.promote): whatever writes host blocks next waits;
- demotions write host blocks, on the moves stream beside the device lane (or on its own stream: ModelRunner.demote);
- host-tier prefill writes host blocks, on the prefill-writes stream (layers/host_block_writes.py).
Work on the host (host kernels, prefix staging, unpinning) blocks on the events (`wait_*`); work on another stream
waits for them on the device (`after_*`), without holding up the engine's thread. The events are read from both
lanes' threads and replaced only by the engine's: a read never clears one, which could drop one the other thread
just recorded.
"""
import torch


class HostPoolAccesses:
    def __init__(self):
        self.promotion_reads = self.demotion_writes = self.prefill_writes = None  # the latest of each, or None

    def record(self, kind: str, stream=None):
        """Marks the end of the `kind` work queued so far on `stream` (the current one by default)."""
        event = torch.cuda.Event()
        event.record(stream)
        setattr(self, kind, event)
        return event

    def wait_writes(self) -> None:
        """Blocks until the device's writes into host blocks (demoted KV, host-tier prefill) have landed."""
        for event in (self.demotion_writes, self.prefill_writes):
            if event is not None:
                event.synchronize()

    def wait_promotion_reads(self) -> None:
        if self.promotion_reads is not None:
            self.promotion_reads.synchronize()

    def after_promotion_reads(self) -> None:
        """The current stream waits for the promotions' reads queued so far."""
        if self.promotion_reads is not None:
            torch.cuda.current_stream().wait_event(self.promotion_reads)

    def after_prefill_writes(self) -> None:
        """The current stream waits for the prefills' writes queued so far."""
        if self.prefill_writes is not None:
            torch.cuda.current_stream().wait_event(self.prefill_writes)
