"""The one place that decides which KV tier a sequence lives on, and when it moves between them.

- "gpu": the device pool only. A sequence is admitted when its prompt fits what is free now; when a decode
  step finds no block for a sequence's next token, the newest device sequence is preempted and recomputed.
- "cpu": the host pool only.
- "auto": never slower than "gpu" at the same device budget (DESIGN.md, "Placement"):
  - The device tier is packed exactly as "gpu" packs it: admitted when the prompt fits what is free now, in
    the order "gpu" would admit: host rows that will move up (its preempted and still waiting requests) first.
  - Overflow goes to the host tier, not to recompute. A sequence the device cannot take now starts on the
    host tier; when a device-lane step has no block for a sequence's next token, device sequences are
    demoted (their KV copied to host blocks) and go on decoding in the host lane. Recompute only when
    the host pool is full too.
  - Which rows move: demotion takes the device rows nearest their end first (`demotion_order`) while the host
    lane would step with them, the newest (as "gpu" preempts) when they would sit parked (`demotion_victims`);
    promotion takes the host rows furthest from their end: the device lane keeps the rows that would otherwise
    decode alone at the end. Once no request waits, a host row swaps places with a device row nearer its end
    that holds more KV (`promotions`): the device lane runs more rows in the same blocks.
  - Promotion: when device room frees, host sequences move back up before new requests are admitted (as
    "gpu" re-admits its preempted sequences first), but a new request is held for them only for a while
    (`_held_for_promotion`): host rows go on decoding while they wait, a held request does not.
  - The cost check: a waiting sequence joins the host lane only when that is predicted to add throughput
    (`host_lane_pays`) over the time it would stay there, its promotion back counted (engine/sched/host_stay.py);
    otherwise it waits as under "gpu". Demotion has no check: its alternative is a
    recompute, not a wait (`demotes`), and a demoted sequence keeps its KV whether or not the lane runs.
  - The host lane itself steps only while it pays with all its rows (`host_step_pays`): where the device
    lane is bound by the GPU, a host step is a whole forward pass for its few rows and costs the device lane
    about a step of its own. Host sequences then wait, with their KV, for device room, as swapped-out
    sequences do; the lane always steps when the device lane has no rows.
  - A sequence larger than the whole device pool is split (`split_device_tokens`): the device keeps its first
    tokens' KV in room no device row will need, the host tier the rest, and it decodes in the host lane with
    both partials merged on the GPU. Its device part grows as room frees up (`split_growth`), never shrinks.
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


# The longest a request waits, in engine steps, so that host rows move up into device room before it (see below).
PROMOTION_HOLD_STEPS = 16


def _held_for_promotion(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, step: int) -> bool:
    """Whether `seq`, whose prompt fits the device now, waits so that host rows move up first (_awaiting_promotion).
    A hold that helps ends within a few dozen steps, when device rows end and a host row moves into their room; one
    that has not is held by host rows that do not move up (each is always in a host step, and promotions() passes
    over those), and it leaves device room idle while seq does not decode at all. So a request is held for at
    most PROMOTION_HOLD_STEPS steps from its first hold, then admitted. Uncapped, the last 6 requests of a
    decode-heavy batch waited ~1,500 steps and then decoded 1,024 tokens as a device lane of 6 rows: auto/gpu 0.84
    (8B shape, 64 x (1024 + 1024) at 3,296 blocks, H100 host, 2026-11-23). A cap of 64 steps still let one run
    in five of 96 such requests read 0.94x, new requests held in 45% of its steps behind host rows that were in
    host steps; at 16 steps, five runs read 1.02-1.06x. The replay (benchmarks/simulate_placement.py, NOTES.md)
    had caps of 8-48 steps losing prompt-heavy points to demotions (0.914 for 0.6B, 64 x (2048 + 256) at 2,304
    blocks); on the device, at 16, that point and the rest of the suite's prompt-heavy points read 0.97-1.00x
    (H100 host, 2026-11-24). Caps of 192 steps and more lost the decode-heavy 8B point in the replay (0.948).
    Off the suite, 8B 32 x (4096 + 512) at 3,296 blocks read ~0.93x at either cap: 23 demotions where gpu
    preempted twice, each followed by a promotion or an admission into the room it freed and, ~20 steps later, the
    next demotion. With promotions leaving headroom (promotions()) it reads 0.96-0.97x, 14 demotions. Holding
    uncapped while no demoted row fits took it to 0.966x with 3 demotions but cost 96 x (1024 + 1024) a tail of
    few device rows (0.936x; branch placement-hold-until-fit, NOTES.md, 2026-11-24)."""
    if not _awaiting_promotion(running, blocks):
        return False
    if seq.held_since is None:
        seq.held_since = step
    return step - seq.held_since < PROMOTION_HOLD_STEPS


def _awaiting_promotion(running: Iterable[Sequence], blocks: BlockManager) -> bool:
    """Whether a host-tier row that could decode on the device waits for device room. Such rows go first, as
    "gpu" re-admits its preempted sequences before later requests (they wait at the head of its queue): a new
    request given room a demotion had just freed pushed the device over again within a few steps, and the next
    row nearest its end was demoted, 65 times where "gpu" recomputed 4 (0.6B shape, 64 x (2048 + 256) at 2,304
    blocks, benchmarks/simulate_placement.py)."""
    gpu = blocks.pool(GPU)
    return any(s.location == CPU and not s.is_split and gpu.blocks_for(s.budget) <= gpu.num_blocks for s in running)


def split_device_tokens(seq: Sequence, policy: str, blocks: BlockManager, running: Iterable[Sequence],
                        waiting: Iterable[Sequence] = ()) -> int:
    """How many of its first tokens a sequence admitted to the host tier keeps on the device (0: none, it is not
    split). Under "auto", only a sequence whose budget exceeds the whole device pool, which can never decode in
    the device lane: one that could is admitted whole as "gpu" would admit it, or waits, because device room
    is worth more to a whole row (it decodes at device speed) than to a split one (its step is bound by its
    host part).

    The device part takes only room whole rows will not need: what is free now less what the device rows still
    lack to reach their budgets (so splitting never causes a demotion) and less the budgets of the `waiting`
    requests that could live on the device whole (admitted after it, they still get the device). It covers at
    most the prompt (the first tokens, whose KV is known at admission) and is a whole number of host blocks, so
    that a host prefill step can gather it into the host-block-sized staging cache (Attention._stage_prefix).
    It grows as room frees up (split_growth)."""
    gpu, cpu = blocks.pool(GPU), blocks.pool(CPU)
    if policy != "auto" or gpu.blocks_for(seq.budget) <= gpu.num_blocks or cpu.block_size % gpu.block_size:
        return 0
    tokens = min(_spare_device_blocks(seq, blocks, running, waiting) * gpu.block_size, len(seq))
    tokens = tokens // cpu.block_size * cpu.block_size
    return tokens if tokens > 0 and blocks.can_allocate(seq, CPU, tokens) else 0


def split_growth(seq: Sequence, blocks: BlockManager, running: Iterable[Sequence],
                 waiting: Iterable[Sequence] = ()) -> int:
    """How many leading blocks of a split sequence's host part move to the device now (0: none). When device room
    frees up (device rows end, after host rows have been promoted into it), a split row's device part grows into
    what whole rows will not need, by the rule split_device_tokens admits by: each host block that moves up is
    read at device speed from then on, and the row's steps, bound by its host part, get shorter. Only computed,
    full host blocks move, so the host part stays aligned at its first token. The copy is a promotion's (the
    scheduler asks only with kv_promotion on, right after promotions). The device part never shrinks:
    the room it holds was left over when it was taken, and device rows that need more are demoted instead
    (demotion_order), as without splits."""
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
    """Whether a device sequence that must give up its blocks moves to the host tier (else: recomputed):
    under "auto", whenever the host pool has room for it. No cost check here: the alternative is not waiting
    but recomputing its whole context on the device. When the check also ruled on demotions it refused ~20
    of ~45 in the decode-heavy run while the host lane was idle (a measured slowdown of 1.07-1.10 against
    one row's rate), and the recomputes cost more than the lane's wake-up: auto/gpu 0.91-1.07 over five runs
    with 19-21 recomputes, 1.05 in both runs without (H100 host, 2026-11-22, benchmarks/NOTES.md)."""
    if policy != "auto":
        return False
    host = blocks.pool(CPU)
    return host.blocks_for(len(victim)) <= host.num_free


def demotion_order(rows: list[Sequence]) -> list[Sequence]:
    """Device rows by how soon they end: fewest tokens left first (the newest first among equals).
    A row near its end frees the most blocks, finishes in the host lane within a few steps and is not
    promoted back, so the device keeps the rows furthest from their end, the ones that would otherwise decode
    alone at the end of a batch (promotions() takes those first for the same reason). Demoting the newest
    instead, as "gpu" preempts, demoted rows that still had most of their tokens to go: they came back up late,
    some moved up and down several times, and the batch ended with 1-3 device rows for ~300 steps
    (benchmarks/simulate_placement.py, whose replay of the scheduler matched the H100 run's step and move
    counts). Measured on the H100 host, decode-heavy (2026-11-22, benchmarks/NOTES.md): 8B, 64 x (1024 + 1024)
    at a 24 GB card's budget, auto/gpu 0.96 -> 1.01 (with demotions' copies off the engine's thread); 0.6B,
    32 x (1024 + 1024) at 1,024 blocks, 1.09 -> 1.27-1.31."""
    return sorted(reversed(rows), key=lambda seq: seq.tokens_left)  # stable: newest first among equals


def demotion_victims(device_rows: list[Sequence], host_rows: list[Sequence],
                     stats: LaneStats | None) -> Iterator[Sequence]:
    """Device rows (in admission order) in the order they are demoted, each picked once those before it have gone
    to the host lane. The row nearest its end (demotion_order) goes if the host lane would step with it
    (host_lane_keeps_up): it finishes there. If the lane would not, a demoted row sits parked, with its KV, until
    device room frees for it, and then the newest row goes, as "gpu" preempts: parked, it comes back up at the
    head of the queue with most of its tokens to go, as "gpu"'s preempted row does, and starts the next wave with
    it. A parked row near its end instead came back for its last tokens into room the next wave needed, and
    the last requests started a few at a time behind such returns: 8B shape, 48 x (2048 + 512) at 2,560 blocks,
    the device lane ended on a tail of 15 rows falling to 3 over ~3.3 s, and five runs in seven read 0.92-0.96x
    "gpu", each with 400-500 host steps refused (H100 host, 2026-11-24). The replay of that point
    (benchmarks/simulate_placement.py) reads 1.004 with this rule against 0.953 with the nearest-end order
    alone, and no other point of its 73 falls below 0.97 for it; on the device, three runs read 0.987-0.999x,
    still refusing 249-435 host steps, with 9-10 demotions instead of 16 (NOTES.md, 2026-11-24, ninth session)."""
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


# Host-tier prefills measured before the admission check trusts their median (LaneStats.prefill_done). One
# sample decided whole runs: a single 1,024-token prompt's step (62 ms, where later ones took 40-51 and device-tier
# steps of that size 17-82) read 52 us a token, and the check refused 2,700 admissions (0.6B shape,
# 32 x (1024 + 1024) at 512 blocks, H100 host, 2026-11-24, benchmarks/probe_host_prefill.py).
MIN_PREFILL_SAMPLES = 3


def host_lane_pays(seq: Sequence, running: Iterable[Sequence], blocks: BlockManager, stats: LaneStats | None,
                   joining: Iterable[Sequence] = ()) -> bool:
    """Whether seq as one more host-lane row saves the device lane more time than it costs, over the time it would
    stay there (engine/sched/host_stay.py): the tokens it makes before device room frees for it, against its promotion
    then and the slowdown of the device lane while the host lane runs. A busy lane takes seq if the gain of its
    rows with seq beats the gain without by more than seq's prefill costs beyond a device row's; an idle one is
    woken only if the gain of every row that would start it together (seq and `joining`) is more than their
    prefills cost so. That cost (LaneStats.host_prefill_seconds_per_token) left out, the check admitted 16 rows
    of a prompt-heavy batch that each decoded ~24 tokens on the host: 0.18 s of device time saved, 0.58 s of
    prefill added (0.6B shape, 64 x (2048 + 256) at 576 blocks, H100 host, 2026-11-23).

    Before both lanes are measured there is nothing to predict from. The first request tries the host lane alone
    while the rest wait for its measured step (a few device steps): admitting every waiting request on no
    evidence sent all 48 of a prompt-heavy batch to the host tier in its first prefill steps, each to make ~14
    tokens and be promoted back (benchmarks/NOTES.md). And while the device lane has rows but no measured step,
    requests wait for it."""
    if stats is None or stats.kv_bytes_per_token is None:
        return True
    running = list(running)
    host = [s for s in running if s.location == CPU and s is not seq]
    device = [s for s in running if s.location == GPU]
    if stats.host_step_seconds(0) is None:
        return not host
    if not stats.device_tok_s.value:
        return not device
    # Each new host row's prefill costs the device lane more than a device row's (LaneStats.prefill_done). Until
    # that is measured (against device-tier prefills measured first), one host-tier prompt prefills at a time and
    # only its stay is checked.
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
HOST_PROBE_STEPS = 64


def host_step_pays(host_rows: list[Sequence], device_rows: int, stats: LaneStats | None) -> bool:
    """Whether the host lane should take a step now with these rows: its predicted tokens per second against
    what it costs the device lane at the measured slowdown (device tok/s x (1 - 1/slowdown)), the rule that
    admission applies to one row, applied to the lane as it stands.

    Measured on the H100 host (2026-11-22, benchmarks/NOTES.md): 8B, 64 x (1024 + 1024) at a 24 GB card's
    device budget, the lane gave 63 tok/s while the device lane's 1,409 lost 1 - 1/1.10 of its rate (~125);
    every other point of the decode-heavy suite had it paying (195 > 138, 217 > 76, 183 > 77). Steps when the
    device lane has no rows, and until both costs are measured.

    A refusal stops the measurements it was made from, so a lane refused on a bad estimate stayed refused. Two
    cold host steps put its kernels at 8x what the same workload measured over 201 steps the day before, and
    the device lane's slowdown at 2.40; the lane was then refused 6,348 times, its rows all waiting for
    promotion (auto/gpu 1.00, against 1.12 the day before; 0.6B shape, 32 x (1024 + 1024) at 512 blocks, H100
    host, 2026-11-24). So after HOST_PROBE_STEPS device steps without one, the lane steps anyway (a
    "host_step_probe" check): a step that does not pay costs the device lane about one step of its own (see the
    module's docstring), under 2% at this interval."""
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


# Device room a promotion leaves for the next tokens of the device rows and of the promoted row (see promotions()).
PROMOTION_HEADROOM_TOKENS = 64
# How many more tokens a host row must have left than the device row it would displace, to move up past the
# headroom (see promotions()). Gaps of 32-256 replayed within 0.01 of 1 on average; a gap longer than any
# request's output turns the swaps off.
SWAP_GAP_TOKENS = 1


def promotions(running: Iterable[Sequence], blocks: BlockManager, extra_room: int = 0,
               stats: LaneStats | None = None, rotate: bool = False) -> Iterator[Sequence]:
    """Host-tier sequences that the device pool can take now, most tokens left first (the oldest first among
    equals), skipping those in flight or still in prefill, and split sequences (whose parts stay). extra_room:
    blocks that are about to free up, to ask which sequences will fit then.

    A row moves up only if, after it, the free room still holds PROMOTION_HEADROOM_TOKENS more tokens of every
    device row and of itself (or what is left of their budgets). By "gpu"'s rule alone (its KV and the next token
    fit), a row moved into the room a demotion had just freed, the device overflowed again within ~20 steps and
    demoted the next row near its end, which had 4.4k tokens of KV: 18 promotions and 23 demotions where "gpu"
    preempted twice (8B shape, 32 x (4096 + 512) at 3,296 blocks, benchmarks/simulate_placement.py). With 64
    tokens the replay read 0.970 there against 0.940, and every other point within 0.02 or better; 32 or 128
    tokens replayed within 0.03 of 64 (NOTES.md, 2026-11-24).

    With `rotate` (no request waits to be admitted), a row the headroom keeps out moves up anyway when its next
    token fits and the row the next demotion would take (demotion_victims) holds at least as much KV and has
    SWAP_GAP_TOKENS fewer tokens left than it: the device pool then swaps that row for this one within a few
    steps. The device lane keeps the rows furthest from their end, which hold the least KV, so it runs more rows
    in the same blocks, and the rows advance together instead of ending on a tail. In a decode-heavy batch the
    headroom otherwise blocked every promotion while the device was full: the first wave's rows stayed on the
    device as their KV grew (8B shape, 64 x (1024 + 1024) at 3,296 blocks: 50 rows falling to 26 over 10 s, in
    the replay). An idealized schedule that swaps this way (benchmarks/ideal_schedule.py) held ~35. While
    requests wait, device room is theirs first (choose_tier), and swapping host rows in ahead of them left a batch
    of 128 a tail of its last admissions (benchmarks/simulate_placement.py, NOTES.md, 2026-11-24, fifteenth
    session)."""
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
    (demotion_victims) is another row, with SWAP_GAP_TOKENS fewer tokens left than seq and no less KV (see
    promotions()): a swap that leaves the device lane no fewer rows."""
    on_device = lambda s: s.location == GPU or s.seq_id in promoted or s is seq
    device = [s for s in running if on_device(s) and not s.in_prefill]
    host = [s for s in running if not on_device(s) and s.location == CPU]
    victim = next(demotion_victims(device, host, stats))
    return victim is not seq and seq.tokens_left - victim.tokens_left >= SWAP_GAP_TOKENS and len(victim) >= len(seq)
