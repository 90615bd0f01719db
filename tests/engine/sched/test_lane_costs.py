"""The cost check: the host lane takes a sequence only when that is predicted to add tokens per second."""
import pytest

from offload_engine import SamplingParams
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.host_stay import host_gain_seconds
from offload_engine.engine.sched.lane_stats import WINDOW, LaneStats
from offload_engine.engine.sched.placement import HOST_PROBE_STEPS, MIN_PREFILL_SAMPLES, host_lane_pays, host_step_pays
from offload_engine.engine.sequence import BlockLocation, Sequence

KV_BYTES = 1000  # per token


def _host_seq(num_tokens: int, new_tokens: int = 8) -> Sequence:
    seq = Sequence(list(range(num_tokens)), SamplingParams(), budget=num_tokens + new_tokens)
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


def test_host_step_parts_add_up_to_the_steps_seconds():
    stats = LaneStats(KV_BYTES)
    stats.host_step(KV_BYTES, 0.10, 0.06, 0.03)
    stats.host_step(KV_BYTES, 0.05, 0.04, 0.02)  # waits past what the kernels left are clipped: parts never exceed
    parts = stats.snapshot()["host_step_parts"]
    assert parts["steps"] == 2 and parts["seconds"] == pytest.approx(0.15)
    assert parts["kernel_seconds"] == pytest.approx(0.10) and parts["device_wait_seconds"] == pytest.approx(0.04)


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


def _pools(gpu_blocks: int = 64) -> BlockManager:
    return BlockManager(gpu_blocks, 16, 4000, 16, False)


def _device_rows(blocks: BlockManager, count: int, prompt: int, new_tokens: int) -> list[Sequence]:
    rows = []
    for _ in range(count):
        seq = Sequence(list(range(prompt)), SamplingParams(max_tokens=new_tokens), budget=prompt + new_tokens)
        blocks.allocate(seq, BlockLocation.GPU)
        rows.append(seq)
    return rows


def _lanes(device_rows: int, device_step: float, fixed: float, per_byte: float, busy_step: float | None = None,
           move_per_token: float | None = None, prefill_per_token: float = 0.0) -> LaneStats:
    """Both lanes measured: device steps of device_rows rows, host steps of `fixed` + per_byte, a move, and a
    host-tier prefill that took prefill_per_token a token more than a device-tier one."""
    stats = _measured(fixed, per_byte)
    stats.prefill_done(1000, 0, 0.01)
    for _ in range(MIN_PREFILL_SAMPLES):
        stats.prefill_done(1000, 1000, 0.01 + 1000 * prefill_per_token)
    for _ in range(40):
        stats.device_step_done(device_rows, device_step, host_busy=False)
        stats.device_step_done(device_rows, busy_step or device_step, host_busy=True)
    if move_per_token is not None:
        stats.move_done(1000, move_per_token * 1000)
    return stats


def test_before_the_lanes_are_measured_one_request_tries_the_host_lane_and_the_rest_wait():
    blocks = _pools()
    device = _device_rows(blocks, 2, 480, 32)
    assert host_lane_pays(_host_seq(100), device, blocks, LaneStats(KV_BYTES))
    assert not host_lane_pays(_host_seq(100), [*device, _host_seq(100)], blocks, LaneStats(KV_BYTES))
    # The host lane measured, the device lane not yet (its rows are still in prefill): wait for its first steps.
    assert not host_lane_pays(_host_seq(100), device, blocks, _measured(fixed=0.02, per_byte=1e-8))
    assert host_lane_pays(_host_seq(100), [], blocks, _measured(fixed=0.02, per_byte=1e-8))  # no device rows


def test_a_request_whose_stay_is_too_short_to_pay_for_its_promotion_waits():
    """Prompt-heavy: the device rows end in 32 steps, so a host row makes ~13 tokens before room frees and it moves
    up, and its promotion costs more device time than those tokens save. Decode-heavy, the same request stays for
    ~400 tokens, and the promotion is cheap beside them."""
    stats = _lanes(device_rows=4, device_step=0.010, fixed=0.02, per_byte=1e-8, move_per_token=5e-4)
    short_blocks, long_blocks = _pools(128), _pools(128)
    short = _device_rows(short_blocks, 4, 480, 32)
    long = _device_rows(long_blocks, 4, 480, 1000)
    request = _host_seq(480, new_tokens=1000)
    assert not host_lane_pays(request, short, short_blocks, stats)
    assert host_lane_pays(request, long, long_blocks, stats)
    assert host_gain_seconds([request], short, short_blocks, stats) < 0 < host_gain_seconds(
        [request], long, long_blocks, stats)
    free_moves = _lanes(device_rows=4, device_step=0.010, fixed=0.02, per_byte=1e-8, move_per_token=0.0)
    assert host_lane_pays(request, short, short_blocks, free_moves)  # the tokens alone pay


