"""The one place that decides which KV tier a new sequence lives on.

- "gpu": the device pool only (sequences wait, or the newest are preempted, when it is full).
- "cpu": the host pool only.
- "auto": the device pool while it has room for the sequence's whole budget (prompt + max_tokens, capped at
  max_model_len) on top of what the sequences already there will still grow into; otherwise the host pool.
  A sequence larger than the whole device pool always goes to the host.
"""
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
    gpu = blocks.pool(BlockLocation.GPU)
    needed = gpu.blocks_for(seq.budget)
    if needed <= gpu.num_blocks and needed <= gpu.num_free - _growth_still_owed(running, blocks):
        return BlockLocation.GPU
    if blocks.pool(BlockLocation.CPU).blocks_for(seq.budget) <= blocks.pool(BlockLocation.CPU).num_blocks:
        return BlockLocation.CPU if blocks.can_allocate(seq, BlockLocation.CPU) else None
    return None


def _growth_still_owed(running: list[Sequence], blocks: BlockManager) -> int:
    """Device blocks the running device-tier sequences will still take before they reach their budgets."""
    gpu = blocks.pool(BlockLocation.GPU)
    return sum(max(0, gpu.blocks_for(s.budget) - len(s.block_table)) for s in running if s.location == BlockLocation.GPU)
