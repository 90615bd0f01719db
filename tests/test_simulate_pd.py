"""The placement replay with a prefill lane (benchmarks/simulate_pd.py): at the suite's prefill-heavy point, where the
decode device's room is the constraint, PD admits no more requests to the host tier and demotes no more than one
GPU does (issue 61: "PD must not demote more than one GPU would")."""
import pytest

from benchmarks.simulate_pd import simulate
from benchmarks.simulate_placement import Point


@pytest.mark.real_cost_check  # the placement checks are what this is about: not pinned to "pays"
def test_pd_admits_to_the_host_tier_and_demotes_no_more_than_one_gpu():
    point = Point("qwen3-0.6b", 64, 2048, 256, 2304)
    one, pd = simulate("auto", point, pd=False), simulate("auto", point, pd=True)
    assert pd["host_admissions"] <= one["host_admissions"]
    assert pd["demotions"] <= one["demotions"]
    assert pd["lane_steps"] > 0 and pd["host_tokens"] <= one["host_tokens"]
