"""The host KV tier end to end: greedy tokens still equal transformers' wherever the KV lives."""
from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

LENGTHS = (1, 15, 16, 17, 33, 100)


def _generate(llm, prompts, max_tokens=12, ignore_eos=False):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=False)


def _assert_parity(model_dir, prompts, outputs, max_tokens=12):
    for output, ref in zip(outputs, hf_greedy(model_dir, prompts, max_tokens)):
        assert output.token_ids[: len(ref)] == ref


def test_every_sequence_on_the_host_tier(tiny_models):
    for arch in ("qwen3", "llama"):
        prompts = random_prompts(LENGTHS, 256, seed=30)
        llm = LLM(tiny_models[arch], device=TEST_DEVICE, kv_placement="cpu", cpu_block_size=16, num_cpu_blocks=64)
        outputs = _generate(llm, prompts)
        assert {o.kv_location for o in outputs} == {"cpu"}
        _assert_parity(tiny_models[arch], prompts, outputs)
        llm.close()  # on CUDA its device pool takes most of the free memory: the next engine sizes its own from it


def test_auto_splits_the_batch_across_tiers(qwen3_dir):
    prompts = random_prompts((40, 41, 39, 60, 3, 50), 256, seed=31)
    # Each budget (prompt + 12) needs 4-5 blocks of 16: a 10-block device pool takes two, the host the rest.
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=10, num_cpu_blocks=40,
              cpu_block_size=32)
    outputs = _generate(llm, prompts)
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    _assert_parity(qwen3_dir, prompts, outputs)


def test_sequence_longer_than_the_whole_device_pool_is_split(qwen3_dir):
    """It keeps on the device only what the request queued behind it will not need (2 of 4 blocks), and
    prefills in chunks inside its device part and past it."""
    prompts = random_prompts((150, 20), 256, seed=32)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=4, num_cpu_blocks=16,
              cpu_block_size=16, max_num_batched_tokens=24)
    outputs = _generate(llm, prompts)
    assert [o.kv_location for o in outputs] == ["split", "gpu"]
    _assert_parity(qwen3_dir, prompts, outputs)


def test_more_work_than_both_pools_hold_completes_every_request(qwen3_dir):
    prompts = random_prompts((30,) * 8 + (10,) * 4, 256, seed=33)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=6, cpu_block_size=16)
    outputs = _generate(llm, prompts, max_tokens=16, ignore_eos=True)
    assert all(len(o.token_ids) == 16 for o in outputs)
    _assert_parity(qwen3_dir, prompts, outputs, max_tokens=16)


def test_prefix_reuse_on_the_host_tier(qwen3_dir):
    shared = random_prompts((70,), 256, seed=34)[0]
    prompts = [shared + tail for tail in random_prompts((3, 9, 30), 256, seed=35)]
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="cpu", num_cpu_blocks=64, cpu_block_size=16)
    first = _generate(llm, prompts[:1])
    hits = llm.engine.blocks.num_prefix_hit_tokens
    rest = _generate(llm, prompts[1:])
    assert llm.engine.blocks.num_prefix_hit_tokens - hits >= 2 * 64  # the shared 4 full blocks, twice
    assert {o.kv_location for o in first + rest} == {"cpu"}
    _assert_parity(qwen3_dir, prompts, first + rest)
