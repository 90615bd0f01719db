"""Whole-step CUDA graphs for the host lane: the device and the host kernel hand each layer over through gates, so a
step takes the GIL twice, not several times a layer (docs/design.md, "CUDA graphs"; why:
docs/decisions/lane-interference.md). Where rows can be split or host KV streamed, a second graph per size also attends
on the device between the gates: over split rows' device parts and over the streamed share (stream_staging.py), merged
with the host kernel's partial by log-sum-exp. Padding rows compute on stale inputs that nothing reads.
"""
import contextlib

import torch

from cpu_attention.layer_loop import LayerLoop, check_step
from offload_engine.engine.graphs.cuda_graphs import batch_buckets
from offload_engine.engine.graphs.stream_gates import open_gate, wait_gate
from offload_engine.engine.graphs.stream_staging import StreamStaging

STEP_TIMEOUT_S = 600.0  # a step that long has lost its device: give up on it rather than hang
SM_SHARE = 8  # products on 1/SM_SHARE of the SMs, 16 of an H100's 132


@contextlib.contextmanager
def few_sms(device: torch.device):
    """Matrix products made inside (and so captured into a graph) target 1/SM_SHARE of the device's SMs:
    cuBLASLt's SM-count target, which torch sets from its SM carveout. Both settings are global, and restored."""
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    library, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout applies to cuBLASLt's products only
    torch._C._set_sm_carveout_experimental(sms - max(1, sms // SM_SHARE))
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(library)


class HostStepGraphs:
    def __init__(self, model, max_num_seqs: int, dtype: torch.dtype, device: torch.device, host_pool, executor,
                 capture_stream: torch.cuda.Stream, device_blocks_per_seq: int | None = None,
                 stream_staging: "StreamStaging | None" = None):
        self.model, self.executor, self.pools = model, executor, host_pool.stacked
        inner = model.model
        attn = model.attention_layers()[0]
        self.num_layers, self.scale = len(inner.layers), attn.scale
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.buckets = batch_buckets(max_num_seqs)
        largest, layers = self.buckets[-1], self.num_layers
        self.token_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(largest, heads, head_dim, dtype=dtype, device=device)
        self.out_device = torch.zeros(largest, heads, head_dim, dtype=torch.float32, device=device)
        # What crosses to the host and back, for every layer at once: the graph's copies have fixed addresses.
        pinned = lambda shape, dt: torch.zeros(shape, dtype=dt).pin_memory()
        self.q_host = pinned((layers, largest, heads, head_dim), dtype)
        self.k_host = pinned((layers, largest, kv_heads, head_dim), dtype)
        self.v_host = pinned((layers, largest, kv_heads, head_dim), dtype)
        self.out_host = pinned((layers, largest, heads, head_dim), torch.float32)  # rounded on the device
        self.lse_host = pinned((layers, largest, heads), torch.float32)
        self.gates = pinned((2, layers), torch.int32)
        self.device_lens = self.device_tables = None
        if device_blocks_per_seq is not None:  # split rows' device parts: maps in static buffers
            self.device_lens = torch.zeros(largest, dtype=torch.int32, device=device)
            self.device_tables = torch.full((largest, device_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.lse_device = torch.zeros(largest, heads, dtype=torch.float32, device=device)
        self.stream = stream_staging
        self.gates_np = self.gates.numpy()
        self.capture_stream, self.pool = capture_stream, None
        self.last_device_wait_seconds = 0.0
        self.whole: dict[tuple[int, bool], tuple] = {}  # (size, with the device's partials) -> graph, logits
        for size in reversed(self.buckets):  # largest first, so smaller buckets fit in its pool
            self._capture(size, device_part=False)
            if self.device_tables is not None or self.stream is not None:
                self._capture(size, device_part=True)

    def _step(self, size: int, gated: bool, device_part: bool) -> torch.Tensor:
        """The step's device work for `size` rows; gated=False (the warm-up) leaves the host out; device_part: the
        device's partials (split rows' device parts, the streamed share) are attended to and merged."""
        inner = self.model.model
        positions, attn_out, out_device = self.positions[:size], self.attn_out[:size], self.out_device[:size]
        q, k, v, residual = inner.begin(self.token_ids[:size], positions)
        if device_part and self.stream is not None:
            self.stream.begin()
        for layer in range(self.num_layers):
            if gated:
                self.q_host[layer, :size].copy_(q, non_blocking=True)
                self.k_host[layer, :size].copy_(k, non_blocking=True)
                self.v_host[layer, :size].copy_(v, non_blocking=True)
                open_gate(self._gate(0, layer))
            partial = self._attend_device_part(layer, q, size) if device_part else None  # beside the host kernel
            if gated:
                wait_gate(self._gate(1, layer))
                out_device.copy_(self.out_host[layer, :size], non_blocking=True)
            if partial is None:
                attn_out.copy_(out_device)
            else:
                if gated:
                    self.lse_device[:size].copy_(self.lse_host[layer, :size], non_blocking=True)
                attn = self.model.attention_layers()[layer]
                attn_out.copy_(attn.backend.merge_attn_states(*partial, out_device, self.lse_device[:size])[0])
            if layer + 1 < self.num_layers:
                q, k, v, residual = inner.between(layer + 1, positions, attn_out, residual)
        if device_part and self.stream is not None:
            self.stream.end()
        return self.model.compute_logits(inner.end(attn_out, residual))

    def _attend_device_part(self, layer: int, q: torch.Tensor, size: int):
        """The device's partial of this layer: over split rows' device parts, then the streamed share, merged."""
        attn = self.model.attention_layers()[layer]
        partial = None
        if self.device_tables is not None:
            partial = attn.backend.paged_decode_attention(q, attn.k_cache, attn.v_cache, self.device_tables[:size],
                                                          self.device_lens[:size], self.scale)
        if self.stream is not None:
            streamed = self.stream.attend(layer, attn, q, size)
            partial = streamed if partial is None else attn.backend.merge_attn_states(*partial, *streamed)
        return partial

    def _gate(self, which: int, layer: int) -> int:
        return self.gates.data_ptr() + self.gates.element_size() * (which * self.num_layers + layer)

    @torch.inference_mode()
    def _capture(self, size: int, device_part: bool) -> None:
        with few_sms(self.positions.device):
            # Warm up outside the graph: lazy inits and autotuning must not be captured.
            self._step(size, gated=False, device_part=device_part)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                logits = self._step(size, gated=True, device_part=device_part)
        self.pool = graph.pool()
        torch.cuda.synchronize(self.capture_stream.device)
        self.whole[size, device_part] = (graph, logits)

    def release(self) -> None:
        for graph, _ in self.whole.values():
            graph.reset()
        self.whole, self.pool = {}, None

    def fits(self, batch: int, meta) -> bool:
        """Host-tier rows, split ones where the graphs have their device part, a streamed share where they stream,
        at most the largest bucket."""
        split_fits = not meta.has_gpu_rows or (
            self.device_tables is not None and meta.block_tables.shape[1] <= self.device_tables.shape[1])
        stream_fits = meta.streamed is None or (self.stream is not None and self.stream.fits(meta.streamed))
        return batch <= self.buckets[-1] and split_fits and stream_fits

    def stream_seconds(self) -> float | None:
        """The last step's copies of its streamed share, in device seconds (None: it streamed none); read after the
        step's outputs have synced."""
        return self.stream.seconds() if self.stream is not None else None

    @torch.inference_mode()
    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One decode step of the host lane: logits [B, vocab]. The seconds the host worked on its layers (not
        its waits for the device) go to meta.host_kernel_seconds."""
        batch = token_ids.shape[0]
        size = next(b for b in self.buckets if b >= batch)
        slots, tables, lens = (t.numpy() for t in (meta.slot_mapping_cpu, meta.block_tables_cpu,
                                                    meta.context_lens_cpu))
        check_step(self.pools, slots, tables, lens)  # before anything is queued
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        partials = meta.has_gpu_rows or meta.streamed is not None
        if partials and self.device_tables is not None:  # rows past the batch, and rows that are not split, read nothing
            self.device_lens.zero_()
            if meta.has_gpu_rows:
                self.device_lens[:batch].copy_(meta.context_lens)
                self.device_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.stream is not None:
            self.stream.load(meta.streamed if partials else None, batch)
        self.gates_np.fill(0)  # the last step's graph and loop are both done: its sampler synced, its loop returned
        graph, logits = self.whole[size, partials]
        loop = LayerLoop(self.executor, self.gates_np, self.q_host, self.k_host, self.v_host, self.pools, slots,
                         tables, lens, batch, self.scale, self.out_host.numpy(), self.lse_host.numpy())
        loop.wait_running()  # the graph waits on the loop's gates: launch it only once the loop needs no GIL
        if loop.done.done():
            loop.result()  # it failed before it ran: raise that, with nothing launched
        graph.replay()
        try:
            loop.result(timeout=STEP_TIMEOUT_S)
        except TimeoutError:
            loop.abandon()
            raise RuntimeError(f"the host lane's step did not finish in {STEP_TIMEOUT_S:.0f} s: the device never "
                               "handed its layers over") from None
        work, waits = loop.split_seconds()
        meta.host_kernel_seconds.append(work)
        self.last_device_wait_seconds = waits  # profiling: how long the loop waited for the device's layers
        return logits[:batch]
