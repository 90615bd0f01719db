"""What `LLM.generate` and `LLM.chat` return: one `RequestOutput` per prompt, in prompt order, shaped as vLLM's.

A request's completions are in `outputs` (vLLM's `CompletionOutput`); `text`, `token_ids` and `finish_reason` on
the request are its first completion's, as they were before completions had their own records. The KV tier fields
are ours.
"""
from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability (natural log) under the model's distribution, its rank there (1: the likeliest),
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str | None  # None when the model directory has no tokenizer
    token_ids: list[int]  # generated tokens only, a stop token included
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs, where SamplingParams.logprobs is set
    logprobs: list[dict[int, Logprob]] | None = None  # per token: its top-k and the token itself
    finish_reason: str | None = None  # "stop" (eos or a stop token), "length" (max_tokens or max_model_len)
    stop_reason: int | str | None = None  # the stop token id that ended it; None for eos and for "length"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token; the first has none: None
    # "gpu" or "cpu": the tier the request's KV was placed on at admission; "split": its first tokens' KV on the
    # device, the rest on the host (a sequence too long for the device pool, under kv_placement="auto")
    kv_location: str = "gpu"
    kv_device_tokens: int = 0  # a split request's tokens whose KV was kept on the device (0 unless "split")
    kv_promoted: bool = False  # its KV moved from the host tier to the device pool partway (kv_promotion)
    kv_demoted: bool = False  # its KV moved from the device pool to the host tier partway (device overflow)

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
