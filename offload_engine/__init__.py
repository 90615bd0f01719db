"""offload-engine: LLM inference with a GPU KV tier and a pinned-host KV tier."""
from offload_engine.config import EngineConfig
from offload_engine.llm import LLM
from offload_engine.outputs import RequestOutput
from offload_engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
