"""CUDA graphs for decode steps, one per batch-size bucket (docs/design.md, "CUDA graphs"): with `inputs` (the
persistent input batch) whole steps, token gather and sampling included; without (the torch backend), the segments
between attention calls. Padding rows touch no KV (slot -1, context 0) and their outputs are never read.
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
        self.capture_stream = capture_stream  # one per lane: cuBLAS keys its workspace by stream
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
        for graph in [g for graphs in self.graphs.values() for g in graphs] + [g for g, _ in self.whole.values()]:
            graph.reset()
        self.graphs, self.outputs, self.whole, self.pool = {}, {}, {}, None

    @property
    def whole_steps(self) -> bool:
        return self.inputs is not None

    def bucket(self, batch: int) -> int:
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
