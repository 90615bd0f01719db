"""Layer-major prefill segments (engine/runner/prefill_segment.py): a host-tier or split prompt longer than one step's
budget runs many chunks per step, layer by layer, and stages its prefix once per segment instead of once per
chunk. Greedy tokens must still equal transformers', and the staging traffic must shrink as promised.

Chunks are 40 tokens (max_num_batched_tokens), host blocks 32, so chunk ends fall inside host blocks; segments
of 100 tokens end inside blocks too, so the next segment's prefix includes a half-written block.
"""
import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.layers.attention import Attention
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

NEW_TOKENS = 10
POOLS = dict(num_gpu_blocks=6, num_cpu_blocks=64, cpu_block_size=32, max_num_batched_tokens=40)


def _generate(model_dir, prompts, **kwargs):
    with LLM(model_dir, device=TEST_DEVICE, **{**POOLS, **kwargs}) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        # Sized automatically here, it is max_model_len: the CPU has far more room than that takes.
        assert llm.engine.runner.segment_tokens == (kwargs.get("prefill_segment_tokens") or llm.max_model_len)
        return outputs


@pytest.fixture
def staged_blocks(monkeypatch):
    """Counts the host blocks and device-part blocks every layer stages (whatever the path)."""
    counts = {"host": 0, "device": 0}
    gather_host, gather_device = Attention._gather_host_blocks, Attention._gather_device_parts

    def host(self, pool, source_blocks, into):
        counts["host"] += source_blocks.numel()
        return gather_host(self, pool, source_blocks, into)

    def device(pool, source, into):
        counts["device"] += source.numel()
        return gather_device(pool, source, into)

    monkeypatch.setattr(Attention, "_gather_host_blocks", host)
    monkeypatch.setattr(Attention, "_gather_device_parts", staticmethod(device))
    return counts


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("segment_tokens", [100, None])
def test_host_tier_prompts_in_segments(tiny_models, arch, segment_tokens, staged_blocks):
    """Prompts of 250 and 41 tokens wholly on the host tier. With segments of 100 tokens the long one takes
    segments of 100, 100 and 50 (in chunks of 40), its second and third staging the 100 and 200 tokens before
    them once a layer: 4 + 7 host blocks. Sized automatically, the whole prompt is one segment and nothing is
    staged. The 41-token prompt is one segment of two chunks either way."""
    model_dir = tiny_models[arch]
    prompts = random_prompts([250, 41], 256, seed=101)
    outputs = _generate(model_dir, prompts, kv_placement="cpu", prefill_segment_tokens=segment_tokens)
    assert staged_blocks["host"] == ((4 + 7) * 4 if segment_tokens else 0)  # 2 layers, K and V
    for output, ref in zip(outputs, hf_greedy(model_dir, prompts, NEW_TOKENS)):
        assert output.kv_location == "cpu" and output.token_ids == ref


def test_chunked_host_prefill_restages_every_chunk(tiny_models, staged_blocks):
    """The same 250-token prompt with segments of one chunk (what segment_tokens <= max_num_batched_tokens gives):
    every chunk stages every block before it, 2 + 3 + 4 + 5 + 7 + 8 = 29 host blocks a layer, and stays exact."""
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts([250], 256, seed=101)
    outputs = _generate(model_dir, prompts, kv_placement="cpu", prefill_segment_tokens=40)
    assert staged_blocks["host"] == 29 * 4  # 2 layers, K and V
    assert outputs[0].token_ids == hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


@pytest.mark.parametrize("segment_tokens", [100, None])
def test_split_prompt_in_segments(tiny_models, segment_tokens, staged_blocks):
    """A 300-token prompt split with a 96-token device part (the whole pool). Its first 80 tokens prefill as
    device rows (chunks inside the device part); from there segments of 100 take [80, 180) and [180, 280), the
    first writing device and host slots, and a last chunk of 20 follows; each of the three stages the device
    part (6 device blocks) once a layer. Sized automatically, one segment takes [80, 300)."""
    model_dir = tiny_models["llama"]
    prompts = random_prompts([300], 256, seed=102)
    outputs = _generate(model_dir, prompts, kv_placement="auto", prefill_segment_tokens=segment_tokens)
    assert outputs[0].kv_location == "split" and outputs[0].kv_device_tokens == 96
    segments = 3 if segment_tokens else 1
    assert staged_blocks["device"] == 6 * segments * 4  # 6 device blocks of 16; 2 layers, K and V
    assert outputs[0].token_ids == hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


def test_segments_beside_other_requests_and_prefix_hits(tiny_models):
    """Host-tier segments among short prompts, and a second long prompt that shares the first one's 128 leading
    tokens: its first segment starts after the cached prefix and stages it. Nothing is lost, all exact."""
    model_dir = tiny_models["qwen3"]
    shared = random_prompts([128], 256, seed=103)[0]
    tails = random_prompts([90, 150], 256, seed=104)
    prompts = [shared + tails[0], *random_prompts([5, 33, 61], 256, seed=105), shared + tails[1]]
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="cpu", prefill_segment_tokens=100, **POOLS) as llm:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        first = llm.generate(prompts[:4], params, use_tqdm=False)
        hits_before = llm.engine.blocks.num_prefix_hit_tokens
        second = llm.generate(prompts[4:], params, use_tqdm=False)
        assert llm.engine.blocks.num_prefix_hit_tokens - hits_before == 128
    outputs = first + second
    for output, ref in zip(outputs, hf_greedy(model_dir, prompts, NEW_TOKENS)):
        assert output.token_ids == ref


def test_prefill_segment_tokens_is_validated(qwen3_dir):
    with pytest.raises(ValueError, match="prefill_segment_tokens"):
        LLM(qwen3_dir, device=TEST_DEVICE, prefill_segment_tokens=0)
