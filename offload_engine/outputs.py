"""What `LLM.generate` returns: one record per prompt, in prompt order."""
from dataclasses import dataclass


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str | None  # None when the model directory has no tokenizer
    finish_reason: str  # "stop" (eos or a stop token) or "length" (max_tokens or max_model_len)
    # "gpu" or "cpu": the tier the request's KV was placed on at admission; "split": its first tokens' KV on the
    # device, the rest on the host (a sequence too long for the device pool, under kv_placement="auto")
    kv_location: str
    kv_device_tokens: int = 0  # a split request's tokens whose KV was kept on the device (0 unless "split")
    kv_promoted: bool = False  # its KV moved from the host tier to the device pool partway (kv_promotion)
    kv_demoted: bool = False  # its KV moved from the device pool to the host tier partway (device overflow)
