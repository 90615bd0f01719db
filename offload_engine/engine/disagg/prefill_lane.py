"""The prefill lane: prompt chunks run on `prefill_device`, on a thread of their own, while the engine's thread goes
on stepping both decode lanes on the decode device (prefill/decode separation, DESIGN.md "More than one GPU").
Decode steps never wait for a prefill: a prompt's chunks, its first token and its KV's one crossing
(engine/disagg/kv_handoff.py) all happen beside them, and the sequence joins the device lane once its KV has landed, as
a promoted one does once its copy has.

The lane's runner is a ModelRunner of its own on the prefill device: a second copy of the weights and a device pool
that mirrors the decode runner's block for block (kv_handoff.py says why), without a host tier or decode graphs.
It samples a prompt's first token with the same sampler and per-request keys (layers/sampler.py: a seeded
request's key comes from its seed and the token's position), so greedy and seeded outputs are those of the engine
without PD; unseeded sampled rows draw from the lane's own generator.

What runs here, and when:
- Device-tier rows that are not split. Host-tier and split rows (placement.py) prefill on the decode device as
  without PD: their KV goes to the host pool, which only the decode runner writes (through the executor the host
  lane holds for its steps), and they attend through the decode device's staging cache.
- One batch at a time. While it computes nothing else is scheduled to prefill (new requests wait, as they wait
  behind a prefill step without PD), and the engine's thread steps the decode lanes. Every row of the batch sits
  out (in flight) until the step is back.
- A chunk that leaves more of its prompt is taken in as soon as its step is back, so the next chunk can be
  scheduled while this one's KV crosses. A prompt's final chunk (the one after which it decodes: its last, or
  the last but the newest token, Sequence.in_prefill) is taken in (its first token recorded, its sequence free
  to decode, finish or be preempted) only once its KV has landed: the decode device reads it next, and no block
  it holds is handed out again while a copy into it may still run. The next batch does not wait for that.
- Rows here are never demoted, promoted or preempted: the scheduler leaves rows in prefill or in flight alone.
  Rows elsewhere are, freely: a block they free is handed to a prompt here only with the decode device's work
  queued so far ahead of the copy into it (KVHandoff.decode_marks). Nor does taking a lane step in read the
  device lane's step in flight (async scheduling), as a prefill on the decode device does: none of its rows are
  in that step, and none of that step's rows are touched.
"""
import contextlib
import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.disagg.kv_handoff import KVHandoff
from offload_engine.engine.runner.model_runner import ModelRunner
from offload_engine.engine.sequence import BlockLocation, Sequence


@dataclass
class _Chunks:
    """Rows of a lane step, each with the blocks its chunk writes (what crosses to the decode device), their sampled
    ids once back, and the event of their KV's landing."""

    rows: list[Sequence]
    blocks: list[list[int]]
    tokens: list[int] = dataclasses.field(default_factory=list)
    landed: object = None


