"""Continuous batching with chunked prefill on two KV tiers: `Scheduler.plan` makes each engine step's StepPlan
(docs/design.md, "One engine step, two decode lanes"). Prefill goes first, so new requests join as soon as a tier has
room. A row whose next token finds no room makes a row on its tier give up its blocks: demoted where placement allows,
else the newest is preempted and recomputed. Rows in flight are never touched; no request is dropped.
"""
from collections import deque
from collections.abc import Iterator
from itertools import islice

from offload_engine.engine.sched import placement
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.host_stay import promotion_order
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sched.placement import choose_tier, demotes, demotion_victims, promotions
from offload_engine.engine.sched.plan import LaneState, StepPlan, Wait
from offload_engine.engine.sequence import PENDING_TOKEN, BlockLocation, Sequence, SequenceStatus

# Steps' worth of a demotion's freed blocks handed out at once (their part of the copy first), the rest once it has
# landed. Why 3: docs/decisions/engine-step.md, "Demotion spare blocks".
DEMOTION_SPARE_STEPS = 3
# Promotion in parts: a host row takes a device part only when device rows this many tokens from their end free room
# for the rest (~0.4 s at 8B's 6 ms step, enough for a 33k-token row's part to cross first). Not measured yet.
PARTS_HORIZON_STEPS = 64


