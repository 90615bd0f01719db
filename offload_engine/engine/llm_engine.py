"""The step loop: schedule -> run the model -> postprocess, until every request has finished.

Decode runs in two lanes. Device-tier sequences decode on the engine's thread, a step every few
milliseconds; host-tier sequences decode on a "host-lane" thread, where each step waits on the CPU
attention kernel layer by layer. The lanes run at once, so the device tier never waits for the host tier:
while one host-tier step is in flight, many device-tier steps (and prefills) go by, and its tokens are
taken in by whichever step finds it done. All scheduling happens on the engine's thread; a sequence in
flight is left alone until it comes back.

Sequences move between the lanes (engine/sched/placement.py decides): a device-tier sequence that the device pool
has no room for is demoted into the host lane, and host-tier sequences that are not in flight are promoted
into freed device room before new requests take it, so the device lane stays as full as under "gpu" and
never idles while the host lane decodes the tail of a batch. Host sequences that room is about to free up
for sit out the next host step (Scheduler.promotion_hold_back), so they are at hand when it does, except
where a host step holds the executor from start to end (engine/graphs/host_step_graphs.py) and a promotion would need
it (ModelRunner.promotes_beside_host_steps); there promotions happen between host steps. On CUDA a promotion's
copy runs beside the device lane's steps, a group of sequences at a time, and each group sits out both lanes
until its copy has landed (ModelRunner.promote). Both
lanes' step times feed LaneStats, which placement's cost checks predict from: whether a waiting request joins the
host lane, and whether the host lane steps at all while the device lane has rows (placement.host_step_pays).

Async scheduling (on by default, `async_scheduling=False` turns it off): a device-lane decode step returns as soon
as it is queued (ModelRunner.run gives DeferredTokens), and the engine reads its tokens only after it has
scheduled and queued the next one, which takes them on the device. So the host's work for step N+1 (scheduling,
inputs, launch) runs while the GPU computes step N, and the GPU never waits for Python between decode steps. A
row that finished at step N has computed one more token in step N+1, which is dropped. A prefill step reads the
step in flight first.

Prefill/decode separation (`prefill_device`): device-tier prompts are prefilled on another device, on a "prefill
lane" thread (engine/disagg/prefill_lane.py), and their KV crosses to this one once (engine/disagg/kv_handoff.py). The engine's
thread keeps stepping both decode lanes meanwhile, and takes a prompt in, as a row that decodes, once its KV has
landed.
"""
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from offload_engine.config import EngineConfig, ModelConfig
from offload_engine.distributed import make_runner
from offload_engine.engine import gc_heap
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.tiers.move_staging import split_moves
from offload_engine.engine.sched.placement import can_ever_fit
from offload_engine.engine.disagg.prefill_lane import PrefillLane
from offload_engine.engine.sched.scheduler import Scheduler
from offload_engine.engine.sequence import BlockLocation, Sequence


PROMOTION_GROUP_BYTES = 512 << 20  # of KV per promotion copy that lands on its own (LLMEngine._promote)
# A demotion's copy beside the device lane lands within a step or two (~2k tokens of 8B KV, ~290 MB, at ~45 GB/s:
# ~6.5 ms, against ~9.5 ms steps); the device rows start about rows / block_size new blocks a step. The freed
# blocks for this many steps go out at once (their part of the copy first), the rest once it has landed.
DEMOTION_SPARE_STEPS = 3


@dataclass
class StepStats:
    is_prefill: bool
    num_tokens: int  # prompt tokens computed (prefill) or tokens generated (decode)
    seconds: float
    finished: list[Sequence]


