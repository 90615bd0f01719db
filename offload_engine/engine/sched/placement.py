"""Which KV tier a sequence lives on, and when it moves between them (docs/design.md, "Placement").

The one place that decides tiers and moves. "auto" is never slower than "gpu" at the same device budget: it packs the
device pool by "gpu"'s rule and order, demotes overflow to the host tier (recompute only when that is full too), and
sends a request to the host lane, or steps it, only where the cost checks predict a gain. Why each rule and constant
is as it is: docs/decisions/placement.md, one section per function or constant named here.
"""
from collections.abc import Iterable, Iterator

from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.host_stay import host_gain_seconds
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sequence import BlockLocation, Sequence

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU


def tiers_allowed(policy: str) -> tuple[BlockLocation, ...]:
    return {"gpu": (GPU,), "cpu": (CPU,)}.get(policy, (GPU, CPU))


def can_ever_fit(seq: Sequence, policy: str, blocks: BlockManager) -> bool:
    """Whether some allowed tier could hold the sequence's whole budget when it had the pool to itself."""
    return any(blocks.pool(t).blocks_for(seq.budget) <= blocks.pool(t).num_blocks for t in tiers_allowed(policy))


def choose_tier(seq: Sequence, policy: str, blocks: BlockManager, running: list[Sequence],
                stats: LaneStats | None = None, waiting: Iterable[Sequence] = (),
                kv_promotion: bool = True, step: int = 0) -> BlockLocation | None:
    """The tier to admit `seq` on now, or None if it waits. `waiting`: requests queued behind it, which would join
    the host lane with it; `step`: the engine's step count, for the hold behind promotions (_held_for_promotion)."""
    if policy in ("gpu", "cpu"):
        tier = tiers_allowed(policy)[0]
        return tier if blocks.can_allocate(seq, tier) else None
    device_ever = blocks.pool(GPU).blocks_for(seq.budget) <= blocks.pool(GPU).num_blocks
    # The hold's clock starts only once seq's prompt fits: waiting for room is not a hold.
    if device_ever and blocks.can_allocate(seq, GPU) and not (kv_promotion and _held_for_promotion(seq, running,
                                                                                                    blocks, step)):
        return GPU
    if not blocks.can_allocate(seq, CPU):
        return None
    if not device_ever or _checked("admit", host_lane_pays(seq, running, blocks, stats, joining=waiting), stats):
        return CPU
    return None


# The most engine steps a request is held so that host rows move up first ("The hold behind promotions").
PROMOTION_HOLD_STEPS = 16


def _held_for_promotion(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, step: int) -> bool:
    """Whether `seq`, whose prompt fits the device now, waits so that host rows move up first: for at most
    PROMOTION_HOLD_STEPS steps from its first hold (`held_since`); a longer hold only leaves device room idle."""
    if not _awaiting_promotion(running, blocks):
        return False
    if seq.held_since is None:
        seq.held_since = step
    return step - seq.held_since < PROMOTION_HOLD_STEPS


def _awaiting_promotion(running: Iterable[Sequence], blocks: BlockManager) -> bool:
    """Whether a host-tier row that could decode on the device waits for device room."""
    gpu = blocks.pool(GPU)
    return any(s.location == CPU and not s.is_split and gpu.blocks_for(s.budget) <= gpu.num_blocks for s in running)


def split_device_tokens(seq: Sequence, policy: str, blocks: BlockManager, running: Iterable[Sequence],
                        waiting: Iterable[Sequence] = ()) -> int:
    """How many of its first tokens a sequence admitted to the host tier keeps on the device (0: not split)."""
    gpu, cpu = blocks.pool(GPU), blocks.pool(CPU)
    if policy != "auto" or gpu.blocks_for(seq.budget) <= gpu.num_blocks or cpu.block_size % gpu.block_size:
        return 0
    tokens = min(_spare_device_blocks(seq, blocks, running, waiting) * gpu.block_size, len(seq))
    tokens = tokens // cpu.block_size * cpu.block_size
    return tokens if tokens > 0 and blocks.can_allocate(seq, CPU, tokens) else 0


