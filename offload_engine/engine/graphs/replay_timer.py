"""CUDA events around each replay of the device lane's whole-step graphs: the step's GPU time, for benchmarks that
set it against the step's wall time (bench_engine_step; per rank under tensor parallelism, step_times.py).
Invariant: wrapping changes no result; `restore` puts the graphs' own replay back."""
import torch


class ReplayTimer:
    """Wraps `graphs.replay`; the times are read once the steps are back (`take_ms`)."""

    def __init__(self, graphs):
        self.graphs, self.run, self.pending = graphs, graphs.replay, []
        graphs.replay = self._timed

    def _timed(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.run(*args, **kwargs)
        end.record()
        self.pending.append((start, end))
        return out

    def take_ms(self) -> list[float]:
        """The replays' GPU milliseconds since the last take, in order (waits for them)."""
        times = [start.elapsed_time(end) for start, end in self.pending]
        self.pending = []
        return times

    def restore(self) -> None:
        self.graphs.replay = self.run
