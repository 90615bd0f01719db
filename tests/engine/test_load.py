"""Load: a few hundred mixed requests through one engine whose device and host pools are both tight.

Both pools fill, host-tier sequences are preempted and recomputed, others are promoted to the device pool,
and still every request completes: greedy ones with transformers' tokens, seeded ones with the tokens they
get alone, and the engine ends empty with every block of both pools free.
"""
import random

import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.engine.sched import placement
from offload_engine.engine.sequence import BlockLocation
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

NUM_REQUESTS = 300
VOCAB = 256
BOUNDARY_LENGTHS = (1, 15, 16, 17, 32, 33)
MAX_PROMPT, MAX_TOKENS = 120, 30
LARGEST_BUDGET_BLOCKS = -(-(MAX_PROMPT + MAX_TOKENS) // 16)
# The device pool holds about 3 of the largest requests and the host pool about 5, while max_num_seqs lets 16
# run: both pools fill, the host tier preempts, and prompts over 96 tokens (or joining a busy step) are chunked.
POOLS = dict(num_gpu_blocks=32, num_cpu_blocks=48, cpu_block_size=16, max_num_seqs=16, max_num_batched_tokens=96)


def _mixed_params(rng: random.Random, count: int) -> list[SamplingParams]:
    """Greedy, seeded, unseeded, top-k and top-p requests in turn, with varied max_tokens, eos and stops."""
    params = []
    for i in range(count):
        kind = ("greedy", "seeded", "greedy", "unseeded", "top_k", "top_p")[i % 6]
        sampling = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.8, seed=1000 + i),
                    "unseeded": dict(temperature=1.0), "top_k": dict(temperature=0.9, top_k=rng.choice((1, 5, 40))),
                    "top_p": dict(temperature=1.1, top_p=rng.choice((0.3, 0.9)), seed=rng.choice((None, 2000 + i)))}
        stop = tuple(rng.sample(range(VOCAB), 8)) if rng.random() < 0.2 else None
        params.append(SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=rng.random() < 0.4,
                                     stop_token_ids=stop, **sampling[kind]))
    return params


@pytest.fixture(scope="module")
def load(qwen3_dir):
    """One engine, one generate call over the whole mix; records the fewest free blocks each pool had."""
    rng = random.Random(9)
    lengths = list(BOUNDARY_LENGTHS * 3)
    lengths += [rng.randint(1, MAX_PROMPT) for _ in range(NUM_REQUESTS - len(lengths))]
    rng.shuffle(lengths)
    prompts = random_prompts(lengths, VOCAB, seed=90)
    params = _mixed_params(rng, NUM_REQUESTS)
    # The cost check pinned to "pays", as conftest pins it for each test: a module fixture is made before that.
    patch = pytest.MonkeyPatch()
    patch.setattr(placement, "host_lane_pays", lambda *args, **kwargs: True)
    patch.setattr(placement, "host_step_pays", lambda host_rows, *args: bool(host_rows))
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", **POOLS)
    pools = {tier: llm.engine.blocks.pool(tier) for tier in (BlockLocation.GPU, BlockLocation.CPU)}
    fewest_free = {tier: pool.num_blocks for tier, pool in pools.items()}
    step = llm.engine.step

    def watched_step():
        stats = step()
        for tier, pool in pools.items():
            fewest_free[tier] = min(fewest_free[tier], pool.num_free)
        return stats

    llm.engine.step = watched_step
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.step = step
    patch.undo()
    yield llm, prompts, params, outputs, fewest_free
    llm.close()


def test_every_request_completes_in_prompt_order(load):
    _, prompts, params, outputs, _ = load
    assert len(outputs) == NUM_REQUESTS
    assert [o.prompt_token_ids for o in outputs] == prompts
    for output, p in zip(outputs, params):
        assert output.finish_reason in ("stop", "length")
        assert 1 <= len(output.token_ids) <= p.max_tokens
        assert all(0 <= t < VOCAB for t in output.token_ids)
        if output.finish_reason == "length" or (p.ignore_eos and not p.stop_token_ids):
            assert len(output.token_ids) == p.max_tokens
        if p.stop_token_ids and output.token_ids[-1] in p.stop_token_ids:
            assert output.finish_reason == "stop"


def _expected_greedy(ref: list[int], params: SamplingParams) -> tuple[list[int], bool]:
    """transformers' greedy tokens as the engine must give them, and whether they are the whole output: a
    stop token ends both; eos ends transformers' but an ignore_eos request goes on past it."""
    for i, token in enumerate(ref):
        if token in params.stop_token_ids:
            return ref[: i + 1], True
    return ref, not params.ignore_eos or len(ref) == params.max_tokens


def test_greedy_requests_match_transformers(load, qwen3_dir):
    _, prompts, params, outputs, _ = load
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert len(greedy) == NUM_REQUESTS // 3
    for i in greedy:
        ref, whole = _expected_greedy(hf_greedy(qwen3_dir, [prompts[i]], params[i].max_tokens)[0], params[i])
        got = outputs[i].token_ids
        assert (got == ref) if whole else (got[: len(ref)] == ref), f"request {i}, prompt of {len(prompts[i])}"


def test_both_tiers_filled_preempted_and_promoted_then_emptied(load):
    llm, _, _, outputs, fewest_free = load
    # At some step neither pool had room left for one more of the largest requests.
    assert all(free < LARGEST_BUDGET_BLOCKS for free in fewest_free.values()), fewest_free
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.num_promotions > 0
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    assert any(o.kv_promoted for o in outputs)
    assert not llm.engine.has_work()
    for tier in (BlockLocation.GPU, BlockLocation.CPU):
        assert llm.engine.blocks.pool(tier).num_free == llm.engine.blocks.pool(tier).num_blocks


def test_seeded_requests_give_the_same_tokens_alone(load):
    """A seeded request's tokens depend on its seed alone: not on the batch, the chunking of its prompt, its
    tier, or a preemption, so running it alone afterwards through the same engine gives the same tokens."""
    llm, prompts, params, outputs, _ = load
    seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy][:5]
    assert len(seeded) == 5
    for i in seeded:
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False)[0]
        assert alone.token_ids == outputs[i].token_ids, f"request {i}, prompt of {len(prompts[i])}"
    for tier in (BlockLocation.GPU, BlockLocation.CPU):
        assert llm.engine.blocks.pool(tier).num_free == llm.engine.blocks.pool(tier).num_blocks
