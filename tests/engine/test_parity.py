"""Greedy tokens equal transformers' generate, whatever the batching, chunking, caching or preemption."""
import pytest

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

LENGTHS = (1, 15, 16, 17, 33, 100)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def _check(llm, model_dir, prompts, params=GREEDY):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(model_dir, prompts, params.max_tokens)
    assert [o.prompt_token_ids for o in outputs] == prompts  # batch order kept
    for output, ref in zip(outputs, expected):
        assert output.token_ids == ref
        assert output.finish_reason in ("stop", "length")
    return outputs


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_greedy_matches_transformers(tiny_models, arch):
    model_dir = tiny_models[arch]
    llm = LLM(model_dir, device=TEST_DEVICE, kv_placement="gpu")
    _check(llm, model_dir, random_prompts(LENGTHS, 256, seed=10))


def test_tied_embeddings(tmp_path):
    from offload_engine.tiny_model import build_tiny_model
    from tests.conftest import PARITY_SHAPE

    model_dir = build_tiny_model(str(tmp_path / "tied"), "qwen3", seed=5, with_tokenizer=False,
                                 tie_word_embeddings=True, **PARITY_SHAPE)
    _check(LLM(model_dir, device=TEST_DEVICE), model_dir, random_prompts((7, 40), 256, seed=11))


def test_chunked_prefill_and_prefix_cache_hits(qwen3_dir):
    shared = random_prompts((48,), 256, seed=12)[0]
    tails = random_prompts((5, 17, 1), 256, seed=13)
    prompts = [shared + t for t in tails] + random_prompts((100,), 256, seed=14)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", max_num_batched_tokens=24)
    _check(llm, qwen3_dir, prompts)
    hits_before = llm.engine.blocks.num_prefix_hit_tokens
    _check(llm, qwen3_dir, prompts)  # second round: whole prompts come from the cache
    assert llm.engine.blocks.num_prefix_hit_tokens - hits_before >= 3 * 48


def test_preemption_under_tiny_pool_completes_every_request(qwen3_dir):
    prompts = random_prompts((30, 31, 29, 17, 5, 40), 256, seed=15)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", num_gpu_blocks=6, block_size=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outputs)
    expected = [hf_greedy(qwen3_dir, [p], 20)[0] for p in prompts]
    for output, ref in zip(outputs, expected):
        assert output.token_ids[: len(ref)] == ref  # transformers stops at eos; ignore_eos goes on


def test_max_model_len_stops_with_length(qwen3_dir):
    llm = LLM(qwen3_dir, device=TEST_DEVICE, max_model_len=40)
    out = llm.generate([random_prompts((35,), 256, seed=16)[0]],
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40
    assert out.finish_reason == "length"


def test_string_prompts_decode_text(text_model_dir):
    llm = LLM(text_model_dir, device=TEST_DEVICE)
    outputs = llm.generate(["The quick brown fox", "offload"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["The quick brown fox", "offload"]
    assert all(isinstance(o.text, str) and o.kv_location == "gpu" for o in outputs)
    assert outputs[0].token_ids == hf_greedy(text_model_dir, [outputs[0].prompt_token_ids], 5)[0]


def test_stop_token_ids_end_a_request_with_stop(qwen3_dir):
    prompt = random_prompts((20,), 256, seed=17)
    llm = LLM(qwen3_dir, device=TEST_DEVICE)
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    stop = full.token_ids[3]
    first = full.token_ids.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_across_batches(qwen3_dir):
    prompts = random_prompts((12, 30, 7), 256, seed=18)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=3, num_cpu_blocks=16,
              cpu_block_size=16)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    alone = llm.generate(prompts[1:2], seeded, use_tqdm=False)[0].token_ids
    batched = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), seeded,
                                     SamplingParams(temperature=0.5, max_tokens=5)], use_tqdm=False)[1].token_ids
    assert alone == batched and len(alone) == 12
