"""benchmarks/simulate_placement.py drives the real LLMEngine._step, Scheduler and placement with fake lanes: it
must keep up with the engine (it once broke silently when async scheduling added state), and every token of every
request must be decoded once under both policies, with equal lengths and with mixed ones."""
from dataclasses import replace

import pytest

from benchmarks.simulate_placement import COST_MODELS, GRID_SHAPES, SUITE, Point, compare, grid_points, simulate
from benchmarks.workloads import mixed_lengths


@pytest.mark.parametrize("spread", [0.0, 0.5])  # equal lengths, as in the suite, and mixed ones
@pytest.mark.parametrize("blocks", [40, 24])  # tight enough that gpu recomputes and auto demotes and promotes
def test_both_policies_decode_every_token_through_the_real_scheduler(blocks, spread):
    point = Point("qwen3-0.6b", num_seqs=12, prompt_len=96, output_len=48, num_gpu_blocks=blocks, spread=spread)
    result = compare(point)
    prompts, outputs = point.lengths
    assert (len(set(outputs)) > 1) == bool(spread)
    for policy in ("gpu", "auto"):
        run = result[policy]
        # The first token of a request, and again after each recompute, comes from its prefill.
        prefill_tokens = point.num_seqs + run["recomputes"]
        assert run["device_tokens"] + run["host_tokens"] + prefill_tokens == sum(outputs)
        assert run["seconds"] > 0
    assert result["gpu"]["host_tokens"] == 0 and result["gpu"]["recomputes"] > 0
    assert result["auto"]["recomputes"] == 0 and result["auto"]["host_tokens"] > 0
    assert result["auto"]["promotions"] > 0


def test_mixed_lengths_spread_around_their_means_and_repeat():
    prompts, outputs = mixed_lengths(400, 1000, 200, spread=0.5)
    assert min(prompts) >= 500 and max(prompts) <= 1500 and min(outputs) >= 100 and max(outputs) <= 300
    assert abs(sum(prompts) / 400 - 1000) < 50 and max(prompts) - min(prompts) > 800  # spread out, mean kept
    assert (prompts, outputs) == mixed_lengths(400, 1000, 200, spread=0.5)  # the replay and the device agree
    assert mixed_lengths(3, 10, 4) == ([10] * 3, [4] * 3)
    with pytest.raises(ValueError, match="spread"):
        mixed_lengths(3, 10, 4, spread=1.0)


def test_a_cost_per_host_step_slows_only_the_device_steps_beside_host_steps():
    point = Point("qwen3-0.6b", num_seqs=12, prompt_len=96, output_len=48, num_gpu_blocks=24)
    free, costly = compare(point, device_ms_per_host_step=0.0), compare(point, device_ms_per_host_step=20.0)
    assert costly["gpu"] == free["gpu"]  # no host lane, nothing to slow
    assert costly["auto"]["seconds"] > free["auto"]["seconds"]


def test_the_grid_holds_the_suite_and_each_shape_at_three_budgets_and_two_spreads():
    points = grid_points()
    assert points[: len(SUITE)] == list(SUITE) and len(points) == len(SUITE) + 6 * len(GRID_SHAPES) + 4
    decode_heavy_8b = [p for p in points if (p.model, p.num_seqs, p.prompt_len, p.output_len) == ("qwen3-8b", 64,
                                                                                                   1024, 1024)]
    # 64 x 128 blocks of 16 tokens: halves, quarters and eighths, each at both spreads, and the suite's two budgets.
    assert sorted({(p.num_gpu_blocks, p.spread) for p in decode_heavy_8b}) == sorted(
        {(blocks, spread) for blocks in (4096, 2048, 1024) for spread in (0.0, 0.5)} | {(3296, 0.0)})


def test_a_prefill_step_takes_its_tokens_time_but_no_less_than_the_fixed_floor():
    # One prefill step of 2 x 64 tokens (the max_num_batched_tokens budget holds both), at 1,000 tokens a second:
    # 0.128 s of arithmetic. A floor below it changes nothing; one above it replaces it (not adds to it).
    point = Point("qwen3-0.6b", num_seqs=2, prompt_len=64, output_len=8, num_gpu_blocks=64)
    slow = replace(COST_MODELS[point.model], prefill_tok_s=1000.0, graph_prefill_tokens=0)  # eager steps
    seconds = {fixed: simulate("gpu", point, replace(slow, prefill_fixed_s=fixed))["seconds"]
               for fixed in (0.0, 0.1, 1.0)}
    assert seconds[0.1] == seconds[0.0]
    assert seconds[1.0] == pytest.approx(seconds[0.0] + 1.0 - 0.128, abs=0.011)


def test_a_prefill_step_within_the_graph_bucket_takes_the_graph_cost():
    # The same 128-token step: a graph's fixed cost adds to its tokens' time (0.5 + 0.128 s against the eager 0.128);
    # a step past the largest bucket (64 tokens) stays eager.
    point = Point("qwen3-0.6b", num_seqs=2, prompt_len=64, output_len=8, num_gpu_blocks=64)
    slow = replace(COST_MODELS[point.model], prefill_tok_s=1000.0, prefill_fixed_s=0.0, graph_prefill_fixed_s=0.5,
                   graph_prefill_tok_s=1000.0)
    seconds = {tokens: simulate("gpu", point, replace(slow, graph_prefill_tokens=tokens))["seconds"]
               for tokens in (0, 64, 256)}
    assert seconds[64] == seconds[0]
    assert seconds[256] == pytest.approx(seconds[0] + 0.5, abs=0.011)
