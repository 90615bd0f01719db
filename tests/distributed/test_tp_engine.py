"""Two ranks (gloo, two processes) give transformers' greedy tokens for every architecture in every KV placement,
with the paths each placement has: preemption, chunked prefill and prefix-cache hits ("gpu"); the host lane alone,
layer-major prefill segments included ("cpu"); demotion, promotion and a sequence split across both tiers ("auto").
Sampled tokens are those of one rank, token for token. Each engine runs several checks: starting one costs seconds."""
import pytest
import torch

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

# Two ranks on CUDA need two GPUs (make test-gpu on a one-GPU host skips these; CI runs them on gloo).
pytestmark = pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="tensor_parallel_size=2 on CUDA needs two GPUs")

LENGTHS = (1, 16, 33, 15, 17, 47)
NEW_TOKENS = 10
ENGINES = {
    # 14 blocks of budget for 7: rows are preempted and recomputed; prompts over 24 tokens prefill in chunks.
    "gpu": dict(num_gpu_blocks=7, max_num_batched_tokens=24),
    # A 130-token prompt runs in layer-major segments of 100 tokens, in chunks of 40 (engine/runner/prefill_segment.py).
    "cpu": dict(num_gpu_blocks=4, num_cpu_blocks=32, cpu_block_size=32, max_num_batched_tokens=40,
                prefill_segment_tokens=100),
    # Rows outgrow the 8-block device pool (demoted) and move back up once room frees (promoted); a 150-token
    # prompt does not fit it at all and is split across the tiers.
    "auto": dict(num_gpu_blocks=8, num_cpu_blocks=40, cpu_block_size=16),
}
MOVES = dict(lengths=(30, 31, 29, 30, 5), max_tokens=(4, 30, 30, 30, 40))


def _greedy_check(llm, model_dir, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, ref, n in zip(outputs, hf_greedy(model_dir, prompts, max(max_tokens)), max_tokens):
        assert len(output.token_ids) == n
        where = f"prompt of {len(output.prompt_token_ids)} on {output.kv_location}"
        assert output.token_ids[: len(ref)] == ref[:n], where
    return outputs


@pytest.mark.parametrize("placement", ["gpu", "cpu", "auto"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_two_ranks_match_transformers(tiny_models, arch, placement):
    model_dir = tiny_models[arch]
    llm = LLM(model_dir, device=TEST_DEVICE, kv_placement=placement, tensor_parallel_size=2, **ENGINES[placement])
    prompts = random_prompts(LENGTHS, 256, seed=70)
    outputs = _greedy_check(llm, model_dir, prompts, [NEW_TOKENS] * len(LENGTHS))
    scheduler = llm.engine.scheduler
    if placement == "gpu":
        assert scheduler.num_preemptions > 0
        hits = llm.engine.blocks.num_prefix_hit_tokens
        _greedy_check(llm, model_dir, prompts, [NEW_TOKENS] * len(LENGTHS))  # again: prefixes come from the cache
        assert llm.engine.blocks.num_prefix_hit_tokens > hits
    if placement == "cpu":
        assert {o.kv_location for o in outputs} == {"cpu"}
        _greedy_check(llm, model_dir, random_prompts((130,), 256, seed=103), [NEW_TOKENS])
    if placement == "auto":
        _greedy_check(llm, model_dir, random_prompts(MOVES["lengths"], 256, seed=101), MOVES["max_tokens"])
        assert scheduler.num_demotions > 0 and scheduler.num_promotions > 0
        split = _greedy_check(llm, model_dir, random_prompts((150,), 256, seed=102), [NEW_TOKENS])
        assert split[0].kv_location == "split"
    for pool in (llm.engine.blocks.pool(tier) for tier in llm.engine.blocks.pools):
        assert pool.num_free == pool.num_blocks
    llm.close()


def test_sampling_on_two_ranks_equals_one_rank(qwen3_dir):
    """Unseeded rows draw from the engine's seed, seeded ones from their own; top-k and top-p filter the whole
    gathered vocabulary. "gpu" placement: the steps, and so the draws, do not depend on timing."""
    prompts = random_prompts((12, 30, 7, 21), 256, seed=18)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=12, ignore_eos=True)]
    tokens = {}
    for ranks in (1, 2):
        with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", num_gpu_blocks=32, seed=5,
                 tensor_parallel_size=ranks) as llm:
            tokens[ranks] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[2] == tokens[1]


def test_a_split_rows_device_part_grows_on_two_ranks(tiny_models):
    """tests/engine/test_split_sequences.py's growth on two ranks: a 20-token request ends early, and the split row's
    device part takes over one of its host blocks on every rank (the growth crosses the wire as a move)."""
    model_dir = tiny_models["llama"]
    prompts = random_prompts([20, 150], 256, seed=96)
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=40)]
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=8, num_cpu_blocks=64,
             cpu_block_size=32, max_num_batched_tokens=40, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_split_growths >= 1
    assert [o.kv_location for o in outputs] == ["gpu", "split"]
    refs = hf_greedy(model_dir, prompts[:1], 4) + hf_greedy(model_dir, prompts[1:], 40)
    assert [o.token_ids for o in outputs] == refs


def test_host_steps_stream_a_share_on_two_ranks(tiny_models, share=0.5):
    """Every rank streams its heads' share of the same blocks (the share crosses with the host step's call) and the
    CPU kernel attends the rest: host rows stay exact."""
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts([17, 47, 150], 256, seed=125)
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=64,
             cpu_block_size=16, max_num_batched_tokens=64, tensor_parallel_size=2) as llm:
        llm.engine.stream.fixed = share
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert llm.engine.stats.stream_bytes > 0
    assert {"cpu", "split"} & {o.kv_location for o in outputs}
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, NEW_TOKENS)
