"""Loads the model, sizes and binds both KV pools, and runs steps (docs/design.md, "The runner").

Under tensor parallelism each rank has a ModelRunner for its slice of the model (tp), driven by rank 0's engine. Pool
sizes are agreed across ranks (the smallest), so a block id means the same on every rank.
"""
import contextlib
import time

import torch

from gpu_kernels.host_block_copies import compile_host_block_copies
from offload_engine.config import EngineConfig, ModelConfig
from offload_engine.distributed import parallel_state
from offload_engine.distributed.parallel_state import Partition
from offload_engine.engine.graphs.graph_dispatch import GraphDispatcher, GraphMode
from offload_engine.engine.graphs.prefill_graphs import capture_prefill_graphs
from offload_engine.engine.runner.cuda_streams import engine_stream
from offload_engine.engine.runner.deferred_tokens import DeferredTokens
from offload_engine.engine.runner.host_tier import make_host_tier
from offload_engine.engine.runner.device_decode import DeviceLaneDecode
from offload_engine.engine.runner.memory_profile import (allocate_device_pool, layer_views, reserve_step_memory,
                                                         size_device_pool, stream_capacity_blocks)
from offload_engine.engine.runner.prefill_segment import run_segment, segment_capacity, segment_inputs
from offload_engine.engine.runner.step_inputs import StepInputBuilder
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.engine.tiers import tier_moves
from offload_engine.engine.tiers.executor_writes import ExecutorWrites
from offload_engine.engine.tiers.host_pool_accesses import HostPoolAccesses
from offload_engine.engine.tiers.move_staging import MoveStaging
from offload_engine.engine.tiers.pinned_ring import PinnedRing
from offload_engine.layers.attention_backends import select_backend
from offload_engine.layers.logits_processing import record_logprobs, record_prompt_logprobs, token_logprobs
from offload_engine.layers.sampler import SamplingBatch, sample
from offload_engine.loader import build_model


