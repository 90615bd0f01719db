"""The prefill lane (docs/design.md, "More than one GPU"): prompt chunks of unsplit rows run on `prefill_device`,
one batch at a time on a thread of their own, in an eager ModelRunner whose device pool mirrors the decode runner's
and which writes the decode runner's host pool (and shares its executor). Its rows stay in flight until back. A
device-tier row's final chunk is taken in only once its KV has landed on the decode device, which reads it next and
may hand out none of its blocks while a copy into them runs; a host-tier row's every chunk, once its host writes have.
"""
import contextlib
import dataclasses
import itertools
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from offload_engine.engine.disagg.kv_handoff import KVHandoff
from offload_engine.engine.runner.model_runner import ModelRunner
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence


@dataclass
class _Chunks:
    """Rows of a lane step, each with the blocks its chunk writes (what crosses to the decode device), their sampled
    ids once back, and the event of their KV's landing."""

    rows: list[Sequence]
    blocks: list[list[int]]  # device blocks; none for a host-tier row
    tokens: list[int] = dataclasses.field(default_factory=list)
    landed: object = None
    host_writes: list[Future] = dataclasses.field(default_factory=list)  # on the executor
    host_landed: object = None  # the event of the lane device's direct writes into host blocks


class PrefillLane:
    def __init__(self, runner: ModelRunner, decode_runner: ModelRunner, blocks: BlockManager):
        self.runner, self.decode_runner, self.blocks = runner, decode_runner, blocks
        self.handoff = KVHandoff(runner, decode_runner)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-lane")
        self.step: tuple[_Chunks, Future] | None = None  # the batch computing on the lane
        self.landing: list[_Chunks] = []  # final chunks whose KV is crossing, oldest first
        self.num_steps = self.num_prompt_tokens = 0

    @classmethod
    def start(cls, model_dir: str, model_cfg, cfg, dtype, max_model_len: int, decode_runner: ModelRunner,
              blocks: BlockManager) -> "PrefillLane":
        """The lane for `decode_runner`'s engine: a runner whose device pool mirrors that runner's, eager, writing
        that runner's host pool where it has one, its sampling generator seeded apart from the decode runner's two."""
        lane_cfg = dataclasses.replace(
            cfg, device=cfg.prefill_device, prefill_device=None, kv_placement="gpu", kv_promotion=False,
            num_gpu_blocks=decode_runner.num_gpu_blocks, num_cpu_blocks=None, cpu_kv_cache_gb=None,
            enforce_eager=True, stream_host_kv=False, seed=cfg.seed + 2)
        device = torch.device(cfg.prefill_device)
        host_tier = (decode_runner.num_cpu_blocks, decode_runner.host_pool, decode_runner.executor) \
            if decode_runner.host_pool is not None else None
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                runner = ModelRunner(model_dir, model_cfg, lane_cfg, dtype, max_model_len, host_tier=host_tier)
        except torch.OutOfMemoryError as error:
            raise ValueError(
                f"prefill_device={cfg.prefill_device!r} has no room for a copy of the model and a KV pool mirroring "
                f"the decode device's {decode_runner.num_gpu_blocks} blocks: free that GPU, or lower num_gpu_blocks "
                f"or gpu_memory_utilization ({error})") from error
        try:
            return cls(runner, decode_runner, blocks)
        except BaseException:
            runner.close()
            raise

    @property
    def computing(self) -> bool:
        """A batch is on the lane: the engine schedules no other prefill until it is back."""
        return self.step is not None

    @property
    def busy(self) -> bool:
        return self.step is not None or bool(self.landing)

    def submit(self, rows: list[Sequence], decode_device_prefills: bool) -> None:
        """Starts prompt chunks on the lane (the plan's prefill_elsewhere, already in flight; `take` brings them back).
        decode_device_prefills: this step also prefills on the decode device, behind the KV sent so far."""
        if decode_device_prefills:
            self.handoff.order_decode_prefill()
        if not rows:
            return
        pool = self.blocks.pool(BlockLocation.GPU)
        marks = self.handoff.decode_marks()
        on_device = [seq.location == BlockLocation.GPU for seq in rows]
        chunks = _Chunks(rows, [_chunk_blocks(seq, pool.block_size) if gpu else [] for seq, gpu in zip(rows, on_device)])
        for seq in itertools.compress(rows, on_device):
            # Its registered blocks before the chunk: prefix hits (first chunk), or its own earlier chunks' blocks,
            # which the mirror holds already.
            self.handoff.fill(seq.block_table[: seq.num_hashed_blocks], pool, marks)
        written = [block for blocks in chunks.blocks for block in blocks]
        self.handoff.forget(written)
        # Host-tier rows read prefix blocks the decode device may still write, and write blocks it may still read
        # (a promotion's source, freed when planned): the lane waits for the accesses queued so far.
        host_marks = self.decode_runner.accesses.marks() if not all(on_device) else []
        self.step = (chunks, self.thread.submit(self._run, chunks, written, marks, host_marks))
        self.num_steps += 1
        self.num_prompt_tokens += sum(seq.num_scheduled_tokens for seq in rows)

    def _run(self, chunks: _Chunks, written: list[int], marks: list, host_marks: list) -> float:
        began = time.perf_counter()
        for event in host_marks:
            event.synchronize()
        with self.handoff.on_prefill_device():
            chunks.tokens = self.runner.prefill(chunks.rows)
            chunks.landed = self.handoff.send(written, marks) if written else None
        if any(seq.location == BlockLocation.CPU for seq in chunks.rows):
            chunks.host_writes = self.runner.executor_writes.take()
            chunks.host_landed = self.runner.accesses.prefill_writes
        return time.perf_counter() - began

    def take(self, scheduler) -> tuple[list[Sequence], int, float]:
        """Takes in what the lane has back -> (sequences finished, prompt tokens and seconds of the step taken in,
        0 if none). None of its rows are in the device lane's step in flight, so that step is not read first."""
        finished, num_tokens, seconds = [], 0, 0.0
        if self.step is not None and self.step[1].done():
            (chunks, result), self.step = self.step, None
            seconds = result.result()  # raises the lane's error here, on the engine's thread
            num_tokens = sum(seq.num_scheduled_tokens for seq in chunks.rows)
            # A host-tier row's blocks are registered (and may be hit) when taken in: only once written.
            lands = [_leaves_prefill(seq) or seq.location == BlockLocation.CPU for seq in chunks.rows]
            finished += self._take_in(_pick(chunks, [not f for f in lands]), scheduler)
            if any(lands):
                self.landing.append(_pick(chunks, lands, host_writes=True))
        while self.landing and self._landed(self.landing[0]):
            finished += self._take_in(self.landing.pop(0), scheduler)
        return finished, num_tokens, seconds

    def _landed(self, chunks: _Chunks) -> bool:
        return (self.handoff.landed(chunks.landed) and self.handoff.landed(chunks.host_landed)
                and all(write.done() for write in chunks.host_writes))

    def _take_in(self, chunks: _Chunks, scheduler) -> list[Sequence]:
        for write in chunks.host_writes:
            write.result()  # a host write that failed raises here, on the engine's thread
        for seq in chunks.rows:
            seq.in_flight = False
        finished = scheduler.postprocess(chunks.rows, chunks.tokens)
        self.handoff.remember([b for blocks in chunks.blocks for b in blocks], self.blocks.pool(BlockLocation.GPU))
        return finished

    def wait(self, other: Future | None = None) -> None:
        """Blocks until the lane has something to take in, or `other` (the host lane's step) is back."""
        if self.step is not None:
            wait([f for f in (self.step[1], other) if f is not None], return_when=FIRST_COMPLETED)
        elif self.landing:
            landing = self.landing[0]
            for event in (landing.landed, landing.host_landed):
                self.handoff.wait(event)
            wait(landing.host_writes)

    def abort(self) -> None:
        """Lets the step in flight and every copy finish, and forgets them (LLMEngine.abort resets the pools)."""
        if self.step is not None:
            self.step[1].exception()  # waits for it; its outcome no longer matters
        self.handoff.drain()
        self.runner.drain_host_work()  # its writes into the host pool
        self.step, self.landing = None, []
        self.handoff.mirrored.clear()

    def close(self) -> None:
        """Stops the lane's thread (a step in flight finishes first), waits for the copies, closes the runner."""
        self.thread.shutdown(wait=True, cancel_futures=True)
        self.handoff.close()
        self.step, self.landing = None, []
        self.runner.close()


def _chunk_blocks(seq: Sequence, block_size: int) -> list[int]:
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
    return seq.block_table[start // block_size : -(-end // block_size)]


def _leaves_prefill(seq: Sequence) -> bool:
    """Whether seq decodes after its scheduled chunk: with its whole prompt computed, or all but the newest token,
    which the next decode step computes (Sequence.in_prefill). Either way the decode device reads its KV next."""
    return len(seq) - (seq.num_computed_tokens + seq.num_scheduled_tokens) <= 1


def _pick(chunks: _Chunks, keep: list[bool], host_writes: bool = False) -> _Chunks:
    """The kept rows of chunks; with host_writes, the step's host writes go with them (the rows that wait for them)."""
    pick = lambda items: [item for item, k in zip(items, keep) if k]
    writes = (chunks.host_writes, chunks.host_landed) if host_writes else ([], None)
    return _Chunks(pick(chunks.rows), pick(chunks.blocks), pick(chunks.tokens), chunks.landed, *writes)
