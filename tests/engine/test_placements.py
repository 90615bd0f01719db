"""Greedy tokens equal transformers' for every architecture in every KV placement, on TEST_DEVICE.

"gpu" keeps every sequence's KV in the device pool and "cpu" every one in the host pool; "auto" gets a device
pool too small for the batch, so the first sequences take it and the rest go to the host pool. Prompts sit
at, just before and just past the 16-token block boundaries of both pools, and in "auto" each tier gets some
of each: budgets (prompt + 10 new tokens) of 1, 2 and 3 blocks fill the 6-block device pool exactly.
"""
import pytest

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

LENGTHS = (1, 16, 33, 15, 17, 47)  # device: 1, 16, 33; host: 15, 17, 47 under "auto"
NEW_TOKENS = 10
# Every placement gets both pool sizes explicitly: a CUDA engine would otherwise size its device pool from
# free GPU memory, and "gpu" makes no host pool at all.
POOLS = {
    "gpu": dict(num_gpu_blocks=32),
    "cpu": dict(num_gpu_blocks=4, num_cpu_blocks=32, cpu_block_size=16),
    "auto": dict(num_gpu_blocks=6, num_cpu_blocks=32, cpu_block_size=16),
}
TIERS = {"gpu": {"gpu"}, "cpu": {"cpu"}, "auto": {"gpu", "cpu"}}


@pytest.mark.parametrize("placement", ["gpu", "cpu", "auto"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_greedy_matches_transformers_in_every_placement(tiny_models, arch, placement):
    model_dir = tiny_models[arch]
    prompts = random_prompts(LENGTHS, 256, seed=70)
    llm = LLM(model_dir, device=TEST_DEVICE, kv_placement=placement, **POOLS[placement])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert {o.kv_location for o in outputs} == TIERS[placement]
    for output, ref, n in zip(outputs, hf_greedy(model_dir, prompts, NEW_TOKENS), LENGTHS):
        assert output.token_ids == ref, f"prompt of {n} tokens, KV on {output.kv_location}"
    llm.close()
