"""The offload benchmark's workloads, at two sizes: "full" (real model shapes, on the GPU host) and "small"
(the embedded tiny model, any machine, a few minutes on two CPU cores).

a. nano-vllm's protocol: N sequences, prompt and output lengths uniform in [lo, hi], device tier only.
b. Beyond VRAM: N x (prompt P, output O) whose KV is >= 4x a device budget set by num_gpu_blocks; each
   placement ("gpu", "auto", "cpu") at each budget, plus transformers' generate as peers (workload d).
c. One sequence longer than the device budget: decode tok/s against the bound that host read bandwidth sets.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BeyondVram:
    model: str  # a config in benchmarks/configs, or "tiny" for the embedded default
    num_seqs: int
    prompt_len: int
    output_len: int
    budget_fractions: tuple[float, ...]  # device pool as a fraction of the batch's whole KV
    peer_batch: int  # transformers' generate batch size


@dataclass(frozen=True)
class Profile:
    name: str
    a_model: str
    a_num_seqs: int
    a_range: tuple[int, int]
    b: tuple[BeyondVram, ...]
    c_model: str
    c_context: int
    c_output: int
    c_budget_tokens: int
    llm_kwargs: dict = field(default_factory=dict)
    ceiling_gb: float = 4.0
    peer_seconds: float = 90.0  # a peer generates for at most this long per workload (whole batches first)


# Sizes for the GPU host are set so that each model's part of the suite fits one 10-minute device call: the
# "cpu" placement reads every sequence's whole KV from host memory each step, which bounds how big b can be.
PROFILES = {
    "full": Profile(
        name="full", a_model="qwen3-0.6b", a_num_seqs=256, a_range=(100, 1024),
        b=(BeyondVram("qwen3-0.6b", 64, 2048, 256, (1 / 4, 1 / 8, 1 / 16), peer_batch=16),
           BeyondVram("qwen3-8b", 32, 4096, 128, (1 / 4, 1 / 8), peer_batch=8)),
        c_model="qwen3-0.6b-256k", c_context=262144, c_output=16, c_budget_tokens=32768),
    "small": Profile(
        name="small", a_model="tiny", a_num_seqs=24, a_range=(16, 96),
        b=(BeyondVram("tiny", 16, 192, 32, (1 / 4, 1 / 8), peer_batch=8),),
        c_model="tiny", c_context=2048, c_output=16, c_budget_tokens=512,
        llm_kwargs=dict(max_num_seqs=32, num_cpu_blocks=256, max_model_len=4096), ceiling_gb=1.0, peer_seconds=20.0),
}
