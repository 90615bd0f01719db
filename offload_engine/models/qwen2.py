from offload_engine.config import ModelConfig
from offload_engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg: ModelConfig) -> tuple[bool, bool]:
        return True, False  # Qwen2 has q/k/v biases and none on o_proj
