"""The device's direct accesses to the pinned host pool, each kind marked by its latest CUDA event (docs/design.md,
"Moves between the tiers": what waits for what). Both lanes' threads read the events and only the engine's replaces
them: a read never clears one, which could drop one the other thread just recorded.
"""
import torch


class HostPoolAccesses:
    def __init__(self):
        self.promotion_reads = self.demotion_writes = self.prefill_writes = None

    def record(self, kind: str, stream=None):
        """Marks the end of the `kind` work queued so far on `stream` (the current one by default)."""
        event = torch.cuda.Event()
        event.record(stream)
        setattr(self, kind, event)
        return event

    def marks(self) -> list:
        """The events of every access to host blocks queued so far (reads and writes), for another device's runner
        to wait on before it touches host blocks (the prefill lane)."""
        return [e for e in (self.promotion_reads, self.demotion_writes, self.prefill_writes) if e is not None]

    def wait_writes(self) -> None:
        """Blocks until the device's writes into host blocks (demoted KV, host-tier prefill) have landed."""
        for event in (self.demotion_writes, self.prefill_writes):
            if event is not None:
                event.synchronize()

    def wait_promotion_reads(self) -> None:
        if self.promotion_reads is not None:
            self.promotion_reads.synchronize()

    def after_promotion_reads(self) -> None:
        if self.promotion_reads is not None:
            torch.cuda.current_stream().wait_event(self.promotion_reads)

    def after_prefill_writes(self) -> None:
        if self.prefill_writes is not None:
            torch.cuda.current_stream().wait_event(self.prefill_writes)
