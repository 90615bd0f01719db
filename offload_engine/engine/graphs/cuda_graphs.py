"""Piecewise CUDA graphs for decode steps.

A decode step of a small model is bound by kernel launches, not by the GPU: eagerly, Qwen3-0.6B at batch 64
launches ~1,600 kernels a step and the host takes ~40 ms to issue them while the GPU needs a few. Each
segment of the model between two attention calls (engine-side: `begin`, `between`, `end` in models/llama.py)
is captured once per batch-size bucket; a step replays the segments and runs attention eagerly between them.
Attention stays outside the graphs because its host-tier half runs numba on a host thread and its shape
(context lengths, which tier each row is on) changes every step; everything else is the same kernels with
the same shapes, replayed for a few microseconds each.

When no row of the step is on the host tier, attention needs no host work, so an instance made with `inputs`
(the persistent input batch, engine/runner/input_batch.py) captures whole steps: the token gather, the model with its
attention, and sampling, into the batch's `sampled`. It reads its token ids, positions, maps and sampling settings
from the batch's device tensors, which the step's inputs are copied into, sized for max_num_seqs rows of
max_model_len. The engine keeps one instance for the device lane (whole steps where the attention backend
allows, piecewise for the torch backend); the host lane has whole-step graphs of its own whose attention
the host kernel does between gates (engine/graphs/host_step_graphs.py). Each lane's graphs have their own static
inputs and memory pool, so the two lanes can be in flight at once, and each captures on a CUDA stream of
its own: cuBLAS workspaces are keyed by the stream a matmul ran on, and torch captures every graph on one
shared stream by default, so both lanes' graphs would have baked in the same workspace and, replayed at once
on the two lanes' streams, written over each other's partial products (seen on the H100: wrong host-lane
tokens).
Padding rows
(a batch of 37 runs in the 48 bucket) compute on stale inputs and are never read: every op outside attention
is row-wise in decode, and padded rows get slot -1 and context 0, so they write and read no KV.
"""
import torch

from offload_engine.layers.attention_metadata import AttentionMetadata
from offload_engine.layers.sampler import sample


def batch_buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capture_stream: torch.cuda.Stream, inputs=None):
        self.model = model
        self.num_layers = len(model.model.layers)
        self.buckets = batch_buckets(max_num_seqs)
        largest = self.buckets[-1]
        self.token_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(largest, num_heads, head_dim, dtype=dtype, device=device)
        self.pool = None
        self.capture_stream = capture_stream  # one per lane: a cuBLAS workspace of the lane's own (see above)
        self.graphs: dict[int, list] = {}
        self.outputs: dict[int, list] = {}
        self.whole: dict[int, tuple] = {}
        self.inputs = inputs
        for size in reversed(self.buckets):  # largest first, so smaller buckets fit in its pool
            if inputs is None:
                self._capture(size)
            else:
                self._capture_whole(size)

    def _segments(self, size: int):
        """The step's segments for one bucket, each a function of the previous segment's outputs."""
        inner = self.model.model
        tokens, positions, attn_out = self.token_ids[:size], self.positions[:size], self.attn_out[:size]
        yield lambda prev: inner.begin(tokens, positions)
        for layer in range(1, self.num_layers):
            yield lambda prev, layer=layer: inner.between(layer, positions, attn_out, prev[3])
        yield lambda prev: self.model.compute_logits(inner.end(attn_out, prev[3]))

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        graphs, outputs, prev = [], [], None
        for segment in self._segments(size):
            segment(prev)  # warm up outside the graph: lazy inits and autotuning must not be captured
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                prev = segment(prev)
            self.pool = graph.pool()
            graphs.append(graph)
            outputs.append(prev)
        torch.cuda.synchronize(self.capture_stream.device)
        self.graphs[size], self.outputs[size] = graphs, outputs

    @torch.inference_mode()
    def _capture_whole(self, size: int) -> None:
        batch, empty = self.inputs, torch.empty(0)
        meta = AttentionMetadata(
            is_prefill=False, has_gpu_rows=True, has_cpu_rows=False, slot_mapping=batch.slot_mapping[:size],
            context_lens=batch.context_lens[:size], block_tables=batch.block_tables[:size],
            slot_mapping_cpu=empty, context_lens_cpu=empty, block_tables_cpu=empty)

        def step():
            logits = self.model.compute_logits(self.model(batch.gather_tokens(size), batch.positions[:size], meta))
            sample(logits, batch.sampling(size), out=batch.sampled[:size])
            return logits

        step()  # warm up (context 0 everywhere: no KV is read or written)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            logits = step()
        self.pool = graph.pool()
        torch.cuda.synchronize(self.capture_stream.device)
        self.whole[size] = (graph, logits)

    def release(self) -> None:
        """Drops every graph and the memory pool they share (the engine's close())."""
        for graph in [g for graphs in self.graphs.values() for g in graphs] + [g for g, _ in self.whole.values()]:
            graph.reset()
        self.graphs, self.outputs, self.whole, self.pool = {}, {}, {}, None

    @property
    def whole_steps(self) -> bool:
        """Captured whole steps, attention and sampling included (made with `inputs`)."""
        return self.inputs is not None

    def bucket(self, batch: int) -> int:
        """The graph size a batch runs in (the smallest bucket that holds it)."""
        return next(b for b in self.buckets if b >= batch)

    def fits(self, batch: int, meta) -> bool:
        """Piecewise graphs serve any batch up to the largest bucket (whole ones: replay)."""
        return batch <= self.buckets[-1] and self.inputs is None

    def replay(self, size: int, batch: int) -> torch.Tensor:
        """A whole step whose inputs are already in the static tensors, rows past `batch` masked: logits [batch];
        the sampled ids are in the input batch's `sampled`."""
        graph, logits = self.whole[size]
        graph.replay()
        return logits[:batch]

    @torch.inference_mode()
    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One decode step: logits [B, vocab] for the B rows of token_ids."""
        batch = token_ids.shape[0]
        size = next(b for b in self.buckets if b >= batch)
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        graphs, outputs = self.graphs[size], self.outputs[size]
        for layer in range(self.num_layers):
            graphs[layer].replay()
            q, k, v, _ = outputs[layer]
            self.attn_out[:batch].copy_(self.model.model.attend(layer, q[:batch], k[:batch], v[:batch], meta))
        graphs[-1].replay()
        return outputs[-1][:batch]
