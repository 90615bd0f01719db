"""The device lane's decode step: the persistent input batch in, the whole-step graph (or the model) and sampling,
and DeferredTokens out, without waiting for the GPU (async scheduling, engine/llm_engine.py)."""
import torch

from offload_engine.engine.graphs.graph_dispatch import GraphMode
from offload_engine.engine.runner.deferred_tokens import DeferredTokens, SampledIdBuffers
from offload_engine.engine.runner.input_batch import DecodeInputBatch
from offload_engine.engine.sequence import PENDING_TOKEN, Sequence
from offload_engine.layers.logits_processing import token_logprobs
from offload_engine.layers.sampler import sample


class DeviceLaneDecode:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device):
        self.batch = DecodeInputBatch(max_rows, max_blocks, block_size, device)
        self.sampled_ids = SampledIdBuffers(max_rows, device)
        self.last_step: DeferredTokens | None = None  # whose ids the next step may read on the device

    def launch(self, seqs: list[Sequence], model, graphs, mode: GraphMode, padded: int,
               sampling_settings) -> DeferredTokens:
        """Queues one step over `seqs` and returns at once. mode and padded: the dispatcher's choice;
        sampling_settings: the step's rows (in row order) -> StepInputBuilder.sampling_settings."""
        batch = self.batch
        rows = batch.place(seqs)
        count = len(rows)
        padded = padded if mode == GraphMode.FULL else count  # only a whole-step graph runs padding rows
        meta = batch.prepare(padded, self.last_step, sampling_settings(rows, self._pending_ids(rows)))
        sampled = batch.sampled[:count]
        if mode == GraphMode.FULL:
            logits = graphs.replay(padded, count)  # gathers its tokens and samples into batch.sampled in the graph
        else:
            token_ids, positions = batch.gather_tokens(count), batch.positions[:count]
            if mode == GraphMode.PIECEWISE:
                logits = graphs.run(token_ids, positions, meta)
            else:
                logits = model.compute_logits(model(token_ids, positions, meta))
            sample(logits, batch.sampling(count), out=sampled)
        if batch.filtered is not None:  # a row with top-k or top-p, penalties, min_p: the graph's draw is replaced
            sample(logits, batch.filtered, out=sampled)
        # Before defer: its event, which the host waits on before reading the step, then covers them too.
        logprobs = token_logprobs(logits[:count], sampled, [s.params.logprobs for s in rows])
        self.last_step = self.sampled_ids.defer(rows, sampled)
        self.last_step.logprobs = logprobs
        return self.last_step

    def _pending_ids(self, rows: list[Sequence]) -> dict[int, int] | None:
        """The in-flight step's ids, read (a wait) only where a penalized row's newest token is among them."""
        step = self.last_step
        if step is None or not any(s.params.penalized and s.token_ids[-1] == PENDING_TOKEN for s in rows):
            return None
        ids = step.result()
        return {seq.seq_id: ids[row] for seq, row in ((s, step.row_of.get(s.seq_id)) for s in rows) if row is not None}

    def forget(self) -> None:
        self.last_step = None