class PrefillLane:
    def __init__(self, runner: ModelRunner, decode_runner: ModelRunner, blocks: BlockManager):
        self.runner, self.blocks = runner, blocks
        self.handoff = KVHandoff(runner, decode_runner)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-lane")
        self.step: tuple[_Chunks, Future] | None = None  # the batch computing on the lane
        self.landing: list[_Chunks] = []  # final chunks whose KV is crossing, oldest first
        self.num_steps = self.num_prompt_tokens = 0

    @classmethod
    def start(cls, model_dir: str, model_cfg, cfg, dtype, max_model_len: int, decode_runner: ModelRunner,
              blocks: BlockManager) -> "PrefillLane":
        """The lane for an engine whose decode runner is `decode_runner`: the prefill runner's pool mirrors its
        device pool; eager (prefill steps replay no graphs), device tier only; its sampling generator is seeded
        apart from the decode runner's two."""
        lane_cfg = dataclasses.replace(
            cfg, device=cfg.prefill_device, prefill_device=None, kv_placement="gpu", kv_promotion=False,
            num_gpu_blocks=decode_runner.num_gpu_blocks, num_cpu_blocks=None, cpu_kv_cache_gb=None,
            enforce_eager=True, seed=cfg.seed + 2)
        device = torch.device(cfg.prefill_device)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                runner = ModelRunner(model_dir, model_cfg, lane_cfg, dtype, max_model_len)
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
        """Starts prompt chunks on the lane (the plan's prefill_elsewhere). decode_device_prefills: this step also
        prefills rows on the decode device, which queue there behind the KV sent so far (a split row's device part
        may hit it)."""
        if decode_device_prefills:
            self.handoff.order_decode_prefill()
        if not rows:
            return
        pool = self.blocks.pool(BlockLocation.GPU)
        marks = self.handoff.decode_marks()
        chunks = _Chunks(rows, [_chunk_blocks(seq, pool.block_size) for seq in rows])
        for seq in rows:
            # Its registered blocks before the chunk: prefix hits (first chunk), or its own earlier chunks' blocks,
            # which the mirror holds already.
            self.handoff.fill(seq.block_table[: seq.num_hashed_blocks], pool, marks)
            seq.in_flight = True
        written = [block for blocks in chunks.blocks for block in blocks]
        self.handoff.forget(written)
        self.step = (chunks, self.thread.submit(self._run, chunks, written, marks))
        self.num_steps += 1
        self.num_prompt_tokens += sum(seq.num_scheduled_tokens for seq in rows)

    def _run(self, chunks: _Chunks, written: list[int], marks: list) -> float:
        """One lane step, on the lane's thread: the chunks, then their KV's send. Returns its seconds."""
        began = time.perf_counter()
        with self.handoff.on_prefill_device():
            chunks.tokens = self.runner.prefill(chunks.rows)
            chunks.landed = self.handoff.send(written, marks)
        return time.perf_counter() - began

    def take(self, scheduler) -> tuple[list[Sequence], int, float]:
        """Takes in what the lane has back: the step's non-final chunks once it is, its final ones once their KV
        has landed (module docstring). Returns the sequences that finished, and the prompt tokens and seconds of
        the step taken in (0 if none)."""
        finished, num_tokens, seconds = [], 0, 0.0
        if self.step is not None and self.step[1].done():
            (chunks, result), self.step = self.step, None
            seconds = result.result()  # raises the lane's error here, on the engine's thread
            num_tokens = sum(seq.num_scheduled_tokens for seq in chunks.rows)
            final = [_leaves_prefill(seq) for seq in chunks.rows]
            finished += self._take_in(_pick(chunks, [not f for f in final]), scheduler)
            if any(final):
                self.landing.append(_pick(chunks, final))
        while self.landing and self.handoff.landed(self.landing[0].landed):
            finished += self._take_in(self.landing.pop(0), scheduler)
        return finished, num_tokens, seconds

    def _take_in(self, chunks: _Chunks, scheduler) -> list[Sequence]:
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
            self.handoff.wait(self.landing[0].landed)

    def abort(self) -> None:
        """Lets the step in flight and every copy finish, and forgets them (LLMEngine.abort resets the pools)."""
        if self.step is not None:
            self.step[1].exception()  # waits for it; its outcome no longer matters
        self.handoff.drain()
        self.step, self.landing = None, []
        self.handoff.mirrored.clear()

    def close(self) -> None:
        """Stops the lane's thread (a step in flight finishes first), waits for the copies, and releases the
        prefill runner: its weights, its pool and its memory on the prefill device."""
        self.thread.shutdown(wait=True, cancel_futures=True)
        self.handoff.close()
        self.step, self.landing = None, []
        self.runner.close()


def _chunk_blocks(seq: Sequence, block_size: int) -> list[int]:
    """The blocks seq's scheduled chunk writes into."""
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
    return seq.block_table[start // block_size : -(-end // block_size)]


def _leaves_prefill(seq: Sequence) -> bool:
    """Whether seq decodes after its scheduled chunk: with its whole prompt computed, or all but the newest token,
    which the next decode step computes (Sequence.in_prefill). Either way the decode device reads its KV next."""
    return len(seq) - (seq.num_computed_tokens + seq.num_scheduled_tokens) <= 1


def _pick(chunks: _Chunks, keep: list[bool]) -> _Chunks:
    pick = lambda items: [item for item, k in zip(items, keep) if k]
    return _Chunks(pick(chunks.rows), pick(chunks.blocks), pick(chunks.tokens), chunks.landed)
