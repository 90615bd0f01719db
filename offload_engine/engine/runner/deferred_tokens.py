"""A device-lane decode step's sampled ids: on the device at once, on the host once their copy lands (async
scheduling). The pinned buffers alternate (HOST_COPIES): one step's ids may be unread when the next step's land."""
import time

import torch

from offload_engine.engine.runner.cpu_gpu_buffer import HOST_COPIES
from offload_engine.engine.sequence import Sequence
from offload_engine.layers.logits_processing import record_logprobs


class SampledIdBuffers:
    def __init__(self, max_rows: int, device: torch.device):
        pin = device.type == "cuda"
        self.hosts = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(HOST_COPIES)]
        self.next = 0

    def defer(self, seqs: list[Sequence], sampled: torch.Tensor) -> "DeferredTokens":
        host = self.hosts[self.next][: len(seqs)]
        self.next = (self.next + 1) % HOST_COPIES
        return DeferredTokens(seqs, sampled, host)


class DeferredTokens:
    def __init__(self, seqs: list[Sequence], sampled: torch.Tensor, host: torch.Tensor):
        self.seqs = seqs
        self.row_of = {seq.seq_id: row for row, seq in enumerate(seqs)}
        self.positions = [len(seq) for seq in seqs]  # where each sampled token goes in its sequence
        self.launched = time.perf_counter()
        self.host_busy = False  # a host-lane step was in flight when it was queued (LaneStats)
        self.host_streams = False  # and it streamed a share of its KV
        self.quiet = True  # no KV copy was queued with it, so its time is the step's own (LaneStats)
        self.moved = (0, 0.0)  # tokens moved between the tiers with it, and the engine thread's seconds for them
        self.landed = None
        self.logprobs = None  # TokenLogprobs of rows that asked (SamplingParams.logprobs), recorded when read
        # `sampled` is where every step of the lane leaves its ids (input_batch.py): copied before the next step.
        self.host = host.copy_(sampled, non_blocking=sampled.is_cuda)
        if sampled.is_cuda:
            self.landed = torch.cuda.Event()
            self.landed.record()

    def result(self) -> list[int]:
        if self.landed is not None:
            self.landed.synchronize()
        ids = self.host.tolist()
        if self.logprobs is not None:
            record_logprobs(self.seqs, self.positions, ids, self.logprobs)
            self.logprobs = None
        return ids

    def wait(self) -> None:
        """Waits for the step without reading it (LLMEngine.abort: its rows are dropped)."""
        if self.landed is not None:
            self.landed.synchronize()