class ModelRunner:
    def __init__(self, model_dir: str, model_cfg: ModelConfig, cfg: EngineConfig, dtype: torch.dtype,
                 max_model_len: int, tp: Partition = Partition(), host_tier: tuple | None = None):
        """model_cfg: the whole model; tp: the slice this runner holds. Under tensor parallelism the caller runs
        this as the device lane (parallel_state.lane): start-up makes collectives. host_tier: another runner's
        (num_cpu_blocks, host_pool, executor), which this one writes too and never closes (the prefill lane)."""
        self.tp, self.whole_model_cfg, self.shared_host_tier = tp, model_cfg, host_tier
        self.cfg, self.model_cfg, self.dtype = cfg, tp.local_shape(model_cfg), dtype  # model_cfg: this rank's heads
        self.device, self.max_model_len = cfg.torch_device, max_model_len
        self.model = self.backend = self.device_pool = self.device_stacked = self.host_pool = self.executor = None
        self.num_gpu_blocks = self.num_cpu_blocks = 0
        self.segment_tokens = 0
        self.decode_graphs: dict = {}
        self.prefill_graphs = None
        self.paying_prefill_tokens = None
        self.dispatcher = GraphDispatcher(self.decode_graphs)
        self.inputs = self.host_inputs = None
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.executor_writes = ExecutorWrites()
        self.accesses = HostPoolAccesses()
        self.moves_stream = None
        self.prefill_writes_stream = None
        self.move_staging = MoveStaging(self.device)
        self.link_seconds_per_byte = None  # CUDA with a host tier: the pinned copy's, for LaneStats' move cost
        self.ring = None
        self.host_kernel_seconds = {"device": 0.0, "host": 0.0}  # of each lane's latest step (LaneStats)
        self.stream_capacity_blocks = 0  # host blocks a host step may stream per layer (0: streaming off)
        self.streamed_in_graph = False
        self.last_stream_seconds = None  # the latest host step's streamed copies, in device seconds (None: untimed)
        self.last_host_wait_seconds = 0.0  # the latest host step's kernels waiting for the device's layers (graphs)
        self.startup_seconds: dict[str, float] = {}
        try:
            # Start-up under this runner's GPU: capture's syncs and the allocator's cache follow the current device.
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                self._start(model_dir)
        except BaseException:
            self.close()  # a half-made runner releases what it had made (pinned memory, threads)
            raise

    def _start(self, model_dir: str) -> None:
        began = time.perf_counter()
        self.backend = select_backend(self.cfg.attention_backend, self.device, self.cfg.block_size, self.dtype,
                                      self.model_cfg.head_dim)
        # The host tier first: its numba compile and page-locking run on threads while the weights load.
        self.num_cpu_blocks, self.host_pool, self.executor = make_host_tier(self)
        if self.host_pool is not None and self.device.type == "cuda":
            self.ring = PinnedRing()
        self.model = build_model(self.whole_model_cfg, model_dir, self.dtype, self.device,
                                 max_position=self.max_model_len, tp=self.tp)
        self.inputs = StepInputBuilder(self.device, self.cfg.block_size, self.cfg.cpu_block_size, self.cfg.seed)
        self.host_inputs = StepInputBuilder(self.device, self.cfg.block_size, self.cfg.cpu_block_size,
                                            self.cfg.seed + 1)
        self.device_decode = DeviceLaneDecode(self.cfg.max_num_seqs, -(-self.max_model_len // self.cfg.block_size),
                                              self.cfg.block_size, self.device)
        self.startup_seconds["weights"] = time.perf_counter() - began
        self.stream_capacity_blocks = self.agreed(stream_capacity_blocks(self))
        self.num_gpu_blocks = self.agreed(size_device_pool(self))
        self.device_stacked = allocate_device_pool(self.model_cfg, self.num_gpu_blocks, self.cfg.block_size,
                                                   self.dtype, self.device)
        self.device_pool = layer_views(self.device_stacked)
        if self.host_pool is not None:
            # Before graph capture: page-locking from another thread would break a capture in progress.
            self.startup_seconds["pin"] = self.host_pool.wait_pinned()
        self.bind_kv_caches(self.device_pool, self.host_pool.layers if self.host_pool else None)
        self.decode_graphs = self._capture_decode_graphs()
        self.dispatcher.graphs = self.decode_graphs
        began = time.perf_counter()
        self.prefill_graphs = self.dispatcher.prefill_graphs = capture_prefill_graphs(self)
        self.startup_seconds["prefill_graphs"] = time.perf_counter() - began
        with torch.inference_mode():
            self.model.attention_layers()[0].compile_prefill(staged=self.ring is not None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.streams = {lane: engine_stream(self.device, lane) for lane in ("device", "host")}
            self.moves_stream = engine_stream(self.device, "moves")
            reserve_step_memory(self)
            if self.host_pool is not None:  # each rank's link moves its share of a token's KV
                self.link_seconds_per_byte = self.move_staging.link_seconds_per_byte() / self.tp.size
        if self.executor is not None:
            self.startup_seconds["numba_compile"] = self.executor.warmup()
        if self.host_pool is not None:
            self.segment_tokens = self.agreed(self.cfg.prefill_segment_tokens or segment_capacity(
                self.model_cfg, self.dtype, self.device, self.cfg.max_num_batched_tokens, self.max_model_len))
        self.startup_seconds["total"] = time.perf_counter() - began

    def agreed(self, value: int) -> int:
        return value if self.tp.size == 1 else parallel_state.smallest(value, self.device)

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.model_cfg.kv_bytes_per_token(self.dtype)

    def wanted_blocks(self, block_size: int) -> int:
        """Enough blocks for max_num_seqs sequences of max_model_len: more can never be used at once."""
        return self.cfg.max_num_seqs * -(-self.max_model_len // block_size)

    def bind_kv_caches(self, device_pool, host_pool) -> None:
        copy_stream = engine_stream(self.device, "prefill-writes") if self.ring is not None else None
        self.prefill_writes_stream = copy_stream
        # The host pool as the device addresses it, for host-tier prefill's whole-block writes.
        mapped = host_pool if host_pool and self.device.type != "cuda" else None
        stacked = self.host_pool.device_stacked(self.device.index) if host_pool and self.device.type == "cuda" \
            else None
        if stacked is not None:
            mapped = [tuple(layer) for layer in stacked]
            # Promotions read it and demotions write it with a Triton kernel: compiled now, not in a run's first move.
            compile_host_block_copies(stacked, self.device_stacked.flatten(2, 3))
        for builder in (self.inputs, self.host_inputs):
            if builder is not None:
                builder.direct_host_writes = mapped is not None
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = device_pool[i]
            layer.k_cache_cpu, layer.v_cache_cpu = host_pool[i] if host_pool else (None, None)
            layer.k_cache_mapped, layer.v_cache_mapped = mapped[i] if mapped else (None, None)
            layer.host_kv_mapped = stacked[i] if stacked is not None else None
            layer.backend, layer.executor, layer.ring = self.backend, self.executor, self.ring
            layer.copy_stream = copy_stream

    def _capture_decode_graphs(self) -> dict:
        """Decode graphs per lane: "device" and, with a host tier, "host" (HostStepGraphs); under tensor parallelism
        the same on every rank, each lane's collectives over its group (decisions/multi-gpu.md, "CUDA graphs")."""
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return {}
        from offload_engine.engine.graphs.cuda_graphs import DecodeGraphs

        # Whole-step graphs need a graph-safe backend: the torch path gathers every table column, which would not fit.
        cfg = self.model_cfg
        whole = bool(self.agreed(int(self.backend.decode_name != "torch")))
        graphs = {"device": DecodeGraphs(self.model, self.cfg.max_num_seqs, cfg.num_heads, cfg.head_dim, self.dtype,
                                         self.device, engine_stream(self.device, "capture-device"),
                                         inputs=self.device_decode.batch if whole else None)}
        if self.host_pool is not None:
            from offload_engine.engine.graphs.hardware_queues import warn_if_narrow
            from offload_engine.engine.graphs.host_step_graphs import HostStepGraphs

            warn_if_narrow()
            # Only engines where a sequence can outgrow the device pool (and be split) capture split-row graphs.
            splits = (self.cfg.kv_placement == "auto" and whole
                      and -(-self.max_model_len // self.cfg.block_size) > self.num_gpu_blocks)
            stream = engine_stream(self.device, "capture-host")
            with parallel_state.lane("host"):  # captured with the host lane's group, which its replays use
                graphs["host"] = HostStepGraphs(self.model, self.cfg.max_num_seqs, self.dtype, self.device,
                                                self.host_pool, self.executor, stream,
                                                device_blocks_per_seq=self.num_gpu_blocks if splits else None,
                                                stream_staging=self._stream_staging() if whole else None)
        return graphs

    def _stream_staging(self):
        """The host-step graphs' streamed share: static maps and double-buffered staging (None: streaming off)."""
        if not self.stream_capacity_blocks:
            return None
        from offload_engine.engine.graphs.cuda_graphs import batch_buckets
        from offload_engine.engine.graphs.stream_staging import StreamStaging

        width = min(self.stream_capacity_blocks, -(-self.max_model_len // self.cfg.cpu_block_size))
        return StreamStaging(self.model, batch_buckets(self.cfg.max_num_seqs)[-1], self.stream_capacity_blocks, width,
                             engine_stream(self.device, "host-kv-stream"))

    @property
    def host_step_holds_executor(self) -> bool:
        """True when a host-lane step holds the executor from its start to its end (one native loop)."""
        from offload_engine.engine.graphs.host_step_graphs import HostStepGraphs

        return isinstance(self.decode_graphs.get("host"), HostStepGraphs)

    @property
    def promotes_beside_host_steps(self) -> bool:
        """Whether a promotion can start while a host step is in flight: yes unless the step holds the executor
        and the promotion needs it (staged gathers where the pool is not mapped)."""
        if not self.host_step_holds_executor:
            return True
        return self.host_pool.device_stacked() is not None

    def host_writes_pending(self) -> bool:
        return self.executor_writes.pending()

    def close(self) -> None:
        """Releases everything the runner holds, in dependency order; safe on a half-made runner and twice.
        The host lane must be idle (LLMEngine.close stops it first)."""
        if self.executor is not None and self.shared_host_tier is None:
            self.executor.shutdown()  # after this no host kernel can touch the host pool
        self.executor = None
        self._release_graphs()
        self.move_staging.release()
        for builder in (self.inputs, self.host_inputs):
            if builder is not None:
                builder.release()
        self.inputs = self.host_inputs = None
        if self.ring is not None:
            self.ring.drain()
            self.ring = None
        if self.model is not None:
            self.bind_kv_caches([(None, None)] * self.model_cfg.num_layers, None)
        self.accesses.wait_writes()  # no device write may land in host memory once it is unpinned
        self.accesses.wait_promotion_reads()  # nor a device read take place there
        if self.host_pool is not None and self.shared_host_tier is None:
            self.host_pool.close()
        self.host_pool = self.shared_host_tier = None
        self.device_pool = self.device_stacked = self.model = None
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # for the next engine

    def _release_graphs(self) -> None:
        """Every lane's graphs and the prefill graphs, with their pools and static tensors. A method of its own so
        that no local of close() holds them when it empties the allocator's cache (docs/decisions/memory.md)."""
        for graphs in [*self.decode_graphs.values(), self.prefill_graphs]:
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.dispatcher.graphs = {}
        self.prefill_graphs = self.dispatcher.prefill_graphs = None

    def promote(self, moves: list[tuple[Sequence, list[int]]]):
        return tier_moves.promote(self, moves)

    @property
    def promotes_beside_device_lane(self) -> bool:
        return tier_moves.promotes_beside_device_lane(self)

    @property
    def demotes_beside_device_lane(self) -> bool:
        return tier_moves.demotes_beside_device_lane(self)

    def demote(self, moves: list[tuple[Sequence, list[int]]], first_blocks: list[int] | None = None):
        return tier_moves.demote(self, moves, first_blocks)

    def _record_prefill_writes(self) -> None:
        """After a prefill step with host-tier rows: marks where its direct writes into host blocks end."""
        if self.prefill_writes_stream is not None and self.inputs.direct_host_writes:
            self.accesses.record("prefill_writes", self.prefill_writes_stream)

    def upload(self, array):
        """A move's index list on the device, through the pinned ring (PinnedRing.upload says why)."""
        return self.ring.upload(array, self.device)

    def check_host_writes(self, wait: bool = False) -> None:
        """Raises the error of a host-pool write that failed on the executor; with wait, first lets all finish.
        Otherwise nothing waits for them: every later reader of those blocks runs on the executor after them."""
        if wait:
            self.accesses.wait_writes()
        self.executor_writes.check(wait)

    def drain_host_work(self) -> None:
        """Lets every host kernel and write queued so far finish, and forgets their outcomes (LLMEngine.abort)."""
        if self.executor is not None:
            self.executor.drain()
        self.accesses.wait_writes()
        self.accesses.wait_promotion_reads()
        self.executor_writes.forget()

    def lane_stream(self, lane: str):
        """The lane's own CUDA stream as a context: host-lane work queues beside the device lane's, not in front."""
        stream = self.streams.get(lane)
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # The lanes' decode steps run at once, from two threads: they share nothing a step writes.
    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """One prefill step (chunks of prompts, or one staged prompt's segment) -> each row's sampled id."""
        return self._step(seqs, is_prefill=True, lane="device")

    def decode_host(self, seqs: list[Sequence], streamed: list[int] | None = None) -> list[int]:
        """One host-lane decode step, run to its end on the calling thread -> each row's sampled id. streamed: per
        row, how many leading host blocks cross to the device to be attended there (StreamShare.blocks)."""
        return self._step(seqs, is_prefill=False, lane="host", streamed=streamed)

    def launch_device_decode(self, seqs: list[Sequence]) -> DeferredTokens:
        """One device-lane decode step, returned as soon as it is queued; its ids land on the host later."""
        return self._step(seqs, is_prefill=False, lane="device")

    def forget_device_step(self) -> None:
        """Drops the device lane's step in flight, whose ids the next step would have read (LLMEngine.abort)."""
        self.device_decode.forget()

    @torch.inference_mode()
    def _step(self, seqs: list[Sequence], is_prefill: bool, lane: str, streamed: list[int] | None = None):
        self.check_host_writes()
        if lane == "host":
            # The host step writes its new tokens into host blocks that a queued promotion may still read; the
            # other host writers (demotion, prefill) queue their copies behind the reads on the device (below).
            self.accesses.wait_promotion_reads()
        host_prefill = is_prefill and any(s.location == BlockLocation.CPU for s in seqs)
        if lane == "host" or host_prefill:
            # Host kernels and prefix staging read host blocks that demotions or a prefill may still be writing.
            self.accesses.wait_writes()
        with self.lane_stream(lane):
            if is_prefill:
                # Prefix hits may be device blocks a promotion still fills; host-tier writes, blocks one still reads.
                self.accesses.after_promotion_reads()
            if is_prefill and len(seqs) == 1 and seqs[0].num_scheduled_tokens > self.cfg.max_num_batched_tokens:
                logits = self._prefill_segment(seqs[0])  # Scheduler._take_chunk made it a segment
            elif not is_prefill and lane == "device":
                mode, batch = self.dispatcher.dispatch("device", len(seqs))
                settings = lambda rows, pending: self.inputs.sampling_settings(rows, self.model_cfg.vocab_size,
                                                                               pending)
                return self.device_decode.launch(seqs, self.model, self.decode_graphs.get("device"), mode,
                                                 batch.rows, settings)
            else:
                logits = self._forward(seqs, is_prefill, lane, streamed)
            if host_prefill:
                self._record_prefill_writes()
            sampled = sample(logits, self._sampling_batch(seqs, lane))
            tokens = sampled.tolist()  # the step has synced
            record_logprobs(seqs, [len(s) for s in seqs], tokens,
                            token_logprobs(logits, sampled, [s.params.logprobs for s in seqs]))
            if lane == "host":
                graphs = self.decode_graphs.get("host")
                self.last_stream_seconds = graphs.stream_seconds() if graphs is not None and self.streamed_in_graph \
                    else None
            return tokens

    def _sampling_batch(self, seqs: list[Sequence], lane: str) -> SamplingBatch:
        builder = self.inputs if lane == "device" else self.host_inputs
        return builder.sampling(seqs, self.model_cfg.vocab_size)

    def _forward(self, seqs: list[Sequence], is_prefill: bool, lane: str, streamed: list[int] | None = None
                 ) -> torch.Tensor:
        builder = self.inputs if lane == "device" else self.host_inputs
        step = builder.prefill(seqs) if is_prefill else builder.decode(seqs, streamed)
        if is_prefill:
            mode, batch = self.dispatcher.dispatch_prefill(step.token_ids.shape[0], step.meta)
        else:
            mode = self.dispatcher.dispatch(lane, len(seqs), step.meta)[0]
            self.streamed_in_graph = mode == GraphMode.PIECEWISE and step.meta.streamed is not None
            self.last_host_wait_seconds = 0.0
        if is_prefill and mode == GraphMode.FULL:
            hidden = self.prefill_graphs.run(batch.rows, step.token_ids, step.positions, step.meta,
                                             [s.num_scheduled_tokens for s in seqs], builder.to_device)
            logits = self.model.compute_logits(hidden[step.sample_rows])
            record_prompt_logprobs(seqs, hidden, self.model.compute_logits)
        elif mode == GraphMode.PIECEWISE:
            logits = self.decode_graphs[lane].run(step.token_ids, step.positions, step.meta)
            if lane == "host":
                self.last_host_wait_seconds = self.decode_graphs[lane].last_device_wait_seconds
        else:
            hidden = self.model(step.token_ids, step.positions, step.meta)
            logits = self.model.compute_logits(hidden[step.sample_rows])
            if is_prefill:
                record_prompt_logprobs(seqs, hidden, self.model.compute_logits)
        self.executor_writes.add(step.meta.pending_host_writes)  # host-tier prefill: not waited for
        self.host_kernel_seconds[lane] = sum(step.meta.host_kernel_seconds)  # every layer's kernel is back
        return logits

    def _prefill_segment(self, seq: Sequence) -> torch.Tensor:
        """A staged sequence's long prefill, layer-major in chunks of max_num_batched_tokens -> its last logits."""
        segment = segment_inputs(self.inputs, seq, self.cfg.max_num_batched_tokens)
        writes = []
        hidden = run_segment(self.model, segment, writes)
        self.executor_writes.add(writes)  # host-tier tokens' writes: not waited for
        return self.model.compute_logits(hidden)