def split_growth(seq: Sequence, blocks: BlockManager, running: Iterable[Sequence],
                 waiting: Iterable[Sequence] = (), in_parts: bool = False) -> int:
    """How many leading host blocks of a split sequence move to the device now (0: none), by split_device_tokens'
    rule. Only computed, full host blocks move, so the host part stays aligned at its first token. With `in_parts`
    a whole host row that the device pool could hold takes spare room the same way, once, as a split row: promoting
    it later then moves only the rest (promotions)."""
    gpu, cpu = blocks.pool(GPU), blocks.pool(CPU)
    if seq.in_flight or seq.in_prefill or seq.location != CPU:
        return 0
    in_parts = in_parts and gpu.blocks_for(seq.budget) <= gpu.num_blocks  # a row the device pool could hold
    if seq.is_split == in_parts:
        return 0  # a whole row without parts, or one whose part was taken: it is promoted once the rest fits
    spare = _spare_device_blocks(seq, blocks, running, waiting) * gpu.block_size // cpu.block_size
    count = max(0, min(spare, (seq.num_computed_tokens - seq.num_device_tokens) // cpu.block_size))
    if seq.is_split:
        return count
    # A whole row takes one part, at least half of its KV, and is promoted whole after: each growth copy takes the
    # row out of the host lane until it lands, so parts in trickles would cost more host steps than they save.
    return count if count * cpu.block_size * 2 >= seq.num_computed_tokens else 0


def _spare_device_blocks(seq: Sequence, blocks: BlockManager, running: Iterable[Sequence],
                         waiting: Iterable[Sequence]) -> int:
    """Free device blocks less what the device rows still lack to reach their budgets and what the waiting
    requests that could live on the device whole would take."""
    gpu = blocks.pool(GPU)
    needed = sum(max(0, gpu.blocks_for(s.budget) - len(s.block_table)) for s in running if s.location == GPU)
    needed += sum(gpu.blocks_for(s.budget) for s in waiting
                  if s is not seq and gpu.blocks_for(s.budget) <= gpu.num_blocks)
    return gpu.num_free - needed


def demotes(victim: Sequence, policy: str, blocks: BlockManager) -> bool:
    """Whether a device sequence that must give up its blocks moves to the host tier (else: recomputed): under
    "auto", whenever the host pool has room. No cost check: the alternative is a recompute, not a wait."""
    if policy != "auto":
        return False
    host = blocks.pool(CPU)
    return host.blocks_for(len(victim)) <= host.num_free


def demotion_order(rows: list[Sequence]) -> list[Sequence]:
    """Device rows by how soon they end, fewest tokens left first (newest first among equals)."""
    return sorted(reversed(rows), key=lambda seq: seq.tokens_left)


def demotion_victims(device_rows: list[Sequence], host_rows: list[Sequence],
                     stats: LaneStats | None) -> Iterator[Sequence]:
    """Device rows (in admission order) in the order they are demoted, each picked as if those before had gone to
    the host lane."""
    rows, host = list(device_rows), list(host_rows)
    while rows:
        victim = demotion_order(rows)[0]
        if not host_lane_keeps_up([*host, victim], len(rows) - 1, stats):
            victim = rows[-1]
        yield victim
        rows.remove(victim)
        host.append(victim)


def _checked(kind: str, pays: bool, stats: LaneStats | None) -> bool:
    if stats is not None:
        stats.record_check(kind, pays)
    return pays


# Host-tier prefills measured before the admission check trusts their median ("The admission cost check").
MIN_PREFILL_SAMPLES = 3


def host_lane_pays(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, stats: LaneStats | None,
                   joining: Iterable[Sequence] = ()) -> bool:
    """Whether seq as one more host-lane row saves the device lane more time over its stay (host_gain_seconds) than
    its host-tier prefill adds. `joining`: the rows that would start an idle lane with it."""
    if stats is None or stats.kv_bytes_per_token is None:
        return True
    running = list(running)
    host = [s for s in running if s.location == CPU and s is not seq]
    device = [s for s in running if s.location == GPU]
    if stats.host_step_seconds(0) is None:
        return not host
    if not stats.device_tok_s.value:
        return not device
    # Until the host-tier prefill's extra cost is measured (against device-tier prefills measured first), one
    # host-tier prompt prefills at a time and only its stay is checked.
    per_token = stats.host_prefill_seconds_per_token
    if stats.host_prefills_measured < MIN_PREFILL_SAMPLES:
        if not stats.device_prefill_measured or any(s.in_prefill for s in host):
            return False
        per_token = 0.0
    prefill = lambda rows: per_token * sum(s.num_uncomputed_tokens for s in rows)
    if not host:
        rows = [seq, *(s for s in joining if s is not seq)]
        with_seq = host_gain_seconds(rows, device, blocks, stats)
        return with_seq is None or with_seq > prefill(rows)
    without, with_seq = (host_gain_seconds(rows, device, blocks, stats) for rows in (host, [*host, seq]))
    return without is None or with_seq is None or with_seq - without > prefill([seq])


# Device steps the host lane, having rows, waits at most before it steps anyway ("The host step's check and its probe").
HOST_PROBE_STEPS = 64


def host_step_pays(host_rows: list[Sequence], device_rows: int, stats: LaneStats | None) -> bool:
    """Whether the host lane steps now with these rows: while it pays (_keeps_up), always without device rows or
    measurements, and after HOST_PROBE_STEPS device steps without a host step."""
    if not host_rows:
        return False
    if not _both_lanes_measured(device_rows, stats):
        return True
    if stats.device_steps_since_host_step >= HOST_PROBE_STEPS:
        return _checked("host_step_probe", True, stats)
    keeps_up = _keeps_up(host_rows, stats)
    return True if keeps_up is None else _checked("host_step", keeps_up, stats)


def host_lane_keeps_up(host_rows: list[Sequence], device_rows: int, stats: LaneStats | None) -> bool:
    """host_step_pays's comparison without its probe and record (True while not predictable yet)."""
    return not _both_lanes_measured(device_rows, stats) or _keeps_up(host_rows, stats) is not False


def _both_lanes_measured(device_rows: int, stats: LaneStats | None) -> bool:
    """False where there is no trade to make (no device rows) or nothing to predict it from yet."""
    return bool(device_rows and stats is not None and stats.kv_bytes_per_token is not None
                and stats.device_tok_s.value)


def _keeps_up(host_rows: list[Sequence], stats: LaneStats) -> bool | None:
    """Host-lane tok/s with these rows > device tok/s x (1 - 1/slowdown); None: not predictable yet."""
    rate = _host_rate([s.num_host_tokens for s in host_rows], stats)
    return None if rate is None else rate > stats.device_tok_s.value * (1 - 1 / stats.slowdown)


def _host_rate(row_tokens: list[int], stats: LaneStats) -> float | None:
    seconds = stats.host_step_seconds(sum(row_tokens) * stats.kv_bytes_per_token)
    return None if seconds is None else len(row_tokens) / max(seconds, 1e-9)


# Tokens of every device row (and the promoted one) the room left by a promotion must hold ("Promotion headroom").
PROMOTION_HEADROOM_TOKENS = 64
# Tokens more a host row must have left than the device row it displaces, to swap in; a gap longer than any output
# turns swaps off ("Swaps").
SWAP_GAP_TOKENS = 1


def promotions(running: Iterable[Sequence], blocks: BlockManager, extra_room: int = 0,
               stats: LaneStats | None = None, rotate: bool = False, in_parts: bool = False) -> Iterator[Sequence]:
    """Host-tier sequences the device pool can take now (extra_room: blocks about to free up), most tokens left first,
    leaving PROMOTION_HEADROOM_TOKENS of room; with `rotate`, also rows that swap in (_swaps_in). With `in_parts`,
    split rows too, which need room for their host part only."""
    gpu = blocks.pool(GPU)
    running = list(running)
    ahead = lambda seq, tokens: gpu.blocks_for(min(len(seq) + tokens, seq.budget))
    lacking = lambda tokens: sum(max(0, ahead(s, tokens) - len(s.block_table)) for s in running if s.location == GPU)
    room = gpu.num_free + extra_room - lacking(PROMOTION_HEADROOM_TOKENS)
    # Room for every device row's next token only: what a swap needs (a pass over the rows, so only if asked).
    tight_room = gpu.num_free + extra_room - lacking(1) if rotate else 0
    candidates = [seq for seq in running
                  if seq.location == CPU and (in_parts or not seq.is_split) and not seq.in_flight and not seq.in_prefill]
    promoted: set[int] = set()
    swapping = rotate
    for seq in sorted(candidates, key=lambda s: -s.tokens_left):  # stable: admission order among equals
        if gpu.blocks_for(seq.budget) > gpu.num_blocks:
            continue
        held = len(seq.device_prefix)  # a split row's device part is on the device already
        next_token = gpu.blocks_for(len(seq) + 1) - held
        needed = max(ahead(seq, PROMOTION_HEADROOM_TOKENS), next_token + held) - held
        if needed > room:
            if not swapping or next_token > tight_room or held:
                continue
            # One try a call: the candidates after one that would not swap have fewer tokens left still.
            swapping = _swaps_in(seq, running, promoted, stats)
            if not swapping:
                continue
        room -= needed
        tight_room -= next_token
        promoted.add(seq.seq_id)
        yield seq


def _swaps_in(seq: Sequence, running: list[Sequence], promoted: set[int], stats: LaneStats | None) -> bool:
    """Whether, with seq and the rows promoted before it on the device, the next demotion would take another row,
    with SWAP_GAP_TOKENS fewer tokens left than seq and no less KV."""
    on_device = lambda s: s.location == GPU or s.seq_id in promoted or s is seq
    device = [s for s in running if on_device(s) and not s.in_prefill]
    host = [s for s in running if not on_device(s) and s.location == CPU]
    victim = next(demotion_victims(device, host, stats))
    return victim is not seq and seq.tokens_left - victim.tokens_left >= SWAP_GAP_TOKENS and len(victim) >= len(seq)