def test_starting_the_lane_must_beat_what_it_costs_the_device_lane():
    blocks = _pools(4 * 63 + 10)
    device = _device_rows(blocks, 4, 1000, 10_000)  # they do not end while the host rows run
    # Device steps of 10 ms (400 tok/s), 10% slower beside a host step: ~36 tok/s lost while the lane runs.
    # A host step: 200 ms + 1 ms per row of 1k tokens; each host row makes its 8 tokens and ends there.
    stats = _lanes(device_rows=4, device_step=0.010, busy_step=0.011, fixed=0.2, per_byte=1e-9, move_per_token=1e-6)
    # One row gives ~5 tok/s, four ~20: not worth waking the lane for...
    assert not host_lane_pays(_host_seq(1000), device, blocks, stats)
    assert not host_lane_pays(_host_seq(1000), device, blocks, stats, joining=[_host_seq(1000) for _ in range(3)])
    # ...but forty waking it together give ~170 tok/s.
    assert host_lane_pays(_host_seq(1000), device, blocks, stats, joining=[_host_seq(1000) for _ in range(39)])
    for _ in range(200):  # the host lane stops costing the device lane anything
        stats.device_step_done(4, 0.010, host_busy=True)
    assert host_lane_pays(_host_seq(1000), device, blocks, stats)


def test_a_running_host_lane_takes_rows_like_its_own_but_not_a_far_longer_one():
    """The host rows move up when the device rows end, 3 s from now, making ~50 tokens each until then. A row of
    20k tokens with 8 to go would slow their steps fourfold, costing them ~150 tokens to make its own 8."""
    blocks = _pools(4 * 313 + 10)
    device = _device_rows(blocks, 4, 5000, 300)  # 300 steps of 10 ms
    stats = _lanes(device_rows=4, device_step=0.010, fixed=0.02, per_byte=1e-8, move_per_token=1e-7)
    running = [*device, *(_host_seq(1000, new_tokens=1000) for _ in range(4))]
    assert host_lane_pays(_host_seq(1000, new_tokens=1000), running, blocks, stats)
    assert not host_lane_pays(_host_seq(20_000), running, blocks, stats)


def test_the_host_lane_steps_only_while_it_pays_with_all_its_rows():
    stats = _measured(fixed=0.02, per_byte=1e-9)  # a host step: 20 ms + 1 ms per row of 1k tokens
    assert host_step_pays([_host_seq(1000)], 64, LaneStats(KV_BYTES))  # nothing measured: the lane is tried
    for _ in range(40):
        stats.device_step_done(rows=64, seconds=0.010, host_busy=False)  # ~6,400 tok/s
        stats.device_step_done(rows=64, seconds=0.0105, host_busy=True)  # 5% slower: ~300 tok/s lost
    stats.host_step(4000 * KV_BYTES, 0.024, 0.004)  # it has just stepped: no probe is due
    few, many = [_host_seq(1000) for _ in range(4)], [_host_seq(1000) for _ in range(40)]
    assert not host_step_pays(few, 64, stats)  # 4 rows in 24 ms: ~170 tok/s
    assert host_step_pays(many, 64, stats)  # 40 rows in 60 ms: ~670 tok/s
    assert host_step_pays(few, 0, stats)  # no device rows: nothing to slow down
    assert not host_step_pays([], 0, stats)
    assert stats.checks[("host_step", False)] == 1 and stats.checks[("host_step", True)] == 1


def test_a_refused_host_lane_steps_again_to_measure_itself():
    """A refusal stops the host steps its estimate would come from, so the lane steps anyway (a probe) after
    HOST_PROBE_STEPS device steps without one; any host step starts the count again."""
    stats = _lanes(64, 0.010, fixed=0.02, per_byte=1e-9, busy_step=0.0105)  # ~300 tok/s lost while it steps
    few = [_host_seq(1000) for _ in range(4)]  # ~170 tok/s: refused
    for _ in range(2):
        stats.host_step(4000 * KV_BYTES, 0.024, 0.004)
        for step in range(1, HOST_PROBE_STEPS + 1):
            stats.device_step_done(rows=64, seconds=0.010, host_busy=False)
            assert host_step_pays(few, 64, stats) == (step == HOST_PROBE_STEPS), step
    assert stats.checks[("host_step_probe", True)] == 2
    assert stats.checks[("host_step", False)] == 2 * (HOST_PROBE_STEPS - 1)


