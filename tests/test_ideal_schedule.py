"""benchmarks/ideal_schedule.py: the idealized schedule must charge exactly the cost model's steps, decode every
token once, and answer to the lane costs it is given (the grid is only worth something if it does)."""
from dataclasses import replace

import pytest

from benchmarks.ideal_schedule import IdealSchedule, ideal_run
from benchmarks.simulate_placement import COST_MODELS, Point

COST = COST_MODELS["qwen3-0.6b"]


def test_a_pool_that_holds_every_request_costs_prefill_plus_each_full_step():
    point = Point("qwen3-0.6b", num_seqs=6, prompt_len=40, output_len=9, num_gpu_blocks=10_000)
    schedule = IdealSchedule(point, COST, min_host_rows=1)
    run = schedule.run()
    # Independently: one prefill of every prompt, then output_len - 1 steps of all rows, their KV one token longer
    # each step.
    expected = point.num_seqs * point.prompt_len / COST.prefill_tok_s
    for step in range(point.output_len - 1):
        kv_bytes = point.num_seqs * (point.prompt_len + step) * COST.kv_bytes
        expected += COST.dev_fixed + COST.dev_row * point.num_seqs + kv_bytes / COST.kv_bw
    assert schedule.clock == pytest.approx(expected, rel=1e-9)
    assert (run["moves"], run["host_steps"], run["device_steps"]) == (0, 0, point.output_len - 1)


@pytest.mark.parametrize("spread", [0.0, 0.5])
def test_a_tight_pool_moves_rows_and_decodes_every_token_once(spread):
    point = Point("qwen3-0.6b", num_seqs=12, prompt_len=96, output_len=48, num_gpu_blocks=40, spread=spread)
    schedule = IdealSchedule(point, COST, min_host_rows=1)
    run = schedule.run()
    prompts, outputs = point.lengths
    assert run["device_tokens"] + run["host_tokens"] == sum(outputs) - point.num_seqs  # first tokens: prefill
    assert all(row.steps_left == 0 and row.decoded == output - 1 for row, output in zip(schedule.rows, outputs))
    assert run["moves"] > 0 and run["host_steps"] > 0


def test_the_schedule_answers_to_the_host_lanes_costs():
    point = Point("qwen3-0.6b", num_seqs=12, prompt_len=96, output_len=48, num_gpu_blocks=40)
    free_lane = replace(COST, host_fixed=0.0, host_per_gb=1e-6, device_s_per_host_step=0.0)
    no_lane = IdealSchedule(point, free_lane, min_host_rows=10**6).run()  # steps only when the device has no rows
    assert ideal_run(point, free_lane)["seconds"] < no_lane["seconds"]
    costly = replace(free_lane, device_s_per_host_step=0.05)
    assert ideal_run(point, costly)["seconds"] > ideal_run(point, free_lane)["seconds"]


def test_a_host_steps_device_cost_is_a_constant_factor_or_fixed_seconds_spread_over_it():
    assert COST.busy_factor(0.1) == COST.busy_factor(0.01) == COST.busy
    per_step = replace(COST, device_s_per_host_step=0.003)
    assert per_step.busy_factor(0.1) == pytest.approx(1.03)
    assert per_step.busy_factor(0.03) == pytest.approx(1.1)
