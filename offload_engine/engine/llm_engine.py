"""The step loop: take in what the lanes brought back, plan the step, carry the plan out, deciding nothing itself
(docs/design.md, "One engine step, two decode lanes"). A row in flight in a lane is left alone until it is back; the
device lane never waits for the host lane.
"""
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from offload_engine.config import EngineConfig, ModelConfig
from offload_engine.distributed import make_runner
from offload_engine.engine import gc_heap
from offload_engine.engine.disagg.prefill_lane import PrefillLane
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sched.placement import can_ever_fit
from offload_engine.engine.sched.plan import LaneState, Move, StepPlan, Wait
from offload_engine.engine.sched.scheduler import Scheduler
from offload_engine.engine.sched.stream_share import StreamShare
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.engine.tiers.move_staging import split_moves

# KV per promotion copy that lands on its own: the device lane takes up a group's rows while the rest still cross.
# docs/decisions/engine-step.md, "Promotion groups".
PROMOTION_GROUP_BYTES = 512 << 20


def promote_in_parts() -> bool:
    """Whether host rows take spare device room as split rows and are promoted in parts (Scheduler.promote_in_parts):
    on unless OFFLOAD_ENGINE_PROMOTE_IN_PARTS=0, the switch for A/B runs (docs/decisions/placement.md, "Promotion in
    parts")."""
    return os.environ.get("OFFLOAD_ENGINE_PROMOTE_IN_PARTS", "1") != "0"


@dataclass
class StepStats:
    is_prefill: bool
    num_tokens: int  # prompt tokens computed (prefill) or tokens generated (decode)
    seconds: float
    finished: list[Sequence]


