"""The device's direct accesses to the pinned host pool (HostKVPool.device_stacked), and what waits for them.

Three kinds of device work touch host blocks, each marked by a CUDA event once queued: promotion reads and demotion
writes (the moves stream, or the device lane's: tier_moves.py) and host-tier prefill writes (the prefill-writes
stream: layers/host_block_writes.py). Host work (host kernels, prefix staging, unpinning) blocks on the events
(`wait_*`); work on another stream waits for them on the device (`after_*`). Both lanes' threads read the events and
only the engine's replaces them: a read never clears one, which could drop one the other thread just recorded.
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
