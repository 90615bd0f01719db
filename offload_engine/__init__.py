"""offload-engine: LLM inference with a GPU KV tier and a pinned-host KV tier."""
from offload_engine.engine.hardware_queues import widen_hardware_queues

widen_hardware_queues()  # before anything creates the CUDA context: see engine/hardware_queues.py

from offload_engine.config import EngineConfig  # noqa: E402
from offload_engine.llm import LLM  # noqa: E402
from offload_engine.outputs import RequestOutput  # noqa: E402
from offload_engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
