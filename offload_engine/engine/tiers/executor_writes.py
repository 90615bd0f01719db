"""Host-pool writes queued on the host executor (host-tier prefill, staged demotions). Every later reader of those
blocks runs on the executor after them, so no step waits; a failed write is raised by the next check, and the writes
are settled before a promotion reads host blocks.
"""
from concurrent.futures import Future


class ExecutorWrites:
    def __init__(self):
        self._writes: list[Future] = []

    def add(self, writes: list[Future]) -> None:
        self._writes += writes

    def pending(self) -> bool:
        return not all(write.done() for write in self._writes)

    def take(self) -> list[Future]:
        """Hands the writes queued so far to the caller, who then answers for their outcome (the prefill lane)."""
        writes, self._writes = self._writes, []
        return writes

    def settle(self) -> None:
        """Waits for every write queued so far, raising the first that failed."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def check(self, wait: bool = False) -> None:
        """Raises the error of a write that has failed (with wait: settle); the writes still running stay. After an
        error the writes behind it are dropped: the call they belong to failed."""
        if wait:
            return self.settle()
        writes, self._writes = self._writes, []
        for write in writes:
            if write.done():
                write.result()
            else:
                self._writes.append(write)

    def forget(self) -> None:
        """Drops every write's outcome (LLMEngine.abort: a failed write belongs to the aborted call)."""
        self._writes = []
