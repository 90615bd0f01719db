"""The cost check: the host lane takes a sequence only when that is predicted to add tokens per second."""
import pytest

from offload_engine import SamplingParams
from offload_engine.engine.lane_stats import LaneStats
from offload_engine.engine.placement import host_lane_pays, host_step_pays
from offload_engine.engine.sequence import BlockLocation, Sequence

KV_BYTES = 1000  # per token


def _host_seq(num_tokens: int) -> Sequence:
    seq = Sequence(list(range(num_tokens)), SamplingParams(), budget=num_tokens + 8)
    seq.location = BlockLocation.CPU
    return seq


def _measured(fixed: float, per_byte: float) -> LaneStats:
    stats = LaneStats(KV_BYTES)
    for tokens in (1000, 4000, 2000, 8000):
        kernel = per_byte * tokens * KV_BYTES
        stats.host_step(tokens * KV_BYTES, fixed + kernel, kernel)
    return stats


def test_host_step_cost_is_measured_from_kernel_time_not_fitted():
    stats = _measured(fixed=0.01, per_byte=1e-8)
    assert abs(stats.host_step_seconds(5000 * KV_BYTES) - (0.01 + 1e-8 * 5000 * KV_BYTES)) < 1e-9
    assert LaneStats(KV_BYTES).host_step_seconds(10) is None  # nothing measured: nothing predicted
    # Steps that all read the same bytes (a steady batch) still separate the two terms: one step suffices.
    steady = LaneStats(KV_BYTES)
    steady.host_step(3000 * KV_BYTES, 0.02 + 0.03, 0.03)
    assert abs(steady.host_step_seconds(6000 * KV_BYTES) - (0.02 + 0.06)) < 1e-9
    assert abs(steady.host_fixed.value - 0.02) < 1e-12


def test_slowdown_is_busy_over_idle_device_steps():
    stats = LaneStats(KV_BYTES)
    assert stats.slowdown == 1.0
    for _ in range(10):
        stats.device_step_done(rows=8, seconds=0.010, host_busy=False)
        stats.device_step_done(rows=8, seconds=0.011, host_busy=True)
    assert abs(stats.slowdown - 1.1) < 1e-6


def test_slowdown_compares_steps_of_equal_rows_only():
    """Busy steps that are slower only because the device batch is bigger are no slowdown."""
    stats = LaneStats(KV_BYTES)
    for _ in range(20):
        stats.device_step_done(rows=4, seconds=0.005, host_busy=False)
        stats.device_step_done(rows=16, seconds=0.010, host_busy=True)
    assert stats.slowdown == 1.0  # no row count seen both ways yet
    for _ in range(20):
        stats.device_step_done(rows=16, seconds=0.0100, host_busy=False)
        stats.device_step_done(rows=4, seconds=0.0051, host_busy=True)
    assert 1.0 < stats.slowdown < 1.03


def test_unmeasured_host_lane_is_tried():
    assert host_lane_pays(_host_seq(100), [], LaneStats(KV_BYTES))


def test_a_running_host_lane_takes_rows_like_its_own_but_not_a_far_longer_one():
    stats = _measured(fixed=0.02, per_byte=1e-8)
    running = [_host_seq(1000) for _ in range(4)]
    assert host_lane_pays(_host_seq(1000), running, stats)
    # One row of 200k tokens would slow every step of the four others more than its own tokens add.
    assert not host_lane_pays(_host_seq(200_000), running, stats)


def test_starting_the_lane_must_beat_what_it_costs_the_device_lane():
    stats = _measured(fixed=0.02, per_byte=1e-9)  # a host step: 20 ms + 1 ms per row of 1k tokens
    for _ in range(40):
        stats.device_step_done(rows=64, seconds=0.010, host_busy=False)  # ~6,400 tok/s
        stats.device_step_done(rows=64, seconds=0.0105, host_busy=True)  # 5% slower: ~300 tok/s lost
    # One host row of 1k tokens gives ~48 tok/s, five ~200: not worth waking the lane for...
    assert not host_lane_pays(_host_seq(1000), [], stats)
    assert not host_lane_pays(_host_seq(1000), [], stats, joining=[_host_seq(1000) for _ in range(4)])
    # ...but forty waking it together give ~670 tok/s.
    assert host_lane_pays(_host_seq(1000), [], stats, joining=[_host_seq(1000) for _ in range(39)])
    for _ in range(200):  # the host lane stops costing the device lane anything
        stats.device_step_done(rows=64, seconds=0.010, host_busy=True)
    assert host_lane_pays(_host_seq(1000), [], stats)


