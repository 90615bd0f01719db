"""Piecewise CUDA graphs for decode steps.

A decode step of a small model is bound by kernel launches, not by the GPU: eagerly, Qwen3-0.6B at batch 64
launches ~1,600 kernels a step and the host takes ~40 ms to issue them while the GPU needs a few. Each
segment of the model between two attention calls (engine-side: `begin`, `between`, `end` in models/llama.py)
is captured once per batch-size bucket; a step replays the segments and runs attention eagerly between them.
Attention stays outside the graphs because its host-tier half runs numba on a host thread and its shape
(context lengths, which tier each row is on) changes every step; everything else is the same kernels with
the same shapes, replayed for a few microseconds each.

Padding rows (a batch of 37 runs in the 48 bucket) compute on stale inputs and are never read: every op
outside attention is row-wise in decode.
"""
import torch


def batch_buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.num_layers = len(model.model.layers)
        self.buckets = batch_buckets(max_num_seqs)
        largest = self.buckets[-1]
        self.token_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(largest, num_heads, head_dim, dtype=dtype, device=device)
        self.pool = None
        self.graphs: dict[int, list] = {}
        self.outputs: dict[int, list] = {}
        for size in reversed(self.buckets):  # largest first, so smaller buckets fit in its pool
            self._capture(size)

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
            with torch.cuda.graph(graph, pool=self.pool):
                prev = segment(prev)
            self.pool = graph.pool()
            graphs.append(graph)
            outputs.append(prev)
        torch.cuda.synchronize()
        self.graphs[size], self.outputs[size] = graphs, outputs

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

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
