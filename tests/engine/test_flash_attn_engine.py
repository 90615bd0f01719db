"""The engine on flash-attn 4, in bfloat16, in every placement: each token it generates is one that transformers in
float32 ranks at the top, within bfloat16's rounding, when the engine's own output is fed back through transformers
(greedy tokens themselves may part at near-ties between the two precisions).

flash-attn serves forced, and under "auto" with its long-prefill threshold lowered to one block so that the tests'
short prompts reach it. Placements: device, host, both tiers, and split rows (their prompts prefill in layer-major
segments over a staged cache). CUDA with flash-attn 4 installed only (`make test-gpu` on a Hopper host)."""
import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.layers import attention_backends
from offload_engine.layers.flash_attn_backend import FlashAttn4
from offload_engine.tiny_model import build_tiny_model
from tests.conftest import PARITY_SHAPE, TEST_DEVICE
from tests.oracle import _hf_model, random_prompts

RUNS = TEST_DEVICE == "cuda" and attention_backends.flash_attn_version(torch.device("cuda")) == 4
pytestmark = pytest.mark.skipif(not RUNS, reason="flash-attn 4 on a Hopper GPU (OFFLOAD_ENGINE_TEST_DEVICE=cuda)")

NEW_TOKENS = 10
PLACEMENTS = {  # lengths at, before and past the 16-token blocks; "split" prefills in chunks of 40 tokens
    "gpu": ((1, 16, 33, 15, 17, 47), dict(kv_placement="gpu", num_gpu_blocks=32)),
    "cpu": ((1, 16, 33, 15, 17, 47), dict(kv_placement="cpu", num_gpu_blocks=4, num_cpu_blocks=32)),
    "auto": ((1, 16, 33, 15, 17, 47), dict(kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=32)),
    "split": ((10, 150, 97), dict(kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=64, cpu_block_size=32,
                                  max_num_batched_tokens=40)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 with heads of 64, a size real models have."""
    return build_tiny_model(str(tmp_path_factory.mktemp("fa4") / "qwen3"), "qwen3", seed=5, with_tokenizer=False,
                            **{**PARITY_SHAPE, "head_dim": 64})


def worst_gap(model_dir: str, prompt: list[int], tokens: list[int]) -> float:
    """How far below the reference's best logit the engine's tokens fall, teacher-forced, over the logits' scale."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return ((logits.max(-1).values - chosen) / logits.abs().max(-1).values).max().item()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("backend", ["flash-attn", "auto"])
def test_tokens_are_transformers_top_choices_in_every_placement(model_dir, backend, placement, monkeypatch):
    calls = []
    real = FlashAttn4.paged_prefill_attention
    monkeypatch.setattr(FlashAttn4, "paged_prefill_attention", staticmethod(lambda *a: calls.append(1) or real(*a)))
    monkeypatch.setitem(attention_backends.AUTO_CHOICE, "long_prefill_keys", 16)
    lengths, pools = PLACEMENTS[placement]
    prompts = random_prompts(lengths, PARITY_SHAPE["vocab_size"], seed=63)
    with LLM(model_dir, device="cuda", dtype="bfloat16", attention_backend=backend, **pools) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert calls, "flash-attn 4 served no prefill"
    if placement == "split":
        assert "split" in {o.kv_location for o in outputs}
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        assert worst_gap(model_dir, prompt, output.token_ids) < 0.03, f"prompt of {len(prompt)} on {output.kv_location}"