class Scheduler:
    def __init__(self, blocks: BlockManager, kv_placement: str, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], kv_promotion: bool = False,
                 stats: LaneStats | None = None, segment_tokens: int = 0, promote_in_parts: bool = False):
        self.blocks = blocks
        self.kv_placement = kv_placement
        self.kv_promotion = kv_promotion and kv_placement == "auto"
        # Host rows take spare device room for their leading blocks (as split rows), and the rest moves when room frees
        # (placement.split_growth, placement.promotions): a promotion then waits on part of a row's copy only.
        self.promote_in_parts = promote_in_parts and self.kv_promotion
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.segment_tokens = segment_tokens  # of a layer-major prefill segment; 0: none
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # (seq, length) -> the stop string its first `length` tokens' text ends with, or None; set by whoever holds
        # the tokenizer (LLM), needed only for requests with SamplingParams.stop.
        self.stop_strings = None
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in admission order: the newest is preempted first
        self.stats = stats
        self.demotions: list[tuple[Sequence, list[int]]] = []  # made by schedule_decode, handed out by plan
        self.num_preemptions = 0
        self.num_promotions = 0
        self.num_demotions = 0
        self.num_split_growths = 0
        self.num_steps = 0  # device-lane schedules: the clock of admission holds

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def reset(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self.demotions = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self, lanes: LaneState) -> StepPlan:
        """This step's plan: promotions first; then a prefill step if prompt chunks run on this device, else the host
        lane's rows if its step pays, the device rows and the demotions that make room for them, and, without device
        rows, what to wait for. The stages below are public for tests; the engine calls only this."""
        moves = self.schedule_promotions() if lanes.may_promote else []
        if lanes.promotions_sit_out:
            for seq, _ in moves:
                seq.in_flight = True  # until its copy lands (LLMEngine takes it in)
        prefill = [] if lanes.prefill_lane_computing else self.schedule_prefill()
        elsewhere = [s for s in prefill if lanes.prefill_lane and prefills_on_lane(s)]
        here = [s for s in prefill if not (lanes.prefill_lane and prefills_on_lane(s))]
        for seq in elsewhere:
            seq.in_flight = True  # on the prefill lane until it takes the row in: not this step's decode row
        if here:
            return StepPlan(tuple(moves), tuple(here), tuple(elsewhere))
        host_rows = [] if lanes.host_step_in_flight else self._host_rows_that_pay(lanes.hold_back_horizon)
        device_rows = self.schedule_decode(BlockLocation.GPU)
        spare = DEMOTION_SPARE_STEPS * self.blocks.pool(BlockLocation.GPU).blocks_for(len(device_rows))
        demotions, first = self.take_demotions(spare)
        wait, idle_host_rows = Wait.NOTHING, []
        if not device_rows:
            wait, idle_host_rows = self._wait_without_device_rows(lanes, bool(host_rows), bool(moves), bool(elsewhere))
        return StepPlan(tuple(moves), (), tuple(elsewhere), tuple(host_rows), tuple(device_rows), tuple(demotions),
                        tuple(first), wait, tuple(idle_host_rows))

    def _host_rows_that_pay(self, hold_back_horizon: float | None) -> list[Sequence]:
        """A host-lane step's rows if it pays, less the rows device room frees up for soon (promotion_hold_back)."""
        hold_back = frozenset() if hold_back_horizon is None else self.promotion_hold_back(hold_back_horizon)
        return self.schedule_decode(BlockLocation.CPU, hold_back=hold_back) if self.host_step_pays() else []

    def _wait_without_device_rows(self, lanes: LaneState, host_starts: bool, promoted: bool,
                                  prefill_elsewhere: bool) -> tuple[Wait, list[Sequence]]:
        """What a step without device rows waits for, and the host rows the cost check held back, which step now."""
        if lanes.device_step_in_flight:
            return Wait.DEVICE_STEP, []
        if lanes.promotions_landing or (promoted and lanes.promotions_sit_out):
            return Wait.PROMOTIONS, []
        host_busy = lanes.host_step_in_flight or host_starts
        idle_rows = [] if host_busy else self.schedule_decode(BlockLocation.CPU)
        if lanes.prefill_lane_busy or prefill_elsewhere:
            return Wait.PREFILL_LANE, idle_rows
        return (Wait.HOST_STEP if host_busy or idle_rows else Wait.NOTHING), idle_rows

    def schedule_prefill(self) -> list[Sequence]:
        """Prompt chunks for the next step: running prefills not in flight first, then admissions."""
        self.blocks.pool(BlockLocation.GPU).reclaim()  # device blocks whose demotion copies have landed
        budget, batch = self.max_num_batched_tokens, []
        for seq in self.running:
            if seq.in_prefill and not seq.in_flight and budget > 0:
                budget -= self._take_chunk(seq, budget)
                batch.append(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if _waits_for_sibling(seq):
                break  # its prompt's blocks come from the sibling's prefix, once computed
            tier = choose_tier(seq, self.kv_placement, self.blocks, self.running, self.stats, self._could_join(),
                               self.kv_promotion, self.num_steps)
            if tier is None:
                break
            device_tokens = placement.split_device_tokens(seq, self.kv_placement, self.blocks, self.running,
                                                          self._could_join()) if tier == BlockLocation.CPU else 0
            self.blocks.allocate(seq, tier, device_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            budget -= self._take_chunk(seq, budget)
            batch.append(seq)
        return batch

    def _take_chunk(self, seq: Sequence, budget: int) -> int:
        """Schedules seq's next chunk within budget; returns its tokens. A staged sequence that would leave part of
        its prompt for later takes, alone in its step, a layer-major segment of up to segment_tokens instead."""
        count = min(seq.num_uncomputed_tokens, budget)
        alone = budget == self.max_num_batched_tokens
        staged = seq.location == BlockLocation.CPU and seq.num_computed_tokens + count > seq.num_device_tokens
        # (A segment gives logits of its last token only: prompt_logprobs need every chunk's.)
        if alone and staged and count < seq.num_uncomputed_tokens and seq.params.prompt_logprobs is None:
            count = min(seq.num_uncomputed_tokens, max(budget, self.segment_tokens))
        seq.num_scheduled_tokens = count
        return count

    def schedule_decode(self, tier: BlockLocation, hold_back: frozenset[int] = frozenset()) -> list[Sequence]:
        """One token for every running, prefilled sequence on `tier` that is not in flight or held back."""
        if tier == BlockLocation.GPU:
            self.num_steps += 1
            if self.kv_placement == "auto":
                self._demote_for_room()
        batch = []
        for seq in list(self.running):
            if seq.location != tier or seq.in_flight or seq.in_prefill or seq.status != SequenceStatus.RUNNING:
                continue
            if seq.seq_id in hold_back or seq.tokens_left <= 0:
                continue  # (no tokens left: a device step in flight samples its last one; resolve finishes it)
            while not self.blocks.can_append(seq):
                if self.blocks.settle(seq.location):
                    continue  # blocks a demotion's copy was still reading are free now: no need to free more
                victim = self._newest_on_tier(seq)
                self._make_room(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slot(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        return batch

    def host_step_pays(self) -> bool:
        decoding = [s for s in self.running if not s.in_prefill and s.status == SequenceStatus.RUNNING]
        host = [s for s in decoding if s.location == BlockLocation.CPU and not s.in_flight]
        device_rows = sum(s.location == BlockLocation.GPU for s in decoding)
        return placement.host_step_pays(host, device_rows, self.stats)

    def take_demotions(self, spare_blocks: int = 0) -> tuple[list[tuple[Sequence, list[int]]], list[int]]:
        """The sequences schedule_decode demoted, each with the device blocks that still hold its KV, and those of
        the blocks the device may write from the next step on: the ones this step took and `spare_blocks` more."""
        demotions, self.demotions = self.demotions, []
        first = self.blocks.pool(BlockLocation.GPU).hand_out_held(spare_blocks) if demotions else []
        return demotions, first

    def schedule_promotions(self) -> list[tuple[Sequence, list[int]]]:
        """Host-tier sequences to move into the device pool now, each with the host blocks that still hold its KV,
        then split rows' device parts that grow. Call before admissions: host rows take freed device room first."""
        if not self.kv_promotion:
            return []
        self.blocks.pool(BlockLocation.GPU).reclaim()
        # With no request waiting for room, host rows may swap places with device rows nearer their end.
        in_parts = self.promote_in_parts
        promoted = list(promotions(self.running, self.blocks, stats=self.stats, rotate=not self.waiting,
                                   in_parts=in_parts))
        for seq in promoted:
            seq.promoted = True
        moves = [self.blocks.promote_split(seq) if seq.is_split else (seq, self.blocks.move(seq, BlockLocation.GPU))
                 for seq in promoted]
        self.num_promotions += len(moves)
        growing = [s for s in self.running if s.is_split]
        if in_parts:  # a part, only for the rows that room is about to free up for (promoted whole then)
            soon = self._promoted_soon(PARTS_HORIZON_STEPS)
            growing += promotion_order(s for s in self.running if s.seq_id in soon and not s.is_split)
        for seq in growing:
            count = placement.split_growth(seq, self.blocks, self.running, self._could_join(), in_parts)
            if count:
                moves.append(self.blocks.grow_device_part(seq, count))
                self.num_split_growths += 1
        return moves

    def promotion_hold_back(self, horizon_steps: float) -> frozenset[int]:
        """Host-tier sequences to keep out of the next host step because device rows within `horizon_steps` tokens
        of their end free room for them before it would be back: they move up at once, not a host step later."""
        return self._promoted_soon(horizon_steps) if self.kv_promotion else frozenset()

    def _promoted_soon(self, horizon_steps: float) -> frozenset[int]:
        """Host-tier sequences that device rows within `horizon_steps` tokens of their end free room for."""
        freeing = sum(len(s.block_table) for s in self.running
                      if s.location == BlockLocation.GPU and not s.in_prefill and s.tokens_left <= horizon_steps)
        if not freeing:
            return frozenset()
        return frozenset(s.seq_id for s in promotions(self.running, self.blocks, extra_room=freeing,
                                                       in_parts=self.promote_in_parts))

    def _demote_for_room(self) -> None:
        """Demotes rows in demotion_victims' order until this step's rows fit; the rest is left to preemption."""
        pool = self.blocks.pool(BlockLocation.GPU)
        decoding = [s for s in self.running if not s.in_prefill and s.status == SequenceStatus.RUNNING]
        rows = [s for s in decoding if s.location == BlockLocation.GPU and not s.in_flight]
        needs = {s.seq_id: pool.blocks_for(len(s)) > len(s.block_table) for s in rows}
        needed = sum(needs.values())
        pool.reclaim(wait=needed > pool.num_free)  # rather than demote, wait for a demotion's copy to land
        if needed <= pool.num_free:
            return  # the common step: room for every row, nothing to order
        host = [s for s in decoding if s.location == BlockLocation.CPU]
        for victim in demotion_victims(rows, host, self.stats):
            if needed <= pool.num_free or not demotes(victim, self.kv_placement, self.blocks):
                return
            self._make_room(victim)
            needed -= needs[victim.seq_id]

    def _newest_on_tier(self, seq: Sequence) -> Sequence:
        return next(s for s in reversed(self.running)
                    if s.location == seq.location and not s.in_flight and not s.in_prefill)

    def _could_join(self) -> Iterator[Sequence]:
        """The waiting requests that could run beside the current ones (max_num_seqs), not the whole queue."""
        return islice(self.waiting, max(0, self.max_num_seqs - len(self.running)))

    def _make_room(self, victim: Sequence) -> None:
        """Frees a decoding sequence's blocks on its tier: demoted where placement says so, else preempted."""
        if victim.location == BlockLocation.GPU and demotes(victim, self.kv_placement, self.blocks):
            self.demotions.append((victim, self.blocks.move(victim, BlockLocation.CPU, hold=True)))
            victim.demoted = True
            self.num_demotions += 1
        else:
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Records a step's results; returns the sequences that finished."""
        finished = []
        for seq, token in zip(batch, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            self.blocks.register_computed_blocks(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # one chunk of a longer prefill: its sample means nothing yet
            seq.token_ids.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
        return finished

    def launched(self, batch: list[Sequence]) -> None:
        """Records a device-lane decode step queued but not yet read: each row's sampled token holds a PENDING_TOKEN
        place until resolve, so the next step can be planned at once (only eos is unknown)."""
        for seq in batch:
            seq.num_computed_tokens += 1
            seq.token_ids.append(PENDING_TOKEN)

    def resolve(self, batch: list[Sequence], token_ids: list[int], positions: list[int]) -> list[Sequence]:
        """Puts a launched step's sampled ids in their places; returns the rows that finished. A row that
        finished in an earlier step computed one more token in this one, which is dropped. A row that finishes
        here may already be in the next step: its token there is dropped, and its place with it."""
        finished = []
        for seq, token, position in zip(batch, token_ids, positions):
            if seq.is_finished:
                continue
            seq.token_ids[position] = token
            if seq.status == SequenceStatus.RUNNING:  # (preempted since: it holds no blocks now)
                self.blocks.register_computed_blocks(seq)
            seq.finish_reason = self._finish_reason(seq, token, position + 1)
            if seq.finish_reason is not None:
                del seq.token_ids[position + 1 :]
                self.finish(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int, length: int | None = None) -> str | None:
        """Why seq ends with `token`, its length-th token (default: its newest), or None."""
        params = seq.params
        length = len(seq) if length is None else length
        if length - seq.num_prompt_tokens < params.min_tokens:  # (its eos and stop tokens are not drawn till then)
            return "length" if length >= self.max_model_len else None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and self.stop_strings is not None:
            seq.stop_string = self.stop_strings(seq, length)
            if seq.stop_string is not None:
                return "stop"
        if length - seq.num_prompt_tokens >= params.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence) -> None:
        if seq.location is not None:
            self.blocks.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def prefills_on_lane(seq: Sequence) -> bool:
    """Whether a prompt chunk runs on the prefill lane, where there is one: unsplit rows, their KV landing in the tier
    they decode from (the decode device's pool, or the host pool the lane writes too). A split row's device part is
    the decode device's alone, so it prefills there."""
    return not seq.is_split


def _waits_for_sibling(seq: Sequence) -> bool:
    """A completion of SamplingParams.n whose first sibling has not computed its prompt yet (nor finished)."""
    first = seq.after
    return first is not None and not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens
