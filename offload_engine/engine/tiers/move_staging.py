"""Pinned staging for the staged moves between the tiers: NUM_SLOTS slots of GROUP_BYTES, allocated once and reused
round-robin, each handed out again only once whatever reads it is done.
Why: docs/decisions/tier-moves.md, "Move staging: four reusable 64 MiB slots".
"""
import torch

GROUP_BYTES = 64 << 20  # per slot and copy: ~1.3 ms at 50 GB/s
NUM_SLOTS = 4


class MoveStaging:
    def __init__(self, device: torch.device, num_slots: int = NUM_SLOTS):
        self.device = device
        self._host: list[torch.Tensor | None] = [None] * num_slots
        self._device: list[torch.Tensor | None] = [None] * num_slots
        self._busy_until: list = [None] * num_slots
        self._next = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(slot, host view, device view) of `shape`, once the slot's last user is done with it."""
        slot, self._next = self._next, (self._next + 1) % len(self._host)
        self._wait(slot)
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        if self._host[slot] is None or self._host[slot].numel() < nbytes:
            size, pin = max(nbytes, GROUP_BYTES), self.device.type == "cuda"
            self._host[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self._device[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        views = (buffer[:nbytes].view(dtype).view(shape) for buffer in (self._host[slot], self._device[slot]))
        return (slot, *views)

    def link_seconds_per_byte(self) -> float | None:
        """Seconds per byte of a pinned host-to-device copy of one slot, timed once (after one untimed copy): the
        seed of LaneStats' move cost before a move was measured. None off CUDA, where nothing crosses a link."""
        if self.device.type != "cuda":
            return None
        slot, host, device = self.take((GROUP_BYTES,), torch.uint8)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        device.copy_(host, non_blocking=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / GROUP_BYTES

    def busy_until(self, slot: int, done) -> None:
        """The slot is in use until `done` (a torch.cuda.Event or a concurrent.futures.Future) completes."""
        self._busy_until[slot] = done

    def _wait(self, slot: int) -> None:
        done, self._busy_until[slot] = self._busy_until[slot], None
        if isinstance(done, torch.cuda.Event):
            done.synchronize()
        elif done is not None:
            done.exception()  # waits; a failed host write reports itself (ModelRunner.check_host_writes)

    def release(self) -> None:
        for slot in range(len(self._host)):
            self._wait(slot)
        self._host = [None] * len(self._host)
        self._device = [None] * len(self._device)


def split_moves(moves: list, host_block_size: int, bytes_per_block: int, limit: int | None = None) -> list[list]:
    """Consecutive batches of (sequence, blocks) moves whose KV, at bytes_per_block per host block, fits `limit`
    (GROUP_BYTES by default); a sequence larger than that makes a batch of its own."""
    limit = GROUP_BYTES if limit is None else limit
    batches, batch, batch_bytes = [], [], 0
    for move in moves:
        nbytes = bytes_per_block * -(-move[0].num_computed_tokens // host_block_size)
        if batch and batch_bytes + nbytes > limit:
            batches.append(batch)
            batch, batch_bytes = [], 0
        batch.append(move)
        batch_bytes += nbytes
    return batches + [batch] if batch else batches
