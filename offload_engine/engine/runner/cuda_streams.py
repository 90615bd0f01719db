"""The CUDA streams the engine works on: one set per device for the whole process, shared by every engine.

Each decode lane has a stream, host-tier prefill writes cross on one beside the compute, and each lane's CUDA
graphs are captured on a stream of their own (engine/graphs/cuda_graphs.py says why). Why not fresh streams per engine:
torch keys its cuBLAS workspaces by (handle, stream) and keeps them until the process exits, so every engine
made and closed left ~100 MB of device memory behind (H100, 2026-11-22, tests/test_lifecycle.py). Engines made
one after another reuse these streams and so their workspaces. Two engines stepping at the same time from
different threads would share them; the engine is not meant to be driven like that.
"""
import torch

PRIORITIES = {"device": -1, "host": 0}  # lower is more urgent: the device lane's steps go first


def engine_stream(device: torch.device, name: str) -> torch.cuda.Stream:
    """The process-wide stream `name` ("device", "host", "capture-device", "capture-host", "prefill-writes": the
    host-tier prefill's copies to the host) on `device`."""
    index = device.index or 0  # the engine names its GPU by index (EngineConfig.validate): never the current one
    key = (index, name)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(torch.device("cuda", index), priority=PRIORITIES.get(name, 0))
    return _streams[key]


_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