def test_a_cold_first_measurement_or_a_stall_does_not_move_the_estimates():
    """The first host step, on cold threads, read 8x later ones once; moves measured at 5-10x their usual cost in
    the runs that lost to "gpu" (lane_stats.py). An estimate is the median of the last WINDOW values: one
    outlier among typical values does not move it, and old values leave it."""
    stats = LaneStats(KV_BYTES)
    stats.host_step(1000 * KV_BYTES, 0.01 + 0.08, 0.08)  # cold: 8e-8 s a byte
    assert stats.host_per_byte == pytest.approx(8e-8)  # nothing else to go on yet
    for _ in range(2):
        stats.host_step(1000 * KV_BYTES, 0.01 + 0.01, 0.01)  # warm: 1e-8
    assert stats.host_per_byte == pytest.approx(1e-8)
    assert stats.host_step_seconds(2000 * KV_BYTES) == pytest.approx(0.01 + 0.02)
    for tokens, seconds in ((2000, 2e-3), (2500, 2.5e-3), (2400, 0.2), (2200, 2.2e-3)):  # one move stalled
        stats.move_done(tokens, seconds)
    assert stats.move_seconds_per_token == pytest.approx(1e-6)
    for _ in range(WINDOW):
        stats.device_step_done(rows=8, seconds=0.010, host_busy=False)
        stats.device_step_done(rows=8, seconds=0.0105, host_busy=True)
    stats.device_step_done(rows=8, seconds=0.5, host_busy=True)  # a garbage collection mid-step
    assert stats.slowdown == pytest.approx(1.05)
    assert stats.device_tok_s.value == pytest.approx(8 / 0.0105)
    for _ in range(WINDOW):  # the lane speeds up: the estimate follows within a window
        stats.host_step(1000 * KV_BYTES, 0.01 + 0.005, 0.005)
    assert stats.host_per_byte == pytest.approx(5e-9)


@pytest.mark.real_cost_check
def test_a_held_back_host_lane_still_finishes_every_request(qwen3_dir, monkeypatch):
    """With the lane's check saying no to every step, host-tier sequences wait for device room (promotion) or
    step once the device lane has no rows: nothing is lost and greedy output stays exact."""
    from offload_engine import LLM
    from offload_engine.engine.sched import placement
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
    assert stats.snapshot()["moves_measured"] >= 1  # what a move cost the device lane, for the admission check
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 20)):
        assert output.token_ids[: len(ref)] == ref
    llm.close()


@pytest.mark.real_cost_check
def test_only_requests_that_could_run_count_as_joining_the_host_lane():
    """A queue of forty behind max_num_seqs=4 must not talk the check into waking the lane for one row."""
    from offload_engine.engine.sched.scheduler import Scheduler

    # The device row ends in 900 steps of 10 ms, 25% slower beside a host step; a host step takes 400 ms and ~5 ms
    # per row: in those 9 s each host row makes ~20 tokens, worth 0.2 s of the device lane, and the busy lane costs
    # it 1.8 s: three rows do not pay for that; forty, moving up one by one, do.
    stats = _lanes(device_rows=1, device_step=0.010, busy_step=0.0125, fixed=0.4, per_byte=5e-9)
    # 128 device blocks hold one request's budget (125 blocks): the first goes to the device, the rest ask the check.
    blocks = _pools(128)
    scheduler = Scheduler(blocks, "auto", max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=2048,
                          eos_token_ids=(), stats=stats)
    for _ in range(40):
        scheduler.add(Sequence(list(range(1100)), SamplingParams(max_tokens=900), budget=2000))
    batch = scheduler.schedule_prefill()
    assert [s.location for s in batch] == [BlockLocation.GPU]  # the rest wait, as under "gpu"
    assert stats.checks[("admit", False)] == 1
    joining = list(scheduler._could_join())
    assert len(joining) == 3
    device, queue = list(scheduler.running), list(scheduler.waiting)
    assert not host_lane_pays(queue[0], device, blocks, stats, joining=joining)
    assert host_lane_pays(queue[0], device, blocks, stats, joining=queue[1:])
