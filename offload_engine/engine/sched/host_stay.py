"""How long host-tier rows stay on the host tier, and what the host lane gains meanwhile: the horizon of
placement.host_lane_pays. The forecast replays the scheduler at the rates measured now, reserving every device row's
growth to its budget from the start, so room is never forecast early (docs/decisions/placement.md, "The admission
cost check").
"""
import heapq
import math
from collections.abc import Iterable

from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sequence import BlockLocation, Sequence


def promotion_delays(host_rows: list[Sequence], device_rows: list[Sequence], blocks: BlockManager,
                     device_step: float, host_row_tok_s: float) -> list[float]:
    """Seconds from now until each host row (in promotion order) moves to the device; math.inf where it ends on the
    host first. device_step: seconds a device step; host_row_tok_s: each host row's tokens a second."""
    gpu = blocks.pool(BlockLocation.GPU)
    ends = [(s.tokens_left * device_step, gpu.blocks_for(s.budget)) for s in device_rows]
    heapq.heapify(ends)
    # The device rows' growth to their budgets is reserved now: room comes no sooner than it would for them all.
    free = gpu.num_free - sum(max(0, gpu.blocks_for(s.budget) - len(s.block_table)) for s in device_rows)
    now, delays = 0.0, []
    for row in host_rows:
        if row.is_split or gpu.blocks_for(row.budget) > gpu.num_blocks:  # never promoted (placement.promotions)
            delays.append(math.inf)
            continue
        left, length = row.tokens_left, len(row) + 1  # (its KV and the next token, as promotions() asks)
        finishes_at = left / host_row_tok_s
        needed = gpu.blocks_for(length + int(now * host_row_tok_s))
        while ends and needed > free and ends[0][0] < finishes_at:
            at, freed = heapq.heappop(ends)
            now, free = max(now, at), free + freed
            needed = gpu.blocks_for(length + int(now * host_row_tok_s))
        if needed > free or now >= finishes_at:
            delays.append(math.inf)
            continue
        free -= gpu.blocks_for(row.budget)  # its KV now and what it grows to on the device
        delays.append(now)
        heapq.heappush(ends, (now + (left - now * host_row_tok_s) * device_step, gpu.blocks_for(row.budget)))
    return delays


def promotion_order(rows: Iterable[Sequence]) -> list[Sequence]:
    """As placement.promotions() takes them: most tokens left first, in admission order among equals."""
    return sorted(rows, key=lambda s: -s.tokens_left)


def host_gain_seconds(host_rows: list[Sequence], device_rows: list[Sequence], blocks: BlockManager,
                      stats: LaneStats) -> float | None:
    """Device-lane seconds saved by the host lane running these rows until each moves up or ends, less what their
    promotions cost and what the busy lane slows the device lane by (None: the lanes are not measured yet). Each
    host token saves 1 / device tok/s; while the host lane runs, the device lane loses 1 - 1/slowdown of its time."""
    device_tok_s = stats.device_tok_s.value
    step = (stats.host_step_seconds(sum(s.num_host_tokens for s in host_rows) * stats.kv_bytes_per_token)
            if host_rows else None)
    if not device_tok_s or step is None:
        return None
    row_tok_s = 1 / max(step, 1e-9)
    device_step = len(device_rows) / device_tok_s
    rows = promotion_order(host_rows)
    tokens = moved = busy = 0.0
    for row, delay in zip(rows, promotion_delays(rows, device_rows, blocks, device_step, row_tok_s)):
        stay = min(delay, row.tokens_left / row_tok_s)
        tokens += stay * row_tok_s
        busy = max(busy, stay)
        if delay < math.inf:
            moved += len(row) + stay * row_tok_s
    slowed = (1 - 1 / stats.slowdown) * busy if device_rows else 0.0
    return tokens / device_tok_s - moved * stats.move_seconds_per_token - slowed
