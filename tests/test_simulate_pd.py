"""The placement replay with a prefill lane (benchmarks/simulate_pd.py): at the suite's prefill-heavy points, where
the decode device's room is the constraint, PD demotes no more than one GPU does (issue 61: "PD must not demote more
than one GPU would") and is not slower; host-tier prompts prefill on the lane."""
import pytest

from benchmarks.simulate_pd import simulate
from benchmarks.simulate_placement import Point


@pytest.mark.real_cost_check  # the placement checks are what this is about: not pinned to "pays"
@pytest.mark.parametrize("blocks", [2304, 576])
def test_pd_demotes_no_more_than_one_gpu_and_prefills_host_tier_prompts_on_the_lane(blocks):
    point = Point("qwen3-0.6b", 64, 2048, 256, blocks)
    one, pd = simulate("auto", point, pd=False), simulate("auto", point, pd=True)
    assert pd["demotions"] <= one["demotions"] and pd["tok_s"] >= one["tok_s"]
    assert pd["host_admissions"] > 0 and pd["lane_host_prompt_tokens"] > 0 and pd["lane_steps"] > 0
