"""Which CUDA graph a step replays, FULL, PIECEWISE or NONE (eager), chosen in one place from a frozen
BatchDescriptor (docs/design.md, "CUDA graphs"). `counts` keeps how many steps ran under each (tests and benchmarks).
"""
import enum
from collections import Counter
from dataclasses import dataclass


class GraphMode(enum.Enum):
    FULL = "full"
    PIECEWISE = "piecewise"
    NONE = "none"


@dataclass(frozen=True)
class BatchDescriptor:
    lane: str  # "device", "host" or "prefill"
    rows: int  # the graph bucket the step's rows run in (the rows themselves under NONE); prefill: its tokens
    split_rows: bool  # some row attends over both tiers (host lane)


class GraphDispatcher:
    def __init__(self, graphs: dict):
        """graphs: lane -> its DecodeGraphs or HostStepGraphs (ModelRunner.decode_graphs); no entry: eager."""
        self.graphs = graphs
        self.prefill_graphs = None
        self.counts: Counter = Counter()  # (mode, descriptor) -> steps

    def dispatch(self, lane: str, rows: int, meta=None) -> tuple[GraphMode, BatchDescriptor]:
        """meta: the step's AttentionMetadata where it is built before dispatch (the host lane), else None."""
        graphs = self.graphs.get(lane)
        split = lane == "host" and meta is not None and meta.has_gpu_rows
        if graphs is None or rows > graphs.buckets[-1] or (lane == "host" and not graphs.fits(rows, meta)):
            mode, size = GraphMode.NONE, rows
        else:
            size = next(b for b in graphs.buckets if b >= rows)
            mode = GraphMode.FULL if lane == "device" and graphs.whole_steps else GraphMode.PIECEWISE
        descriptor = BatchDescriptor(lane, size, split)
        self.counts[(mode, descriptor)] += 1
        return mode, descriptor

    def dispatch_prefill(self, num_tokens: int, meta) -> tuple[GraphMode, BatchDescriptor]:
        size = self.prefill_graphs.fits(num_tokens, meta) if self.prefill_graphs is not None else None
        mode = GraphMode.NONE if size is None else GraphMode.FULL
        descriptor = BatchDescriptor("prefill", num_tokens if size is None else size, False)
        self.counts[(mode, descriptor)] += 1
        return mode, descriptor

    def steps(self, lane: str, mode: GraphMode) -> int:
        return sum(n for (m, d), n in self.counts.items() if m == mode and d.lane == lane)
