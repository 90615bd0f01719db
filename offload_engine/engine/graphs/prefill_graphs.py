"""Whole CUDA graphs for prefill steps whose rows are all on the device tier, one per bucket of tokens
(docs/design.md, "CUDA graphs"; why: docs/decisions/prefill-graphs.md). The attention kernel's grid is a tile map
sized for the bucket; padding tokens get slot -1 and no tile, so they touch no KV. Logits are computed eagerly.
"""
import functools
import time

import numpy as np
import torch

from offload_engine.layers.attention_metadata import AttentionMetadata

# Bucket sizes: 256, 512, then powers of two and the halfway points above them (1,024, 1,536, 2,048, 3,072, ...),
# so a step above 1,024 tokens pads by at most half of itself (below, to twice itself: launches bound those anyway).
_SIZES = [256, 512] + sorted(size for k in range(10, 24) for size in (1 << k, 3 << (k - 1)))


def token_buckets(largest: int) -> list[int]:
    return [size for size in _SIZES if size < largest] + [largest]


def _spin_cycles_per_second(device: torch.device) -> float:
    cycles = 10_000_000
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


class PrefillGraphs:
    def __init__(self, model, max_tokens: int, max_rows: int, max_blocks_per_seq: int, dtype: torch.dtype,
                 device: torch.device, capture_stream=None, paying_tokens: int | None = None, agree=None):
        """max_tokens: the largest bucket; max_rows: rows a step may have; capture_stream None: no graphs are
        captured, and `run` goes through the same static tensors eagerly (CPU tests of everything but capture).
        paying_tokens: the largest bucket worth a graph, as the memory profile measured it (None: measured here).
        agree(flag): true where every rank's flag is (tensor parallelism): the timing loops below run forwards, whose
        collectives pair only if every rank leaves each loop at the same turn."""
        from gpu_kernels.paged_prefill import query_tile_rows

        self.model, self.device, self.agree = model, device, agree or (lambda flag: flag)
        self.buckets = token_buckets(max_tokens)
        largest = self.buckets[-1]
        self.max_rows, self.max_blocks_per_seq = min(max_rows, largest), max_blocks_per_seq
        attn = model.attention_layers()[0]
        self.tile_rows = query_tile_rows(device, dtype, attn.head_dim)
        # Each row adds at most one partial tile to the bucket's whole ones.
        self.tile_capacity = {b: -(-b // self.tile_rows) + self.max_rows for b in self.buckets}
        new = lambda shape, dtype, fill: torch.full(shape, fill, dtype=dtype, device=device)
        self.token_ids, self.positions = new((largest,), torch.int64, 0), new((largest,), torch.int64, 0)
        self.slot_mapping = new((largest,), torch.int64, -1)
        self.cu_seqlens = new((self.max_rows + 1,), torch.int32, 0)
        self.context_lens = new((self.max_rows,), torch.int32, 0)
        self.block_tables = new((self.max_rows, max_blocks_per_seq), torch.int32, -1)
        self.tiles = new((self.tile_capacity[largest], 2), torch.int32, -1)
        self.capture_stream, self.pool = capture_stream, None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pays = {b: True for b in self.buckets}
        self.launch_seconds, self.gpu_seconds = None, {}  # what `pays` was decided from
        self._spin_cycles = None
        if capture_stream is not None:
            if paying_tokens is None:
                paying_tokens = self.largest_paying_bucket()
            self.pays = {b: b <= paying_tokens for b in self.buckets}
            for size in reversed(self.buckets):  # largest first, so smaller buckets fit in its pool
                if self.pays[size]:
                    self._capture(size)

    def _meta(self, size: int) -> AttentionMetadata:
        none = torch.empty(0, dtype=torch.int64)
        return AttentionMetadata(
            is_prefill=True, slot_mapping=self.slot_mapping[:size], context_lens=self.context_lens,
            block_tables=self.block_tables, slot_mapping_cpu=none, context_lens_cpu=none.int(),
            block_tables_cpu=none.int().view(0, 0), has_gpu_rows=True, has_cpu_rows=False,
            cu_seqlens_q=self.cu_seqlens, max_seqlen_q=size, prefill_tiles=self.tiles[:self.tile_capacity[size]])

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.token_ids[:size], self.positions[:size], self._meta(size))

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        self._forward(size)  # warm up outside the graph (compiles); no tile and no slot: no KV is read or written
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            self.hidden[size] = self._forward(size)
        self.pool = graph.pool()
        self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def largest_paying_bucket(self) -> int:
        """The largest bucket whose forward keeps the GPU busy for less time than an eager forward at the smallest
        bucket takes to launch (0: none): past that, a step padded to its bucket replays no faster than eagerly."""
        self.launch_seconds = min(self._launch_seconds() for _ in range(2))  # the first may still fill caches
        largest = 0
        for size in self.buckets:
            self._forward(size)  # compiles what this size needs, outside the timing
            self.gpu_seconds[size] = min(self._gpu_seconds(size) for _ in range(2))
            if not self.agree(self.gpu_seconds[size] < self.launch_seconds):
                break
            largest = size
        return largest

    def _launch_seconds(self) -> float:
        torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        self._forward(self.buckets[0])
        return time.perf_counter() - began

    def _gpu_seconds(self, size: int) -> float:
        """The GPU time of bucket `size`'s forward without attention (no tile), its launches queued behind a spin
        kernel, lengthened until it outlasts them, so the GPU runs them back to back as a replay would."""
        if self._spin_cycles is None:  # calibrated once, for twice the launches' time
            self._spin_cycles = max(1, int(2 * self.launch_seconds * _spin_cycles_per_second(self.device)))
        cycles = self._spin_cycles
        for _ in range(4):
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            self._forward(size)
            end.record()
            held = not start.query()  # the GPU was still spinning when the last launch was queued
            end.synchronize()
            if self.agree(held):
                break
            cycles *= 4
        return start.elapsed_time(end) / 1e3  # unheld after four tries: launch gaps included, an overestimate

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> int | None:
        """The bucket a prefill step runs in, or None where it runs eagerly."""
        if meta.has_cpu_rows or meta.context_lens.shape[0] > self.max_rows:
            return None
        if meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        size = next((b for b in self.buckets if b >= num_tokens), None)
        return size if size is not None and self.pays[size] else None

    @torch.inference_mode()
    def run(self, size: int, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            query_lens: list[int], to_device) -> torch.Tensor:
        """The step's hidden states [T, hidden] from bucket `size`'s graph. to_device(array, dtype): the step
        builder's pinned copy to the device, for the tile map."""
        num_tokens, rows = token_ids.shape[0], meta.context_lens.shape[0]
        self.token_ids[:num_tokens].copy_(token_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)  # an earlier, longer step's slots must not be written again
        self.cu_seqlens[:rows + 1].copy_(meta.cu_seqlens_q)
        self.context_lens[:rows].copy_(meta.context_lens)
        self.block_tables[:rows, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        from gpu_kernels.paged_prefill import prefill_tiles

        capacity = self.tile_capacity[size]
        self.tiles[:capacity].copy_(to_device(prefill_tiles(np.asarray(query_lens), self.tile_rows, capacity),
                                              torch.int32))
        if size in self.graphs:
            self.graphs[size].replay()
            return self.hidden[size][:num_tokens]
        return self._forward(size)[:num_tokens]

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.hidden, self.pool = {}, {}, None


def prefill_graph_tokens(runner) -> int:
    """The largest prefill step that may replay a graph on this runner; 0 off CUDA, eager, and without Triton's
    tiled prefill kernel (the torch backend's takes its loop from the step). Graph steps attend on that kernel
    whatever serves eager prefill."""
    cfg = runner.cfg
    if runner.device.type != "cuda" or cfg.enforce_eager or runner.backend.tiled_prefill_attention is None:
        return 0
    return min(cfg.prefill_graph_tokens, cfg.max_num_batched_tokens)


def paying_prefill_tokens(runner) -> int:
    """The largest bucket worth a graph on this runner, 0 where none is captured; measured once, by the memory
    profile or the capture, whichever asks first. Needs a device pool bound; no KV is read or written."""
    if runner.paying_prefill_tokens is None:
        tokens = prefill_graph_tokens(runner)
        paying = _graphs(runner, tokens).largest_paying_bucket() if tokens else 0
        runner.paying_prefill_tokens = runner.agreed(paying)
    return runner.paying_prefill_tokens


def capture_prefill_graphs(runner) -> PrefillGraphs | None:
    """The runner's prefill graphs, once its device pool is bound, or None where no bucket pays."""
    tokens = paying_prefill_tokens(runner)
    if not tokens:
        return None
    from offload_engine.engine.runner.cuda_streams import engine_stream

    # On the device lane's capture stream: prefill steps run on that lane, never beside its decode graphs.
    return _graphs(runner, tokens, engine_stream(runner.device, "capture-device"), paying_tokens=tokens)


def _graphs(runner, tokens: int, capture_stream=None, paying_tokens: int | None = None) -> PrefillGraphs:
    agree = None
    if runner.tp.size > 1:
        from offload_engine.distributed import parallel_state

        agree = functools.partial(parallel_state.all_agree, device=runner.device)
    return PrefillGraphs(runner.model, tokens, runner.cfg.max_num_seqs,
                         -(-runner.max_model_len // runner.cfg.block_size), runner.dtype, runner.device,
                         capture_stream, paying_tokens, agree)
