"""The offload benchmark's workloads, at two sizes: "full" (real model shapes, on the GPU host) and "small"
(the embedded tiny model, any machine, a few minutes on two CPU cores).

a. nano-vllm's protocol: N sequences, prompt and output lengths uniform in [lo, hi], device tier only.
b. Beyond VRAM: N x (prompt P, output O) whose KV is >= 4x a device budget set by num_gpu_blocks; each
   placement ("gpu", "auto", "cpu") at each budget, plus transformers' generate as peers (workload d).
   "b" proper is prompt-heavy (O << P); "dh" is its decode-heavy variant (O >= 1,024 in the full profile),
   where most of the time is decode steps and the host tier's capacity should show.
c. One sequence longer than the device budget: decode tok/s against the bound that host read bandwidth sets.
"""
import json
import os
import random
from dataclasses import dataclass, field

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class BeyondVram:
    model: str  # a config in benchmarks/configs, or "tiny" for the embedded default
    num_seqs: int
    prompt_len: int
    output_len: int
    budget_fractions: tuple[float, ...]  # device pool as a fraction of the batch's whole KV
    peer_batch: int  # transformers' generate batch size
    name: str = "b"  # "b" or "dh" (decode-heavy): tells the variants apart in JSON, tables and part file names
    budget_blocks: tuple[int, ...] = ()  # absolute device pools in blocks, measured beside the fractions
    cpu: bool = True  # run the "cpu" placement (it reads every sequence's whole KV from the host each step)
    peers: bool = True  # run transformers' generate

    def budgets(self, total_blocks: int) -> list[int]:
        """Device budgets in blocks, largest first: each fraction of the batch's blocks, and each absolute one."""
        fractions = {max(1, int(total_blocks * fraction)) for fraction in self.budget_fractions}
        return sorted(fractions | set(self.budget_blocks), reverse=True)


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


def blocks_beside_weights(config: str, card_gib: float, reserve_gib: float = 1.5, block_size: int = 16,
                          tp: int = 1) -> int:
    """The device KV pool, in blocks, that a card of card_gib leaves beside a model's bf16 weights and a fixed
    activation/graph reserve. Parameters are counted from the config's shape (embedding, attention, MLP, norms).
    Under tensor parallelism of `tp` ranks, each card holds 1/tp of the weights and of every block (the norms,
    replicated, are ignored).

    qwen3-8b on a 24 GiB card: 2 x 151,936 x 4,096 (embedding and its untied lm_head) + 36 x [4,096 x
    (32 + 2 x 8) x 128 (q, k, v) + 32 x 128 x 4,096 (o) + 3 x 4,096 x 12,288 (MLP) + 2 x 4,096 + 2 x 128
    (norms)] + 4,096 = 8,190,735,360 parameters = 15.26 GiB in bf16; 24 - 15.26 - 1.5 = 7.24 GiB for KV; a
    block is 16 tokens x 2 (K, V) x 36 layers x 8 KV heads x 128 x 2 bytes = 2.25 MiB: 3,296 blocks
    (52,736 tokens)."""
    with open(os.path.join(CONFIGS, f"{config}.json")) as f:
        c = json.load(f)
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    kv_heads, head_dim = c.get("num_key_value_heads") or heads, c.get("head_dim") or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * c["intermediate_size"]
    norms = 2 * hidden + (2 * head_dim if c["model_type"] == "qwen3" else 0)  # qwen3 norms q and k per head
    embeddings = (1 if c.get("tie_word_embeddings") else 2) * c["vocab_size"] * hidden
    weight_bytes = 2 * (embeddings + layers * (attention + mlp + norms) + hidden)
    kv_bytes_per_block = block_size * 2 * layers * kv_heads * head_dim * 2
    return int(((card_gib - reserve_gib) * 2**30 - weight_bytes / tp) // (kv_bytes_per_block / tp))


def mixed_lengths(num_seqs: int, prompt_len: int, output_len: int, spread: float = 0.0,
                  seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of a batch: each uniform in [L x (1 - spread), L x (1 + spread)] around its mean L
    (spread 0: all equal). The suite's batches are uniform; real ones are not, and the placement's guarantee is
    checked on both (bench_throughput.py single --spread, simulate_placement.py --spread). Seeded, so that the
    replay and the device run the same lengths."""
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    rng = random.Random(seed)
    draw = lambda mean: rng.randint(max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread))))
    pairs = [(draw(prompt_len), draw(output_len)) for _ in range(num_seqs)]
    return [p for p, _ in pairs], [o for _, o in pairs]


QWEN3_8B_ON_24_GIB = blocks_beside_weights("qwen3-8b", card_gib=24)  # 3,296 blocks, 7.24 GiB of KV

# Sizes for the GPU host are set so that each model's part of the suite fits one 10-minute device call: the
# "cpu" placement reads every sequence's whole KV from host memory each step, which bounds how big b can be.
# The decode-heavy parts each take their own call. dh 0.6B (estimated on the H100 from 32 x (1024 + 1024) at
# 1/4, ~1,400 tok/s for gpu and auto alike): gpu and auto ~30 s each at 1/4 and ~50 s at 1/8, cpu ~130 s
# (5.6 GB of KV a step over 1,024 steps), ~5 min in all; its peers (~3 min more) are measured in b. dh 8B has
# 64 sequences so that its KV (18 GiB) is 2.5x what a 24 GiB card leaves: 4 runs of ~40-60 s, no cpu (14.5 GB
# a step over 1,024 steps would take ~5 min alone), no peers.
PROFILES = {
    "full": Profile(
        name="full", a_model="qwen3-0.6b", a_num_seqs=256, a_range=(100, 1024),
        b=(BeyondVram("qwen3-0.6b", 64, 2048, 256, (1 / 4, 1 / 8, 1 / 16), peer_batch=16),
           BeyondVram("qwen3-8b", 32, 4096, 128, (1 / 4, 1 / 8), peer_batch=8, budget_blocks=(QWEN3_8B_ON_24_GIB,)),
           BeyondVram("qwen3-0.6b", 32, 1024, 1024, (1 / 4, 1 / 8), peer_batch=16, name="dh", peers=False),
           BeyondVram("qwen3-8b", 64, 1024, 1024, (1 / 8,), peer_batch=8, name="dh",
                      budget_blocks=(QWEN3_8B_ON_24_GIB,), cpu=False, peers=False)),
        c_model="qwen3-0.6b-256k", c_context=262144, c_output=16, c_budget_tokens=32768),
    "small": Profile(
        name="small", a_model="tiny", a_num_seqs=24, a_range=(16, 96),
        b=(BeyondVram("tiny", 16, 192, 32, (1 / 4, 1 / 8), peer_batch=8),
           # 192 blocks; 20 is an absolute budget, as the 8B's 24 GiB card is in the full profile
           BeyondVram("tiny", 16, 64, 128, (1 / 4,), peer_batch=8, name="dh", budget_blocks=(20,), peers=False)),
        c_model="tiny", c_context=2048, c_output=16, c_budget_tokens=512,
        llm_kwargs=dict(max_num_seqs=32, num_cpu_blocks=256, max_model_len=4096), ceiling_gb=1.0, peer_seconds=20.0),
}