class LLMEngine:
    # Prefill/decode separation: the prefill device's lane, or None (also for engines that benchmarks/
    # simulate_placement.py assembles without __init__).
    prefill: PrefillLane | None = None

    def __init__(self, model_dir: str, model_cfg: ModelConfig, cfg: EngineConfig, dtype, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        self.cfg = cfg
        self.max_model_len = max_model_len
        # A ModelRunner, or under tensor parallelism rank 0's runner, which drives the other ranks.
        self.runner = make_runner(model_dir, model_cfg, cfg, dtype, max_model_len)
        self.closed = False
        self.blocks = BlockManager(self.runner.num_gpu_blocks, cfg.block_size, self.runner.num_cpu_blocks,
                                   cfg.cpu_block_size, cfg.enable_prefix_caching)
        self.stats = LaneStats(model_cfg.kv_bytes_per_token(dtype), self.runner.link_seconds_per_byte)
        self.scheduler = Scheduler(self.blocks, cfg.kv_placement, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   max_model_len, eos_token_ids, cfg.kv_promotion, self.stats,
                                   segment_tokens=self.runner.segment_tokens)
        self.host_lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-lane")
        self.in_flight: tuple[list[Sequence], Future] | None = None  # the host lane's decode step
        self.promoting: list[tuple[object, list[Sequence]]] = []  # promotions whose reads run: (event, rows)
        # The latest step times of each lane: how many device steps one host step spans (promotion look-ahead).
        self.host_step_seconds = self.device_step_seconds = 0.0
        self.pending = None  # async scheduling: the device-lane step queued last, whose tokens are not read yet
        self._resolved_at = 0.0  # when the device lane's latest step was read: steps in a row are timed from it
        self.decoded_by_lane = {"device": 0, "host": 0}  # tokens each lane decoded (benchmarks report the split)
        self.stats.device_prefill_elsewhere = cfg.prefill_device is not None
        try:
            self.prefill = PrefillLane.start(model_dir, model_cfg, cfg, dtype, max_model_len, self.runner,
                                             self.blocks) if cfg.prefill_device is not None else None
        except BaseException:
            self.runner.close()  # a failed start leaves no threads or pinned memory behind
            raise
        gc_heap.freeze_after_start_up()

    def make_sequence(self, token_ids: list[int], params) -> Sequence:
        """A sequence for the request, or ValueError if no pool it may use could ever hold it."""
        budget = min(len(token_ids) + params.max_tokens, self.max_model_len)
        seq = Sequence(token_ids, params, budget)
        if not can_ever_fit(seq, self.cfg.kv_placement, self.blocks):
            raise ValueError(
                f"a request of {len(token_ids)} prompt + {params.max_tokens} new tokens needs more KV blocks than "
                f"kv_placement={self.cfg.kv_placement!r} has (device pool: {self.runner.num_gpu_blocks} blocks of "
                f"{self.cfg.block_size}, host pool: {self.runner.num_cpu_blocks} blocks of {self.cfg.cpu_block_size}): "
                "raise num_gpu_blocks / num_cpu_blocks, use kv_placement='auto', or lower max_tokens")
        return seq

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.pending is not None

    def step(self) -> StepStats:
        stats = self._step()
        if not self.has_work():
            self.runner.check_host_writes(wait=True)  # settled before generate() returns: errors surface here
            self.blocks.settle(BlockLocation.GPU)  # and the blocks demotions' copies read are free again
        return stats

    def _step(self) -> StepStats:
        """One engine step: take in what came back (the host lane's step, promotions' copies, the prefill lane's
        rows) and start promotions; then either a prefill step, or a device-lane decode step beside the host lane
        with this step's demotions, or, with no device rows, a wait for whichever lane has work."""
        start = time.perf_counter()
        finished, num_tokens = self._take_host_step(wait=False)
        self._land_promotions(wait=False)
        more, prefilled, prefill_seconds = self.prefill.take(self.scheduler) if self.prefill else ([], 0, 0.0)
        finished += more
        promoted, move_seconds = self._start_promotions()
        batch = self._schedule_prefill()
        if batch:
            return self._prefill_step(batch, finished, start)
        if self.in_flight is None:
            self._start_host_step_if_it_pays()
        batch = self.scheduler.schedule_decode(BlockLocation.GPU)
        demoted, demote_seconds = self._start_demotions(len(batch))
        moved = (sum(move.num_computed_tokens for move, _ in promoted + demoted), move_seconds + demote_seconds)
        if batch:
            finished += self._device_decode_step(batch, moved, copying=bool(promoted or demoted))
            num_tokens += len(batch)
        else:
            if moved[0]:
                self.stats.move_done(*moved)  # no device step to slow down
            more, count = self._wait_for_either_lane(progressed=bool(num_tokens))
            finished, num_tokens = finished + more, num_tokens + count
        if prefilled and not num_tokens:  # a step that decoded nothing reports the prefill it took in
            return StepStats(True, prefilled, prefill_seconds, finished)
        return StepStats(False, num_tokens, time.perf_counter() - start, finished)

    def _start_promotions(self) -> tuple[list[tuple[Sequence, list[int]]], float]:
        """Host-tier sequences take freed device room before new requests do, as "gpu" re-admits its preempted
        sequences first (engine/sched/placement.py). Returns the moves started and the engine thread's time starting
        them (LaneStats.move_done).

        Where promotions need the executor, which a whole-step host loop holds until its step is back, they happen
        between host steps, rather than have this thread wait on the executor."""
        promotes_now = self.in_flight is None or (self.runner.promotes_beside_host_steps
                                                  and not self.runner.host_writes_pending())
        moves = self.scheduler.schedule_promotions() if promotes_now else []
        if not moves:
            return [], 0.0
        began = time.perf_counter()
        self._promote(moves)
        return moves, time.perf_counter() - began

    def _prefill_step(self, batch: list[Sequence], finished: list[Sequence], start: float) -> StepStats:
        """Runs one prefill step on this device, after reading the device-lane step in flight. Promotions started
        just before go unrecorded: the prefill's time would swamp what they cost."""
        finished += self._resolve_device_step()
        began = time.perf_counter()
        num_tokens = sum(s.num_scheduled_tokens for s in batch)
        host_tokens = sum(s.num_scheduled_tokens for s in batch if s.location == BlockLocation.CPU)
        sampled = self.runner.prefill(batch)
        self.stats.prefill_done(num_tokens, host_tokens, time.perf_counter() - began)
        finished += self.scheduler.postprocess(batch, sampled)
        return StepStats(True, num_tokens, time.perf_counter() - start, finished)

    def _start_host_step_if_it_pays(self) -> None:
        """Starts a host-lane step if the cost check lets it (placement.host_step_pays). Host rows that device room
        is about to free up for sit it out, where they could be promoted mid-step."""
        horizon = self.host_step_seconds / max(self.device_step_seconds, 1e-4) + 1
        hold_back = (self.scheduler.promotion_hold_back(horizon) if self.runner.promotes_beside_host_steps
                     else frozenset())
        if self.scheduler.host_step_pays():
            self._start_host_step(self.scheduler.schedule_decode(BlockLocation.CPU, hold_back=hold_back))

    def _start_demotions(self, device_rows: int) -> tuple[list[tuple[Sequence, list[int]]], float]:
        """Demotes the device rows the pool has no room for. The old device blocks of rows demoted now that the
        next few steps may write have their copy go first. Returns the demotions and the engine thread's time."""
        spare = DEMOTION_SPARE_STEPS * self.blocks.pool(BlockLocation.GPU).blocks_for(device_rows)
        demoted, first_blocks = self.scheduler.take_demotions(spare)
        if not demoted:
            return [], 0.0
        began = time.perf_counter()
        self._demote(demoted, first_blocks)
        return demoted, time.perf_counter() - began

    def _device_decode_step(self, batch: list[Sequence], moved: tuple[int, float], copying: bool) -> list[Sequence]:
        """Queues a device-lane decode step, then reads the one before it (the GPU has this one queued behind it);
        without async scheduling, this one too. Returns the rows finished. `moved`: the tokens and engine-thread
        seconds of this step's moves; a step beside KV copies is not timed as a quiet one."""
        launched = self.runner.launch_device_decode(batch)
        self.scheduler.launched(launched.seqs)
        copying = copying or bool(self.promoting) or (self.prefill is not None and self.prefill.landing)
        launched.host_busy, launched.quiet, launched.moved = self.in_flight is not None, not copying, moved
        finished = self._resolve_device_step()
        self.pending = launched
        if not self.cfg.async_scheduling:
            finished += self._resolve_device_step()
        self.decoded_by_lane["device"] += len(batch)
        return finished

    def _wait_for_either_lane(self, progressed: bool) -> tuple[list[Sequence], int]:
        """With no device rows to step: waits for what comes next (the device step in flight, promotions' copies,
        the prefill lane, or a host step) and returns the rows finished and the tokens decoded. `progressed`: this
        step has already decoded tokens; if it has not and nothing is under way, the scheduler is stuck."""
        if self.pending is not None:
            return self._resolve_device_step(), 0
        if self.promoting:
            self._land_promotions(wait=True)  # the device lane's next rows, a few ms away
            return [], 0
        if self.prefill is not None and self.prefill.busy:
            if self.in_flight is None:  # (as below: a lane the cost check held back steps now)
                self._start_host_step(self.scheduler.schedule_decode(BlockLocation.CPU))
            self.prefill.wait(self.in_flight[1] if self.in_flight else None)  # rows for either lane, taken in next
            return [], 0
        if self.in_flight is not None or self._start_host_step(self.scheduler.schedule_decode(BlockLocation.CPU)):
            # Nothing else to do until it is back. (A lane the cost check held back steps here too, once the device
            # lane has no rows left this step.)
            return self._take_host_step(wait=True)
        if not progressed:
            raise RuntimeError("the scheduler found no runnable work although requests are pending")
        return [], 0

    def _schedule_prefill(self) -> list[Sequence]:
        """The prompt chunks to run on this device now. With a prefill lane, its rows go there instead, one batch
        at a time (engine/disagg/prefill_lane.py), and the decode lanes step below while it computes."""
        if self.prefill is None:
            return self.scheduler.schedule_prefill()
        return [] if self.prefill.computing else self.prefill.submit(self.scheduler.schedule_prefill())

    def _resolve_device_step(self) -> list[Sequence]:
        """Reads the device-lane step in flight, if any, and records its tokens; returns the rows it finished.
        Its time is from the later of its launch and the previous step's read to now: back to back, one step's
        share of the pipeline."""
        if self.pending is None:
            return []
        step, self.pending = self.pending, None
        finished = self.scheduler.resolve(step.seqs, step.result(), step.positions)
        now = time.perf_counter()
        self.device_step_seconds = now - max(step.launched, self._resolved_at)
        self._resolved_at = now
        if step.quiet:  # KV copies would count as the step's time
            self.stats.device_step_done(len(step.seqs), self.device_step_seconds, step.host_busy)
        elif step.moved[0]:  # a move's cost: the engine thread's time, and how much longer this step took
            idle = self.stats.idle_device_step_seconds(len(step.seqs))
            slower = self.device_step_seconds - idle if idle is not None else 0.0
            self.stats.move_done(step.moved[0], step.moved[1] + max(0.0, slower))
        return finished

    def _demote(self, demoted: list[tuple[Sequence, list[int]]], first_blocks: list[int]) -> None:
        """Queues the demoted rows' copies before the step that reuses their device blocks. Where the copy runs
        beside the device lane (ModelRunner.demote), that step waits only for first_blocks' part, and the other
        old blocks stay out of use until the whole copy has landed."""
        pool = self.blocks.pool(BlockLocation.GPU)
        if self.runner.demotes_beside_device_lane:
            pool.hold_until(self.runner.demote(demoted, first_blocks))
        else:
            self.runner.demote(demoted)
            pool.hold_until(None)

    def _promote(self, moves: list[tuple[Sequence, list[int]]]) -> None:
        """Starts the promotions' copies, a group of at most PROMOTION_GROUP_BYTES of KV (or one sequence) at a
        time; where they run beside the device lane (ModelRunner.promote returns an event), each group's sequences
        sit out both lanes, in flight, until its copy has landed. Groups let the device lane take up the first
        rows while the rest still cross: when the device rows of a prompt-heavy batch end together, 20 promotions
        of 600 MB (8B) take ~0.27 s, during which it would otherwise have no row."""
        host_block_size = self.blocks.pool(BlockLocation.CPU).block_size
        block_bytes = host_block_size * self.stats.kv_bytes_per_token  # every layer's K and V
        for group in split_moves(moves, host_block_size, block_bytes, limit=PROMOTION_GROUP_BYTES):
            landed = self.runner.promote(group)
            if landed is not None:
                for seq, _ in group:
                    seq.in_flight = True
                self.promoting.append((landed, [seq for seq, _ in group]))

    def _land_promotions(self, wait: bool) -> None:
        """Lets the promoted sequences whose copies have landed (with wait: all of them, once they have) decode
        in the device lane."""
        pending = []
        for landed, rows in self.promoting:
            if wait:
                landed.synchronize()
            if wait or landed.query():
                for seq in rows:
                    seq.in_flight = False
            else:
                pending.append((landed, rows))
        self.promoting = pending

    def _start_host_step(self, batch: list[Sequence]) -> bool:
        if not batch:
            return False
        for seq in batch:
            seq.in_flight = True
        self.in_flight = (batch, self.host_lane.submit(self._host_step, batch))
        return True

    def _host_step(self, batch: list[Sequence]) -> list[int]:
        """One host-lane decode step, on the host lane's thread, timed for the cost check."""
        began = time.perf_counter()
        tokens = self.runner.decode_host(batch)
        self.host_step_seconds = time.perf_counter() - began
        self.stats.host_step(sum(map(len, batch)) * self.stats.kv_bytes_per_token, self.host_step_seconds,
                             self.runner.host_kernel_seconds["host"])
        return tokens

    def _take_host_step(self, wait: bool) -> tuple[list[Sequence], int]:
        """Postprocesses the host lane's step if it is back (or, with wait, once it is)."""
        if self.in_flight is None or not (wait or self.in_flight[1].done()):
            return [], 0
        batch, future = self.in_flight
        self.in_flight = None
        for seq in batch:
            seq.in_flight = False
        self.decoded_by_lane["host"] += len(batch)
        return self.scheduler.postprocess(batch, future.result()), len(batch)

    def abort(self) -> None:
        """Drops every request once generate() was interrupted (an error in either lane, a KeyboardInterrupt).
        generate() is synchronous, so they are the interrupted call's own. The host lane and the executor are
        let finish first: their kernels may still be reading or writing the pools. Then the queues and both
        pools' bookkeeping start afresh (cached prefixes included) rather than being undone request by request,
        because an interrupt can land anywhere in a step's bookkeeping."""
        if self.in_flight is not None:
            self.in_flight[1].exception()  # waits for it; its outcome no longer matters
            self.in_flight = None
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.runner.forget_device_step()
        self.runner.drain_host_work()  # promotions' copies included
        if self.prefill is not None:
            self.prefill.abort()  # its step and its copies write both pools
        self.promoting = []
        self.scheduler.reset()
        self.blocks.reset()

    def close(self) -> None:
        """Stops the host lane, then releases the runner's threads, graphs and pools. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.host_lane.shutdown(wait=True, cancel_futures=True)  # a host step in flight finishes first
            self.in_flight, self.promoting, self.pending = None, [], None
            if self.prefill is not None:
                self.prefill.close()  # before the decode pool goes: its copies write there
            self.runner.close()
        finally:
            gc_heap.unfreeze_at_close()
