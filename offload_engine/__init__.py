"""offload-engine: LLM inference with a GPU KV tier and a pinned-host KV tier. The public names load on first use,
so that `import offload_engine` (and the torch-free `offload_engine.engine.sched`) does not import torch.
"""
from offload_engine.engine.graphs.hardware_queues import widen_hardware_queues

widen_hardware_queues()  # before anything creates the CUDA context: see engine/graphs/hardware_queues.py

_PUBLIC = {"LLM": "offload_engine.llm", "SamplingParams": "offload_engine.sampling_params",
           "RequestOutput": "offload_engine.outputs", "EngineConfig": "offload_engine.config"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'offload_engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