def test_the_host_lane_steps_only_while_it_pays_with_all_its_rows():
    stats = _measured(fixed=0.02, per_byte=1e-9)  # a host step: 20 ms + 1 ms per row of 1k tokens
    assert host_step_pays([_host_seq(1000)], 64, LaneStats(KV_BYTES))  # nothing measured: the lane is tried
    for _ in range(40):
        stats.device_step_done(rows=64, seconds=0.010, host_busy=False)  # ~6,400 tok/s
        stats.device_step_done(rows=64, seconds=0.0105, host_busy=True)  # 5% slower: ~300 tok/s lost
    few, many = [_host_seq(1000) for _ in range(4)], [_host_seq(1000) for _ in range(40)]
    assert not host_step_pays(few, 64, stats)  # 4 rows in 24 ms: ~170 tok/s
    assert host_step_pays(many, 64, stats)  # 40 rows in 60 ms: ~670 tok/s
    assert host_step_pays(few, 0, stats)  # no device rows: nothing to slow down
    assert not host_step_pays([], 0, stats)
    assert stats.checks[("host_step", False)] == 1 and stats.checks[("host_step", True)] == 1


@pytest.mark.real_cost_check
def test_a_held_back_host_lane_still_finishes_every_request(qwen3_dir, monkeypatch):
    """With the lane's check saying no to every step, host-tier sequences wait for device room (promotion) or
    step once the device lane has no rows: nothing is lost and greedy output stays exact."""
    from offload_engine import LLM
    from offload_engine.engine import placement
    from tests.conftest import TEST_DEVICE
    from tests.oracle import hf_greedy, random_prompts

    monkeypatch.setattr(placement, "host_step_pays", lambda *args: False)
    prompts = random_prompts((30, 31, 29, 30, 33, 20), 256, seed=104)
    refs = hf_greedy(qwen3_dir, prompts, 20)
    for kwargs in ({"kv_placement": "auto", "num_gpu_blocks": 8}, {"kv_placement": "cpu"}):
        llm = LLM(qwen3_dir, device=TEST_DEVICE, num_cpu_blocks=40, cpu_block_size=16, **kwargs)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert len(outputs) == len(prompts)
        for output, ref in zip(outputs, refs):
            assert output.token_ids[: len(ref)] == ref
        assert llm.engine.scheduler.num_preemptions == 0
        llm.close()


@pytest.mark.real_cost_check
def test_overflow_is_demoted_even_where_the_host_lane_costs_more_than_it_adds(qwen3_dir):
    """As measured here the host lane is slow (1 s a step) and halves the device lane's speed, so the cost check
    keeps waiting requests off the idle lane (test_starting_the_lane_must_beat_what_it_costs_the_device_lane). Overflow
    during decode is still demoted, not recomputed, while the host pool has room: the alternative to a demotion
    is a recompute, not a wait (placement.demotes). Output stays exact."""
    from offload_engine import LLM
    from tests.conftest import TEST_DEVICE
    from tests.oracle import hf_greedy, random_prompts

    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=8, num_cpu_blocks=40,
              cpu_block_size=16)
    stats = llm.engine.stats
    for tokens in (100, 400):
        stats.host_step(tokens * stats.kv_bytes_per_token, 1.0 + tokens * 1e-4, tokens * 1e-4)
    for _ in range(64):
        stats.device_step_done(rows=4, seconds=0.01, host_busy=False)
        stats.device_step_done(rows=4, seconds=0.02, host_busy=True)
    prompts = random_prompts((30, 31, 29, 30, 33, 20), 256, seed=103)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert stats.checks[("admit", False)] >= 1  # the idle lane was not woken for a waiting request
    assert stats.checks[("host_step", False)] >= 1  # nor did it step for its demoted rows beside the device's
    assert llm.engine.scheduler.num_demotions >= 1 and llm.engine.scheduler.num_preemptions == 0
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 20)):
        assert output.token_ids[: len(ref)] == ref
    llm.close()


@pytest.mark.real_cost_check
def test_only_requests_that_could_run_count_as_joining_the_host_lane():
    """A queue of forty behind max_num_seqs=4 must not talk the check into waking the lane for one row."""
    from offload_engine.engine.block_manager import BlockManager
    from offload_engine.engine.scheduler import Scheduler

    stats = _measured(fixed=0.02, per_byte=1e-9)
    for _ in range(40):
        stats.device_step_done(rows=64, seconds=0.010, host_busy=False)
        stats.device_step_done(rows=64, seconds=0.0105, host_busy=True)
    # 64 device blocks hold one request's budget (63 blocks): the first goes to the device, the rest ask the check.
    scheduler = Scheduler(BlockManager(64, 16, 400, 16, False), "auto", max_num_seqs=4, max_num_batched_tokens=4096,
                          max_model_len=2048, eos_token_ids=(), stats=stats)
    for _ in range(40):
        scheduler.add(Sequence(list(range(1000)), SamplingParams(), budget=1008))
    assert len(list(scheduler._could_join())) == 4
    assert host_lane_pays(_host_seq(1000), [], stats, joining=[_host_seq(1000) for _ in range(39)])
    assert not host_lane_pays(_host_seq(1000), [], stats, joining=scheduler._could_join())
    batch = scheduler.schedule_prefill()
    assert [s.location for s in batch] == [BlockLocation.GPU]  # the rest wait, as under "gpu"
    assert stats.checks[("admit", False)] == 1
