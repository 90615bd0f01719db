"""Which KV tier a sequence lives on, and when it moves between them (docs/design.md, "Placement").

"gpu": device pool only; a sequence is admitted when its prompt fits what is free now, and a decode step with no block
for a row's next token preempts the newest device row for recompute. "cpu": host pool only.
"auto" is never slower than "gpu" at the same device budget. It packs the device tier by "gpu"'s rule and order (host
rows that will move up go first, as "gpu"'s preempted requests do, holding new ones at most PROMOTION_HOLD_STEPS).
Overflow is demoted to the host tier and decodes there; recompute only when the host pool is full too. A request
joins the host tier rather than wait, and the host lane steps, only where the cost checks predict a gain. Sequences
larger than the whole device pool are split across both tiers. Rules and measurements: docs/decisions/placement.md.
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
    """The tier to admit `seq` on now, or None if it has to wait for room. `waiting`: the requests queued
    behind it, which would join the host lane with it. With kv_promotion, host rows that will move up take
    device room first, for a while (_held_for_promotion; `step`: the engine's step count)."""
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


# The longest a request is held, in engine steps, so that host rows move up into device room before it.
# Why 16: docs/decisions/placement.md, "The hold behind promotions".
PROMOTION_HOLD_STEPS = 16


def _held_for_promotion(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, step: int) -> bool:
    """Whether `seq`, whose prompt fits the device now, waits so that host rows move up first (_awaiting_promotion).
    A hold that helps ends within a few dozen steps, when device rows end and a host row moves into their room; one
    that has not is held by host rows that do not move up (always in a host step, which promotions() passes over),
    and leaves device room idle while seq does not decode. So seq is held for at most PROMOTION_HOLD_STEPS steps
    from its first hold (`held_since`), then admitted."""
    if not _awaiting_promotion(running, blocks):
        return False
    if seq.held_since is None:
        seq.held_since = step
    return step - seq.held_since < PROMOTION_HOLD_STEPS


def _awaiting_promotion(running: Iterable[Sequence], blocks: BlockManager) -> bool:
    """Whether a host-tier row that could decode on the device waits for device room. Such rows go first, as "gpu"
    re-admits its preempted sequences before later requests: a new request given the room a demotion had just freed
    overflows the device again within a few steps, and the next row is demoted (a cascade of demotions)."""
    gpu = blocks.pool(GPU)
    return any(s.location == CPU and not s.is_split and gpu.blocks_for(s.budget) <= gpu.num_blocks for s in running)


def split_device_tokens(seq: Sequence, policy: str, blocks: BlockManager, running: Iterable[Sequence],
                        waiting: Iterable[Sequence] = ()) -> int:
    """How many of its first tokens a sequence admitted to the host tier keeps on the device (0: not split). Under
    "auto", only a sequence whose budget exceeds the whole device pool is split: device room is worth more to a whole
    row (device speed) than to a split one (bound by its host part). The device part takes only room whole rows will
    not need (_spare_device_blocks), so a split never causes a demotion nor keeps a waiting whole request off the
    device. It covers at most the prompt, in whole host blocks, so that host prefill can gather it into the
    host-block-sized staging cache (Attention._stage_prefix). It grows as room frees up (split_growth)."""
    gpu, cpu = blocks.pool(GPU), blocks.pool(CPU)
    if policy != "auto" or gpu.blocks_for(seq.budget) <= gpu.num_blocks or cpu.block_size % gpu.block_size:
        return 0
    tokens = min(_spare_device_blocks(seq, blocks, running, waiting) * gpu.block_size, len(seq))
    tokens = tokens // cpu.block_size * cpu.block_size
    return tokens if tokens > 0 and blocks.can_allocate(seq, CPU, tokens) else 0


def split_growth(seq: Sequence, blocks: BlockManager, running: Iterable[Sequence],
                 waiting: Iterable[Sequence] = ()) -> int:
    """How many leading blocks of a split sequence's host part move to the device now (0: none): as much as
    split_device_tokens' rule allows once room frees up. Each block moved is read at device speed from then on,
    shortening the row's host-bound steps. Only computed, full host blocks move, so the host part stays aligned at
    its first token; the copy is a promotion's (asked only with kv_promotion on, right after promotions). The device
    part never shrinks: device rows that need more room are demoted instead (demotion_order), as without splits."""
    gpu, cpu = blocks.pool(GPU), blocks.pool(CPU)
    if not seq.is_split or seq.in_flight or seq.in_prefill:
        return 0
    spare = _spare_device_blocks(seq, blocks, running, waiting) * gpu.block_size // cpu.block_size
    return max(0, min(spare, (seq.num_computed_tokens - seq.num_device_tokens) // cpu.block_size))


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
    "auto", whenever the host pool has room for it. No cost check: the alternative is recomputing its whole context,
    not waiting (docs/decisions/placement.md, "Demotion has no cost check")."""
    if policy != "auto":
        return False
    host = blocks.pool(CPU)
    return host.blocks_for(len(victim)) <= host.num_free


def demotion_order(rows: list[Sequence]) -> list[Sequence]:
    """Device rows by how soon they end: fewest tokens left first (the newest first among equals). A row near its
    end frees the most blocks, finishes in the host lane within a few steps and is not promoted back, so the device
    keeps the rows that would otherwise decode alone at the end of a batch (promotions() takes those first for the
    same reason). Why not "gpu"'s newest-first: docs/decisions/placement.md, "Demotion order"."""
    return sorted(reversed(rows), key=lambda seq: seq.tokens_left)  # stable: newest first among equals


def demotion_victims(device_rows: list[Sequence], host_rows: list[Sequence],
                     stats: LaneStats | None) -> Iterator[Sequence]:
    """Device rows (in admission order) in the order they are demoted, each picked once those before it have gone
    to the host lane. The row nearest its end (demotion_order) goes if the host lane would step with it
    (host_lane_keeps_up): it finishes there. If not, a demoted row sits parked until device room frees, so the
    newest goes, as "gpu" preempts: it comes back at the head of the queue with most of its tokens to go and starts
    the next wave with it (docs/decisions/placement.md, "Demotion victims")."""
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


# Host-tier prefills measured before the admission check trusts their median (LaneStats.prefill_done): one noisy
# sample turned the host tier off for whole runs. Why 3: docs/decisions/placement.md, "The admission cost check".
MIN_PREFILL_SAMPLES = 3


def host_lane_pays(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, stats: LaneStats | None,
                   joining: Iterable[Sequence] = ()) -> bool:
    """Whether seq as one more host-lane row saves the device lane more time than it costs, over its stay there
    (host_stay.host_gain_seconds: its tokens until device room frees, less its promotion and the device lane's
    slowdown). A busy lane takes seq if its gain with seq beats its gain without by more than seq's extra prefill
    cost (LaneStats.host_prefill_seconds_per_token); an idle one wakes only if the gain of every row that would start
    it together (seq and `joining`) beats their extra prefill cost. Before the lanes are measured, the first request
    tries the host lane alone and the rest wait for its measured step; while the device lane has rows but no
    measured step, requests wait for it (docs/decisions/placement.md, "The admission cost check")."""
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


# The most device steps the host lane waits, while it has rows, before it steps anyway to measure itself again.
# Why 64: docs/decisions/placement.md, "The host step's check and its probe".
HOST_PROBE_STEPS = 64


def host_step_pays(host_rows: list[Sequence], device_rows: int, stats: LaneStats | None) -> bool:
    """Whether the host lane should take a step now with these rows: its predicted tokens per second against what
    it costs the device lane at the measured slowdown (device tok/s x (1 - 1/slowdown)), admission's rule applied
    to the lane as it stands. A host step is a whole forward pass for its few rows: where the device lane is bound
    by the GPU it costs that lane about a step of its own. Steps when the device lane has no rows, and until both
    costs are measured. A refusal stops the measurements it was made from, so after HOST_PROBE_STEPS device steps
    without one the lane steps anyway (a "host_step_probe" check)."""
    if not host_rows:
        return False
    if not _both_lanes_measured(device_rows, stats):
        return True
    if stats.device_steps_since_host_step >= HOST_PROBE_STEPS:
        return _checked("host_step_probe", True, stats)
    keeps_up = _keeps_up(host_rows, stats)
    return True if keeps_up is None else _checked("host_step", keeps_up, stats)


def host_lane_keeps_up(host_rows: list[Sequence], device_rows: int, stats: LaneStats | None) -> bool:
    """host_step_pays's comparison, without its probe and its record: whether the host lane with these rows makes
    more tokens a second than it costs the device lane (True while that cannot be predicted yet)."""
    return not _both_lanes_measured(device_rows, stats) or _keeps_up(host_rows, stats) is not False


def _both_lanes_measured(device_rows: int, stats: LaneStats | None) -> bool:
    """False where there is no trade to make (no device rows) or nothing to predict it from yet."""
    return bool(device_rows and stats is not None and stats.kv_bytes_per_token is not None
                and stats.device_tok_s.value)


def _keeps_up(host_rows: list[Sequence], stats: LaneStats) -> bool | None:
    """The host lane's predicted tokens a second with these rows against what it costs the device lane at the
    measured slowdown (device tok/s x (1 - 1/slowdown)); None: not predictable yet."""
    rate = _host_rate([s.num_host_tokens for s in host_rows], stats)
    return None if rate is None else rate > stats.device_tok_s.value * (1 - 1 / stats.slowdown)


def _host_rate(row_tokens: list[int], stats: LaneStats) -> float | None:
    """Host-lane tokens per second with rows of these lengths (None: not predictable yet)."""
    seconds = stats.host_step_seconds(sum(row_tokens) * stats.kv_bytes_per_token)
    return None if seconds is None else len(row_tokens) / max(seconds, 1e-9)


# Device room a promotion leaves for the next tokens of the device rows and of the promoted row (promotions()).
# Why 64: docs/decisions/placement.md, "Promotion headroom".
PROMOTION_HEADROOM_TOKENS = 64
# How many more tokens a host row must have left than the device row it would displace, to move up past the
# headroom (promotions()); a gap longer than any request's output turns swaps off.
# Why 1: docs/decisions/placement.md, "Swaps".
SWAP_GAP_TOKENS = 1


def promotions(running: Iterable[Sequence], blocks: BlockManager, extra_room: int = 0,
               stats: LaneStats | None = None, rotate: bool = False) -> Iterator[Sequence]:
    """Host-tier sequences that the device pool can take now, most tokens left first (the oldest first among
    equals), skipping those in flight or still in prefill, and split ones (whose parts stay). extra_room: blocks
    about to free up, to ask which sequences will fit then. A row moves up only if the free room then still holds
    PROMOTION_HEADROOM_TOKENS more tokens of every device row and of itself (or what is left of their budgets):
    else it fills the room a demotion just freed and the device overflows again within a few steps.

    With `rotate` (no request waits), a row the headroom keeps out moves up anyway when its next token fits and it
    swaps in (_swaps_in): the device lane then keeps the rows furthest from their end, which hold the least KV, and
    runs more rows in the same blocks. While requests wait, device room is theirs first (choose_tier)."""
    gpu = blocks.pool(GPU)
    running = list(running)
    ahead = lambda seq, tokens: gpu.blocks_for(min(len(seq) + tokens, seq.budget))
    lacking = lambda tokens: sum(max(0, ahead(s, tokens) - len(s.block_table)) for s in running if s.location == GPU)
    room = gpu.num_free + extra_room - lacking(PROMOTION_HEADROOM_TOKENS)
    # Room for every device row's next token only: what a swap needs (a pass over the rows, so only if asked).
    tight_room = gpu.num_free + extra_room - lacking(1) if rotate else 0
    candidates = [seq for seq in running
                  if seq.location == CPU and not seq.is_split and not seq.in_flight and not seq.in_prefill]
    promoted: set[int] = set()
    swapping = rotate
    for seq in sorted(candidates, key=lambda s: -s.tokens_left):  # stable: admission order among equals
        if gpu.blocks_for(seq.budget) > gpu.num_blocks:
            continue
        next_token = gpu.blocks_for(len(seq) + 1)
        needed = max(ahead(seq, PROMOTION_HEADROOM_TOKENS), next_token)
        if needed > room:
            if not swapping or next_token > tight_room:
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
    """Whether, with seq and the rows promoted before it on the device, the row the next demotion would take
    (demotion_victims) is another row, with SWAP_GAP_TOKENS fewer tokens left than seq and no less KV: a swap that
    leaves the device lane no fewer rows."""
    on_device = lambda s: s.location == GPU or s.seq_id in promoted or s is seq
    device = [s for s in running if on_device(s) and not s.in_prefill]
    host = [s for s in running if not on_device(s) and s.location == CPU]
    victim = next(demotion_victims(device, host, stats))
    return victim is not seq and seq.tokens_left - victim.tokens_left >= SWAP_GAP_TOKENS and len(victim) >= len(seq)
