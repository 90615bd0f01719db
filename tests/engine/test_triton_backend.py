"""The engine on our Triton kernels (natively on CUDA, interpreted on the CPU), mixed tiers included, against
transformers."""
import os

import pytest

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(TEST_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on the CPU needs the interpreter (TRITON_INTERPRET=1)")


def test_mixed_tiers_on_triton_kernels(qwen3_dir, monkeypatch):
    if TEST_DEVICE == "cpu":
        # Triton's interpreter runs one kernel at a time (it patches triton.language while one runs): a row promoted
        # in parts decodes its device part on the host lane's thread, beside the device lane's kernels.
        monkeypatch.setenv("OFFLOAD_ENGINE_PROMOTE_IN_PARTS", "0")
    prompts = random_prompts((1, 17, 40, 30, 16), 256, seed=40)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="triton", kv_placement="auto", num_gpu_blocks=7,
              num_cpu_blocks=16, cpu_block_size=16, max_num_batched_tokens=48)  # chunked: staged prefixes too
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 6)):
        assert output.token_ids == ref
