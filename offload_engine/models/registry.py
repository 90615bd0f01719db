"""Which model class serves which config.json "architectures" entry."""

_ARCHITECTURES = {
    "LlamaForCausalLM": ("offload_engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("offload_engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("offload_engine.models.qwen3", "Qwen3ForCausalLM"),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def resolve_architecture(raw_config: dict) -> str:
    names = list(raw_config.get("architectures") or [])
    if not names and raw_config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[raw_config["model_type"]]]
    for name in names:
        if name in _ARCHITECTURES:
            return name
    shown = names or [raw_config.get("model_type")]
    raise ValueError(f"unsupported architecture {shown}: offload-engine supports {sorted(_ARCHITECTURES)}")


def model_class(architecture: str):
    import importlib

    module, name = _ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module), name)
