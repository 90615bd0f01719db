"""Per-rank device-lane step times under tensor parallelism, for benchmarks (bench_multi_gpu's tp_steps): with
$OFFLOAD_ENGINE_STEP_TIMES naming a folder, each worker notes, per device-lane step, its rows, when rank 0's call
reached it and when its step was queued, and its graph replay's GPU time, and writes them to rank<r>.json at close.
Unset (always, outside benchmarks), nothing is wrapped or noted."""
import json
import os
import time

import torch

from offload_engine.engine.graphs.replay_timer import ReplayTimer

ENV = "OFFLOAD_ENGINE_STEP_TIMES"


class StepTimes:
    def __init__(self, runner, rank: int, folder: str):
        graphs = getattr(runner, "decode_graphs", {}).get("device")
        self.timer = ReplayTimer(graphs) if graphs is not None else None
        self.path = os.path.join(folder, f"rank{rank}.json")
        self.steps = []  # [rows, received, queued, replayed]: perf_counter seconds; replayed: this step's graph ran

    @classmethod
    def from_env(cls, runner, rank: int) -> "StepTimes | None":
        folder = os.environ.get(ENV)
        return cls(runner, rank, folder) if folder else None

    def replays(self) -> int:
        return len(self.timer.pending) if self.timer is not None else 0

    def note(self, rows: int, received: float, replays_before: int) -> None:
        self.steps.append([rows, received, time.perf_counter(), self.replays() > replays_before])

    def write(self) -> None:
        """Called once the rank's steps are done; waits for its GPU work, whose events it reads."""
        if self.timer is not None:
            torch.cuda.synchronize()
        gpu = iter(self.timer.take_ms() if self.timer is not None else [])
        steps = [{"rows": rows, "received": received, "queued": queued, "gpu_ms": next(gpu) if replayed else None}
                 for rows, received, queued, replayed in self.steps]
        with open(self.path, "w") as f:
            json.dump({"steps": steps}, f)
