"""The one place that decides which KV tier a sequence lives on.

- "gpu": the device pool only (sequences wait, or the newest are preempted, when it is full).
- "cpu": the host pool only.
- "auto": the device pool while it has room for the sequence's whole budget (prompt + max_tokens, capped at
  max_model_len) on top of what the sequences already there will still grow into; otherwise the host pool.
  A sequence larger than the whole device pool always goes to the host.

Promotion ("auto" with kv_promotion): when the device pool has room that no waiting request took, host-tier
sequences that fit it by the same rule move up, oldest first. Without it, a batch whose device-tier share
finishes first would leave the GPU idle while the host tier decodes the rest at host speed.
"""
from collections.abc import Iterable, Iterator

from offload_engine.engine.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence


def tiers_allowed(policy: str) -> tuple[BlockLocation, ...]:
    return {"gpu": (BlockLocation.GPU,), "cpu": (BlockLocation.CPU,)}.get(policy, (BlockLocation.GPU, BlockLocation.CPU))


def can_ever_fit(seq: Sequence, policy: str, blocks: BlockManager) -> bool:
    """Whether some allowed tier could hold the sequence's whole budget when it had the pool to itself."""
    return any(blocks.pool(t).blocks_for(seq.budget) <= blocks.pool(t).num_blocks for t in tiers_allowed(policy))


def choose_tier(seq: Sequence, policy: str, blocks: BlockManager, running: list[Sequence]) -> BlockLocation | None:
    """The tier to admit `seq` on now, or None if it has to wait for room."""
    if policy in ("gpu", "cpu"):
        tier = tiers_allowed(policy)[0]
        return tier if blocks.can_allocate(seq, tier) else None
    if blocks.pool(BlockLocation.GPU).blocks_for(seq.budget) <= _device_room(running, blocks):
        return BlockLocation.GPU
    if blocks.pool(BlockLocation.CPU).blocks_for(seq.budget) <= blocks.pool(BlockLocation.CPU).num_blocks:
        return BlockLocation.CPU if blocks.can_allocate(seq, BlockLocation.CPU) else None
    return None


def promotions(running: Iterable[Sequence], blocks: BlockManager, extra_room: int = 0) -> Iterator[Sequence]:
    """Host-tier sequences, oldest first, whose whole budget the device pool has room for (each one taken
    reserves its budget for the next), skipping those in flight or still in prefill. extra_room: blocks
    that are about to free up, to ask which sequences will fit then."""
    gpu = blocks.pool(BlockLocation.GPU)
    room = _device_room(running, blocks) + extra_room
    for seq in running:
        if seq.location != BlockLocation.CPU or seq.in_flight or seq.in_prefill:
            continue
        needed = gpu.blocks_for(seq.budget)
        if needed <= room:
            room -= needed
            yield seq


def _device_room(running: Iterable[Sequence], blocks: BlockManager) -> int:
    """Free device blocks that the running device-tier sequences will not still take to reach their budgets."""
    gpu = blocks.pool(BlockLocation.GPU)
    owed = sum(max(0, gpu.blocks_for(s.budget) - len(s.block_table)) for s in running if s.location == BlockLocation.GPU)
    return gpu.num_free - owed
