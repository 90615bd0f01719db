"""The CUDA streams the engine works on: one set per device for the process, shared by every engine, since torch keeps
a stream's cuBLAS workspaces until the process exits (docs/decisions/memory.md, "Process-wide streams"). So two
engines must not step at once from two threads.
"""
import torch

PRIORITIES = {"device": -1, "host": 0}  # lower is more urgent: the device lane's steps go first


def engine_stream(device: torch.device, name: str) -> torch.cuda.Stream:
    """The process-wide stream `name` on `device`: "device", "host", "moves", "capture-device", "capture-host",
    "prefill-writes" (host-tier prefill's copies to the host) or "handoff" (disagg/kv_handoff.py)."""
    index = device.index or 0  # the engine names its GPU by index (EngineConfig.validate): never the current one
    key = (index, name)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(torch.device("cuda", index), priority=PRIORITIES.get(name, 0))
    return _streams[key]


_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
