from offload_engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # per-head RMSNorm on q and k before the rotary embedding