class LLMEngine:
    def __init__(self, cfg: EngineConfig, max_model_len: int, runner, scheduler: Scheduler, stats: LaneStats,
                 host_lane=None, prefill: PrefillLane | None = None, clock=time.perf_counter,
                 stream: StreamShare | None = None):
        """An engine of parts that exist already (`load` makes them; the placement replay passes fakes for the
        runner, the host lane and the clock). runner: a ModelRunner, or under tensor parallelism rank 0's.
        stream: how much host KV a host step streams to the device (None: none)."""
        self.cfg, self.max_model_len = cfg, max_model_len
        self.stream = stream or StreamShare(0, cfg.cpu_block_size)
        self.runner, self.scheduler, self.blocks, self.stats = runner, scheduler, scheduler.blocks, stats
        self.host_lane = host_lane or ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-lane")
        self.prefill = prefill
        self.clock = clock
        self.closed, self.froze_heap = False, False
        self.in_flight: tuple[list[Sequence], Future] | None = None  # the host lane's decode step
        self.promoting: list[tuple[object, list[Sequence]]] = []  # promotions whose copies run: (event, rows)
        # The latest step times of each lane: how many device steps one host step spans (promotion look-ahead).
        self.host_step_seconds = self.device_step_seconds = 0.0
        self.pending = None  # async scheduling: the device-lane step queued last, whose tokens are not read yet
        self.resolved_at = 0.0  # when the device lane's latest step was read: steps in a row are timed from it
        self.decoded_by_lane = {"device": 0, "host": 0}  # tokens
        self.steps_by_lane = {"device": 0, "host": 0}  # decode steps
        self.host_streams = False  # the host step in flight streams a share of its KV

    @classmethod
    def load(cls, model_dir: str, model_cfg: ModelConfig, cfg: EngineConfig, dtype, max_model_len: int,
             eos_token_ids: tuple[int, ...]) -> "LLMEngine":
        """The engine for a model directory: runner, scheduler and, with `prefill_device`, the prefill lane. A failed
        start leaves no threads or pinned memory behind."""
        runner = make_runner(model_dir, model_cfg, cfg, dtype, max_model_len)
        try:
            blocks = BlockManager(runner.num_gpu_blocks, cfg.block_size, runner.num_cpu_blocks, cfg.cpu_block_size,
                                  cfg.enable_prefix_caching)
            stats = LaneStats(model_cfg.kv_bytes_per_token(dtype), runner.link_seconds_per_byte)
            stats.device_prefill_elsewhere = cfg.prefill_device is not None
            scheduler = Scheduler(blocks, cfg.kv_placement, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                  max_model_len, eos_token_ids, cfg.kv_promotion, stats,
                                  segment_tokens=runner.segment_tokens, promote_in_parts=promote_in_parts())
            prefill = PrefillLane.start(model_dir, model_cfg, cfg, dtype, max_model_len, runner, blocks) \
                if cfg.prefill_device is not None else None
        except BaseException:
            runner.close()
            raise
        engine = cls(cfg, max_model_len, runner, scheduler, stats, prefill=prefill,
                     stream=StreamShare(runner.stream_capacity_blocks, cfg.cpu_block_size))
        gc_heap.freeze_after_start_up()
        engine.froze_heap = True
        return engine

    def make_sequence(self, token_ids: list[int], params) -> Sequence:
        """A sequence for the request, or ValueError if no pool it may use could ever hold it."""
        budget = min(len(token_ids) + params.max_tokens, self.max_model_len)
        seq = Sequence(token_ids, params, budget)
        if not can_ever_fit(seq, self.cfg.kv_placement, self.blocks):
            auto = "" if self.cfg.kv_placement == "auto" else ", use kv_placement='auto'"
            raise ValueError(
                f"a request of {len(token_ids)} prompt + {params.max_tokens} new tokens needs more KV blocks than "
                f"kv_placement={self.cfg.kv_placement!r} has (device pool: {self.runner.num_gpu_blocks} blocks of "
                f"{self.cfg.block_size}, host pool: {self.runner.num_cpu_blocks} blocks of {self.cfg.cpu_block_size}): "
                f"raise num_gpu_blocks / num_cpu_blocks{auto}, or lower max_tokens")
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
        """One engine step: take in what came back, plan, and carry the plan out in StepPlan's order."""
        start = self.clock()
        finished, num_tokens = self._take_host_step(wait=False)
        self._land_promotions(wait=False)
        more, prefilled, prefill_seconds = self.prefill.take(self.scheduler) if self.prefill else ([], 0, 0.0)
        finished += more
        plan = self.scheduler.plan(self._lane_state())
        move_seconds = self._promote(plan.promotions)
        if self.prefill is not None and (plan.prefill or plan.prefill_elsewhere):
            self.prefill.submit(list(plan.prefill_elsewhere), decode_device_prefills=plan.is_prefill)
        if plan.is_prefill:
            return self._prefill_step(list(plan.prefill), finished, start)
        self._start_host_step(plan.host_rows, len(plan.device_rows))
        move_seconds += self._demote(plan)
        moved = (plan.moved_tokens, move_seconds)
        if plan.device_rows:
            copying = bool(plan.promotions or plan.demotions)
            finished += self._device_decode_step(list(plan.device_rows), moved, copying)
            num_tokens += len(plan.device_rows)
        else:
            if moved[0]:
                self.stats.move_done(*moved)  # no device step to slow down
            more, count = self._wait(plan, progressed=bool(num_tokens))
            finished, num_tokens = finished + more, num_tokens + count
        if prefilled and not num_tokens:  # a step that decoded nothing reports the prefill it took in
            return StepStats(True, prefilled, prefill_seconds, finished)
        return StepStats(False, num_tokens, self.clock() - start, finished)

    def _lane_state(self) -> LaneState:
        runner = self.runner
        host_busy = self.in_flight is not None
        # Where a whole-step host loop holds the executor and a promotion needs it, promotions wait for the host step.
        may_promote = not host_busy or (runner.promotes_beside_host_steps and not runner.host_writes_pending())
        horizon = self.host_step_seconds / max(self.device_step_seconds, 1e-4) + 1
        return LaneState(
            host_step_in_flight=host_busy, device_step_in_flight=self.pending is not None,
            promotions_landing=bool(self.promoting), may_promote=may_promote,
            promotions_sit_out=runner.promotes_beside_device_lane,
            hold_back_horizon=horizon if runner.promotes_beside_host_steps else None,
            prefill_lane=self.prefill is not None,
            prefill_lane_computing=self.prefill is not None and self.prefill.computing,
            prefill_lane_busy=self.prefill is not None and self.prefill.busy)

    def _prefill_step(self, batch: list[Sequence], finished: list[Sequence], start: float) -> StepStats:
        """Runs one prefill step on this device, after reading the device-lane step in flight. Promotions started
        just before go unrecorded: the prefill's time would swamp what they cost."""
        finished += self._resolve_device_step()
        began = self.clock()
        num_tokens = sum(s.num_scheduled_tokens for s in batch)
        host_tokens = sum(s.num_scheduled_tokens for s in batch if s.location == BlockLocation.CPU)
        sampled = self.runner.prefill(batch)
        self.stats.prefill_done(num_tokens, host_tokens, self.clock() - began)
        finished += self.scheduler.postprocess(batch, sampled)
        return StepStats(True, num_tokens, self.clock() - start, finished)

    def _device_decode_step(self, batch: list[Sequence], moved: tuple[int, float], copying: bool) -> list[Sequence]:
        """Queues a device-lane decode step, then reads the one before it (without async scheduling, this one too);
        returns the rows finished. `moved`: this step's moves' tokens and engine-thread seconds."""
        launched = self.runner.launch_device_decode(batch)
        self.scheduler.launched(launched.seqs)
        copying = copying or bool(self.promoting) or (self.prefill is not None and self.prefill.landing)
        launched.host_busy, launched.quiet, launched.moved = self.in_flight is not None, not copying, moved
        launched.host_streams = self.in_flight is not None and self.host_streams
        finished = self._resolve_device_step()
        self.pending = launched
        if not self.cfg.async_scheduling:
            finished += self._resolve_device_step()
        self.decoded_by_lane["device"] += len(batch)
        self.steps_by_lane["device"] += 1
        return finished

    def _wait(self, plan: StepPlan, progressed: bool) -> tuple[list[Sequence], int]:
        """Waits for what the plan says comes next -> (rows finished, tokens decoded). `progressed`: this step has
        decoded tokens already; if not, and there is nothing to wait for, the scheduler is stuck."""
        self._start_host_step(plan.idle_host_rows)
        if plan.wait == Wait.DEVICE_STEP:
            return self._resolve_device_step(), 0
        if plan.wait == Wait.PROMOTIONS:
            self._land_promotions(wait=True)  # the device lane's next rows, a few ms away
            return [], 0
        if plan.wait == Wait.PREFILL_LANE:
            self.prefill.wait(self.in_flight[1] if self.in_flight else None)  # rows for either lane, taken in next
            return [], 0
        if plan.wait == Wait.HOST_STEP:
            return self._take_host_step(wait=True)
        if not progressed:
            raise RuntimeError("the scheduler found no runnable work although requests are pending")
        return [], 0

    def _resolve_device_step(self) -> list[Sequence]:
        """Reads the device-lane step in flight, if any; returns the rows it finished. Its time runs from the later
        of its launch and the previous step's read: back to back, one step's share of the pipeline."""
        if self.pending is None:
            return []
        step, self.pending = self.pending, None
        finished = self.scheduler.resolve(step.seqs, step.result(), step.positions)
        now = self.clock()
        self.device_step_seconds = now - max(step.launched, self.resolved_at)
        self.resolved_at = now
        if step.quiet:  # KV copies would count as the step's time
            self.stats.device_step_done(len(step.seqs), self.device_step_seconds, step.host_busy, step.host_streams)
        elif step.moved[0]:  # a move's cost: the engine thread's time, and how much longer this step took
            idle = self.stats.idle_device_step_seconds(len(step.seqs))
            slower = self.device_step_seconds - idle if idle is not None else 0.0
            self.stats.move_done(step.moved[0], step.moved[1] + max(0.0, slower))
        return finished

    def _demote(self, plan: StepPlan) -> float:
        """Queues the demoted rows' copies before the step that reuses their device blocks; returns the engine
        thread's seconds. The old blocks other than the first freed stay held until the copy has landed."""
        if not plan.demotions:
            return 0.0
        began, pool = self.clock(), self.blocks.pool(BlockLocation.GPU)
        if self.runner.demotes_beside_device_lane:
            pool.hold_until(self.runner.demote(list(plan.demotions), list(plan.first_freed_blocks)))
        else:
            self.runner.demote(list(plan.demotions))
            pool.hold_until(None)
        return self.clock() - began

    def _promote(self, moves: tuple[Move, ...]) -> float:
        """Starts the promotions' copies, in groups of at most PROMOTION_GROUP_BYTES (or one sequence); returns the
        engine thread's seconds. A group's rows stay in flight until its copy lands (_land_promotions)."""
        if not moves:
            return 0.0
        began = self.clock()
        host_block_size = self.blocks.pool(BlockLocation.CPU).block_size
        block_bytes = host_block_size * self.stats.kv_bytes_per_token  # every layer's K and V
        for group in split_moves(list(moves), host_block_size, block_bytes, limit=PROMOTION_GROUP_BYTES):
            landed, rows = self.runner.promote(group), [seq for seq, _ in group]
            if landed is None:
                for seq in rows:
                    seq.in_flight = False
            else:
                self.promoting.append((landed, rows))
        return self.clock() - began

    def _land_promotions(self, wait: bool) -> None:
        """Frees for the device lane the promoted rows whose copies have landed (with wait: all, once they have)."""
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

    def _start_host_step(self, rows, device_rows: int = 0) -> None:
        """Starts a host step of `rows` beside `device_rows` device rows, streaming the share that pays."""
        if not rows:
            return
        batch = list(rows)
        for seq in batch:
            seq.in_flight = True
        streamed = self.stream.blocks(batch, self.stream.share(self.stats, batch, device_rows))
        self.host_streams = any(streamed)
        self.in_flight = (batch, self.host_lane.submit(self._host_step, batch, streamed))

    def _host_step(self, batch: list[Sequence], streamed: list[int]) -> list[int]:
        """One host-lane decode step, on the host lane's thread, timed for the cost check: its rows' host KV read
        by the CPU kernel, and `streamed` of each row's blocks streamed to the device (docs/design.md, "Streaming
        host KV")."""
        began = self.clock()
        tokens = self.runner.decode_host(batch, streamed) if any(streamed) else self.runner.decode_host(batch)
        self.host_step_seconds = self.clock() - began
        kernel_seconds = self.runner.host_kernel_seconds["host"]
        self.stats.host_step(sum(map(len, batch)) * self.stats.kv_bytes_per_token, self.host_step_seconds,
                             kernel_seconds, self.runner.last_host_wait_seconds)
        self._count_host_reads(batch, streamed, kernel_seconds)
        return tokens

    def _count_host_reads(self, batch: list[Sequence], streamed: list[int], kernel_seconds: float) -> None:
        """Each path's bytes and seconds to LaneStats, which sets the next step's share from them. The rows' lengths
        are as the step ran: they take their new tokens only on the engine's thread."""
        per_token, block = self.stats.kv_bytes_per_token or 0, self.stream.block_size
        streamed_tokens = sum(streamed) * block
        kernel_tokens = sum(seq.num_host_tokens for seq in batch) - streamed_tokens
        stream_seconds = self.runner.last_stream_seconds if any(streamed) else None
        self.stats.host_reads(kernel_tokens * per_token, kernel_seconds, streamed_tokens * per_token, stream_seconds)

    def _take_host_step(self, wait: bool) -> tuple[list[Sequence], int]:
        """Postprocesses the host lane's step if it is back (or, with wait, once it is)."""
        if self.in_flight is None or not (wait or self.in_flight[1].done()):
            return [], 0
        batch, future = self.in_flight
        self.in_flight = None
        for seq in batch:
            seq.in_flight = False
        self.decoded_by_lane["host"] += len(batch)
        self.steps_by_lane["host"] += 1
        return self.scheduler.postprocess(batch, future.result()), len(batch)

    def abort(self) -> None:
        """Drops every request once generate() was interrupted, after what is in flight has finished; the queues and
        both pools' bookkeeping start afresh, as an interrupt can land anywhere in a step's bookkeeping."""
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
            if self.froze_heap:
                gc_heap.unfreeze_at_close()
