"""The device lane's decode step: the persistent input batch in, the whole-step graph (or the model), sampling,
and DeferredTokens out, without waiting for the GPU (async scheduling, engine/llm_engine.py)."""
import torch

from offload_engine.engine.deferred_tokens import DeferredTokens, SampledIdBuffers
from offload_engine.engine.input_batch import DecodeInputBatch
from offload_engine.engine.sequence import Sequence
from offload_engine.layers.sampler import sample


class DeviceLaneDecode:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device):
        self.batch = DecodeInputBatch(max_rows, max_blocks, block_size, device)
        self.sampled_ids = SampledIdBuffers(max_rows, device)
        self.last_step: DeferredTokens | None = None  # whose ids the next step may read on the device

    def launch(self, seqs: list[Sequence], model, graphs, sampling) -> DeferredTokens:
        """Queues one step over `seqs` and returns at once. graphs: the lane's DecodeGraphs or None; sampling:
        a function of the step's rows (in row order) -> their SamplingBatch."""
        rows = self.batch.place(seqs)
        count = len(rows)
        whole = graphs is not None and graphs.whole_steps and count <= graphs.buckets[-1]
        padded = graphs.bucket(count) if whole else count
        meta = self.batch.prepare(padded, self.last_step)
        token_ids, positions = self.batch.token_ids.device[:count], self.batch.positions.device[:count]
        if whole:
            logits = graphs.replay(padded, count)
        elif graphs is not None and graphs.fits(count, meta):
            logits = graphs.run(token_ids, positions, meta)
        else:
            logits = model.compute_logits(model(token_ids, positions, meta))
        self.last_step = self.sampled_ids.defer(rows, sample(logits, sampling(rows)))
        return self.last_step

    def forget(self) -> None:
        """Drops the step in flight (LLMEngine.abort: its rows are gone)."""
        self.last_step = None
