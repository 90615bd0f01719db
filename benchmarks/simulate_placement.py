"""Replays the engine's scheduling on a simulated clock, to predict what "auto" does against "gpu" without a GPU.

Which rows demote or promote, and how many rows each lane runs, follow from the scheduler's state and the step
times it is fed: nothing else is random. So the real LLMEngine._step, Scheduler, BlockManager, placement and
LaneStats run here with a fake model runner and host lane whose steps take times from a cost model measured on
the device, and the replay reproduces a device run's step and move counts. On the H100 host (2026-11-22), 8B,
64 x (1024 + 1024) at 3,296 device blocks, it matched "gpu" exactly (2,074 device steps of 31.6 rows, 28
recomputes) and "auto"'s steps and moves within 1%.

Not modelled: the host lane's GPU work beyond a slowdown of device steps (a constant factor, or with
--device-ms-per-host-step a fixed cost per host step; host-tier prefill only as a constant per token beyond a
device-tier prompt's), and
async scheduling's overlap beyond this: the GPU runs device steps back to back and the engine's own work hides
behind them; the engine waits, on the clock, only where it reads a step's tokens. (Until 2026-11-23 a step moved
the clock when it was queued, so a step read with no newer one behind it measured 0 s and the engine's device
tok/s jumped to ~10^5.) A move costs the device lane a constant per token of its context (the engine thread's
share and the slower device steps right after it, measured with profile_timeline.py). Timings are a guide to which changes are worth a device run;
device runs decide. (It predicted 1.07 for the demotion order of d2e1354 at the
point above; the device measured 0.84, because demotions' staged copies then held the engine's thread 47 ms
each, and 1.01 once they no longer did.)

    PYTHONPATH=. python -m benchmarks.simulate_placement [--mixed | --grid] [--out PATH]
    PYTHONPATH=. python -m benchmarks.simulate_placement --model qwen3-8b --num-seqs 64 --prompt-len 1024 \\
        --output-len 1024 --num-gpu-blocks 3296 [--spread 0.5] [--device-ms-per-host-step 3]

`--mixed` replays the suite's points with lengths spread around their means (workloads.mixed_lengths): a real
batch's requests end at different steps, so device room frees a row at a time instead of all at once.
"""
import argparse
import json
import random
import statistics
from dataclasses import asdict, dataclass, replace

from benchmarks.workloads import mixed_lengths
from offload_engine.config import EngineConfig
from offload_engine.engine.llm_engine import LLMEngine
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sched.lane_stats import LaneStats
from offload_engine.engine.sched.scheduler import Scheduler
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.sampling_params import SamplingParams

DEVICE_BLOCK_SIZE = 16
HOST_BLOCK_SIZE = 64
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 16384
POLICIES = ("gpu", "auto")


@dataclass(frozen=True)
class CostModel:
    """What each step costs for one model shape on the H100 host."""

    dev_fixed: float  # seconds of a device decode step regardless of its rows...
    dev_row: float  # ...plus this per row...
    kv_bw: float  # ...plus the KV bytes it reads at this many bytes per second
    busy: float  # device step time while a host step is in flight over while the host lane is idle
    host_fixed: float  # seconds of a host-lane step outside its CPU attention kernels...
    host_per_gb: float  # ...plus this per GB of KV the kernels read
    prefill_tok_s: float  # prompt tokens per second of a prefill step...
    promote_s_per_tok: float  # device-lane seconds a promotion costs per token of context
    demote_s_per_tok: float  # the same for a demotion
    kv_bytes: int  # KV bytes per token
    host_prefill_s_per_tok: float = 0.0  # what a host-tier prompt token's prefill takes beyond a device-tier one's
    prefill_fixed_s: float = 0.0  # ...but no less than this a step (its eager launches: the engine thread's time)
    # Prefill steps of device-tier rows up to this many tokens replay a CUDA graph (engine/graphs/prefill_graphs.py) and
    # take graph_prefill_fixed_s + tokens / graph_prefill_tok_s instead (0: every step is eager).
    graph_prefill_tokens: int = 0
    graph_prefill_fixed_s: float = 0.0
    graph_prefill_tok_s: float = 1.0
    link_bytes_per_s: float = 50e9  # the pinned copy ModelRunner times at start-up (LaneStats' move-cost seed)
    # If set, a host step costs the device lane this many seconds whatever its length (its rows' linear layers
    # read the weights again), spread over the device steps it overlaps, instead of the constant factor `busy`.
    # 8B on the H100 host (2026-11-24, bench_lane_interference.py, 24 device rows): 2.7 ms beside host steps of
    # 12 rows (52 ms), 3.2-3.3 ms beside 24 rows (95-115 ms), where a constant factor would have them 1:2.
    device_s_per_host_step: float | None = None

    def device_step_seconds(self, rows: int, kv_tokens: int) -> float:
        """A device decode step of `rows` rows holding `kv_tokens` tokens of KV, with the host lane idle."""
        return self.dev_fixed + self.dev_row * rows + kv_tokens * self.kv_bytes / self.kv_bw

    def busy_factor(self, host_step_seconds: float) -> float:
        """How much longer a device step takes beside a host step of this length than with the lane idle."""
        if self.device_s_per_host_step is None:
            return self.busy
        return 1 + self.device_s_per_host_step / max(host_step_seconds, 1e-3)


# Read off the H100 runs of 2026-11-23 (after the runner work: whole-step graphs, async scheduling).
# 0.6B: graph replays of 1.54 ms at 1 row and 1.76-1.79 at 5-7 rows of ~1.5k tokens (profile_timeline.py); the
# suite's lane statistics (host fixed 6-9 ms, 10.3 ms per GB); a promotion of ~1.5k tokens 1.2 ms of the engine's
# thread + 1.3 ms of slower device steps, a demotion 1.8 + 2.4 (benchmarks/NOTES.md, 2026-11-23 evening).
# 8B: gpu's 2,868 tok/s at ~35 rows of ~1.5k tokens (12 ms a step); lane statistics host fixed 31-43 ms, 15-19 ms
# per GB, slowdown 1.03-1.04 on prompt-heavy; moves scaled from 0.6B by KV bytes per token (not measured).
# Host-tier prefill (late 2026-11-23, with the device writing host blocks itself): 0.6B, 16 host-tier prompts of
# 2,048 tokens added 0.58 s of prefill to gpu's 0.53 at 576 blocks, ~18 us a token, and the lane's slowdown was
# 1.05 (1.21 in the suite run before); 8B scaled by KV bytes per token (not measured).
# Host-tier prefill re-measured 2026-11-24 (sixteenth session), after its writes became one kernel a layer
# (kernels.write_host_blocks_whole): the engine's own estimate read 0-2.4 us a token at 0.6B and 0.5-1.3 at 8B over
# nine runs (results/nvidia-h100-80gb-hbm3/prefill_kernel_2026-11-24/ab_summary.txt); 18 and 23 before.
# 8B recalibrated to gpu's decode-heavy run of that evening (2,078 steps of 31.5 rows, 9.5 ms each; 108k prompt
# tokens, recomputes included, in 2.52 s): dev_fixed 7.5 -> 5.6 ms, prefill 21k -> 43k tok/s. The replay then gives
# gpu 2,952 tok/s (measured 2,940) and auto 2,588 in 2,616 steps of 23.9 rows (measured 2,477 in 2,667 of 23.5).
# 0.6B prefill re-measured 2026-11-24 (seventeenth session, benchmarks/probe_prefill_steps.py, gpu engines at 64 x
# (2048 + 256), 576 blocks): 2,048-token steps ~30 ms, 8,192-token ~37, 16,384-token ~75 (the suite at 2,304 blocks).
# A step is the engine thread's eager launches up to ~6k tokens and the GPU's arithmetic beyond: max(29 ms, tokens /
# 218k a second) fits all three, where 150k tok/s alone made small steps cheap and left unseen what auto paid at
# 1/16 for prefill steps of one or three rows (35 steps where gpu took 19; benchmarks/NOTES.md, seventeenth session).
# Since prefill graphs (2026-11-25, results/nvidia-h100-80gb-hbm3/prefill_graphs_2026-11-25/): device-tier steps up
# to 8,192 tokens take 9.5 / 15.3 / 21.3 / 26.8 ms for 1-4 prompts of 2,048, i.e. 3.7 ms + tokens / 353k a second.
# The 8B's buckets pay up to ~1.5k tokens only (its replay outgrows the launches), where prefill is GPU-bound anyway.
# Moves re-scaled 2026-11-24 (seventh session): promotions read the host pool on 16 programs beside the device lane
# since f802db9, demotions write it on 8 since 8452c86, and the device lane's extra time per move fell with them
# (a decode-heavy 8B demotion 4.68 -> 1.74 ms; a 632 MB promotion's step beside it 22-23 -> 5.7-6.1 ms against 5.4
# alone), while the engine thread's share did not: promotions ~0.4x, demotions ~0.25x of the costs above. Against
# 20 points measured on the device (suite, mixed lengths, off the suite) the replay's auto/gpu moved from 0.039 to
# 0.033 off on average, and it still reads low (by 0.02 on average; benchmarks/NOTES.md, 2026-11-24, seventh session).
COST_MODELS = {
    "qwen3-8b": CostModel(dev_fixed=0.0056, dev_row=0.00005, kv_bw=3.0e12, busy=1.035, host_fixed=0.038,
                          host_per_gb=0.016, prefill_tok_s=43000, promote_s_per_tok=0.9e-6,
                          demote_s_per_tok=0.9e-6, kv_bytes=147456, host_prefill_s_per_tok=1e-6),
    "qwen3-0.6b": CostModel(dev_fixed=0.00145, dev_row=0.00001, kv_bw=4.0e12, busy=1.0, host_fixed=0.007,
                            host_per_gb=0.0103, prefill_tok_s=218000, promote_s_per_tok=0.7e-6,
                            demote_s_per_tok=0.7e-6, kv_bytes=114688, host_prefill_s_per_tok=2e-6,
                            prefill_fixed_s=0.029, graph_prefill_tokens=8192, graph_prefill_fixed_s=0.0037,
                            graph_prefill_tok_s=353000),
}
HOST_POOL_BLOCKS = {"qwen3-8b": 6346, "qwen3-0.6b": 40000}


@dataclass(frozen=True)
class Point:
    model: str
    num_seqs: int
    prompt_len: int
    output_len: int
    num_gpu_blocks: int
    spread: float = 0.0  # lengths uniform in [L(1 - spread), L(1 + spread)] (benchmarks.workloads.mixed_lengths)

    @property
    def workload(self) -> str:
        mixed = f" ~{self.spread:g}" if self.spread else ""
        return f"{self.num_seqs} x ({self.prompt_len}+{self.output_len}){mixed}"

    @property
    def lengths(self) -> tuple[list[int], list[int]]:
        return mixed_lengths(self.num_seqs, self.prompt_len, self.output_len, self.spread)

    @property
    def max_model_len(self) -> int:
        prompts, outputs = self.lengths
        return max(p + o for p, o in zip(prompts, outputs))


# The full device profile's prefill-heavy and decode-heavy points, each at several device budgets.
SUITE = ([Point("qwen3-0.6b", 64, 2048, 256, blocks) for blocks in (2304, 1152, 576)]
         + [Point("qwen3-8b", 32, 4096, 128, blocks) for blocks in (3296, 2112, 1056)]
         + [Point("qwen3-0.6b", 32, 1024, 1024, blocks) for blocks in (1024, 512)]
         + [Point("qwen3-8b", 64, 1024, 1024, blocks) for blocks in (3296, 1024)])


class SimClock:
    """Simulated seconds: the fake lanes move it on, the engine's step timing reads it."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeFuture:
    """A host step's result, done once the clock reaches its end; waiting for it moves the clock there."""

    def __init__(self, clock: SimClock, done_at: float, tokens: list[int]):
        self.clock, self.done_at, self.tokens = clock, done_at, tokens

    def done(self) -> bool:
        return self.clock.now >= self.done_at

    def result(self) -> list[int]:
        self.clock.now = max(self.clock.now, self.done_at)
        return self.tokens

    def exception(self) -> None:
        return None


class FakeHostLane:
    """The host-lane executor. Its step runs beside the device lane's, so it ends at a time in the future rather
    than advancing the clock; it records in LaneStats what LLMEngine._host_step would have measured."""

    def __init__(self, clock: SimClock, cost: CostModel):
        self.engine, self.clock, self.cost = None, clock, cost  # the engine is set once it exists

    def submit(self, _host_step, batch: list[Sequence]) -> FakeFuture:
        kv_bytes = sum(map(len, batch)) * self.cost.kv_bytes
        kernel_seconds = self.cost.host_per_gb * kv_bytes / 1e9
        seconds = self.cost.host_fixed + kernel_seconds
        self.engine.stats.host_step(kv_bytes, seconds, kernel_seconds)
        self.engine.host_step_seconds = seconds
        return FakeFuture(self.clock, self.clock.now + seconds, [1] * len(batch))

    def shutdown(self, **_kwargs) -> None:
        pass


class FakeDeferred:
    """A device-lane step's tokens as the engine reads them a step late (engine/runner/deferred_tokens.py): reading them
    waits, on the clock, until the GPU is done with the step."""

    def __init__(self, clock: SimClock, seqs: list[Sequence], launched: float, done_at: float):
        self.clock, self.seqs, self.launched, self.done_at = clock, seqs, launched, done_at
        self.positions = [len(seq) for seq in seqs]
        self.host_busy, self.quiet, self.moved = False, True, (0, 0.0)

    def result(self) -> list[int]:
        self.clock.now = max(self.clock.now, self.done_at)
        return [1] * len(self.seqs)

    def wait(self) -> None:
        pass


class FakeRunner:
    """The model runner. The GPU runs one step after another: a device-lane step is queued (async scheduling) and
    ends its modelled time after the GPU is free, and the clock gets there when the engine reads it; a prefill
    step and a move's cost are waited for at once. Every token is 1."""

    promotes_beside_host_steps = True  # CUDA's mapped host pool: promotions run beside a host step in flight
    promotes_beside_device_lane = False  # a promotion costs the device lane its modelled time (CostModel)...
    demotes_beside_device_lane = False  # ...and so does a demotion

    def __init__(self, clock: SimClock, cost: CostModel):
        self.engine, self.clock, self.cost = None, clock, cost  # the engine is set once it exists
        self.gpu_free_at = 0.0
        self.decode_steps: list[tuple[int, bool]] = []  # (rows, host step in flight) of each device decode step

    def _gpu(self, seconds: float) -> float:
        """Queues `seconds` of GPU work; returns when it ends."""
        self.gpu_free_at = max(self.gpu_free_at, self.clock.now) + seconds
        return self.gpu_free_at

    def prefill(self, batch: list[Sequence]) -> list[int]:
        host = sum(seq.num_scheduled_tokens for seq in batch if seq.location == BlockLocation.CPU)
        tokens = sum(seq.num_scheduled_tokens for seq in batch)
        if not host and tokens <= self.cost.graph_prefill_tokens:
            seconds = self.cost.graph_prefill_fixed_s + tokens / self.cost.graph_prefill_tok_s
        else:
            seconds = max(self.cost.prefill_fixed_s, tokens / self.cost.prefill_tok_s)
        self.clock.now = self._gpu(seconds + host * self.cost.host_prefill_s_per_tok)
        return [1] * len(batch)

    def launch_device_decode(self, batch: list[Sequence]) -> "FakeDeferred":
        host_busy = self.engine.in_flight is not None
        slower = self.cost.busy_factor(self.engine.host_step_seconds) if host_busy else 1.0
        done_at = self._gpu(self.cost.device_step_seconds(len(batch), sum(map(len, batch))) * slower)
        self.decode_steps.append((len(batch), host_busy))
        return FakeDeferred(self.clock, batch, self.clock.now, done_at)

    def promote(self, moves) -> None:
        self._move(sum(seq.num_computed_tokens for seq, _ in moves) * self.cost.promote_s_per_tok)

    def demote(self, moves) -> None:
        self._move(sum(seq.num_computed_tokens for seq, _ in moves) * self.cost.demote_s_per_tok)

    def _move(self, seconds: float) -> None:
        """A move costs the engine thread and the device lane the same time (the cost model's measure)."""
        self._gpu(seconds)
        self.clock.now += seconds

    def check_host_writes(self, wait: bool = False) -> None:
        pass

    def host_writes_pending(self) -> bool:
        return False


def build_engine(policy: str, point: Point, clock: SimClock, cost: CostModel) -> LLMEngine:
    """An LLMEngine with the real scheduler, pools and lane statistics around the fake runner, host lane and clock."""
    blocks = BlockManager(point.num_gpu_blocks, DEVICE_BLOCK_SIZE, HOST_POOL_BLOCKS[point.model], HOST_BLOCK_SIZE,
                          enable_prefix_caching=True)
    stats = LaneStats(cost.kv_bytes, 1 / cost.link_bytes_per_s)
    scheduler = Scheduler(blocks, policy, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, point.max_model_len,
                          eos_token_ids=(), kv_promotion=True, stats=stats)
    runner, host_lane = FakeRunner(clock, cost), FakeHostLane(clock, cost)
    cfg = EngineConfig(kv_placement=policy, block_size=DEVICE_BLOCK_SIZE, cpu_block_size=HOST_BLOCK_SIZE,
                       max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, async_scheduling=True)
    engine = LLMEngine(cfg, point.max_model_len, runner, scheduler, stats, host_lane=host_lane, clock=clock.perf_counter)
    runner.engine = host_lane.engine = engine
    return engine


def add_requests(engine: LLMEngine, point: Point) -> None:
    """Random prompts (the same for every policy), each generating exactly its output length."""
    rng = random.Random(0)
    for prompt_len, output_len in zip(*point.lengths):
        prompt = [rng.randrange(1, 30000) for _ in range(prompt_len)]
        engine.add(Sequence(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True), prompt_len + output_len))


def simulate(policy: str, point: Point, cost: CostModel | None = None) -> dict:
    """Runs every request of the point to its end under `policy`; returns what a device run would report."""
    clock = SimClock()
    engine = build_engine(policy, point, clock, cost or COST_MODELS[point.model])
    add_requests(engine, point)
    while engine.has_work():
        engine.step()
    return summarize(policy, point, engine, clock.now)


def summarize(policy: str, point: Point, engine: LLMEngine, seconds: float) -> dict:
    steps = engine.runner.decode_steps
    scheduler = engine.scheduler
    return {
        "policy": policy,
        "seconds": round(seconds, 2),
        "tok_s": round(sum(point.lengths[1]) / seconds),
        "device_steps": len(steps),
        "device_rows_per_step": round(statistics.mean(rows for rows, _ in steps), 1) if steps else 0.0,
        "host_busy_fraction": round(sum(busy for _, busy in steps) / len(steps), 2) if steps else 0.0,
        "device_tokens": engine.decoded_by_lane["device"],
        "host_tokens": engine.decoded_by_lane["host"],
        "demotions": scheduler.num_demotions,
        "promotions": scheduler.num_promotions,
        "recomputes": scheduler.num_preemptions,
        "checks": engine.stats.snapshot()["checks"],
    }


def compare(point: Point, device_ms_per_host_step: float | None = None) -> dict:
    cost = COST_MODELS[point.model]
    if device_ms_per_host_step is not None:
        cost = replace(cost, device_s_per_host_step=device_ms_per_host_step / 1e3)
    by_policy = {policy: simulate(policy, point, cost) for policy in POLICIES}
    model = {} if device_ms_per_host_step is None else {"device_ms_per_host_step": device_ms_per_host_step}
    return {**asdict(point), "workload": point.workload, "num_cpu_blocks": HOST_POOL_BLOCKS[point.model], **model,
            **by_policy,
            "auto_over_gpu": round(by_policy["auto"]["tok_s"] / by_policy["gpu"]["tok_s"], 3)}


HEADER = (f"{'model':<11} {'workload':<23} {'blocks':>6} {'gpu tok/s':>9} {'auto tok/s':>10} {'auto/gpu':>8}  "
          f"{'gpu steps x rows':>16}  {'auto steps x rows':>17} {'host tok':>8} {'demote':>6} {'promote':>7} "
          f"{'recompute gpu/auto':>18}")


def format_line(result: dict) -> str:
    gpu, auto = result["gpu"], result["auto"]
    recomputes = f"{gpu['recomputes']}/{auto['recomputes']}"
    return (f"{result['model']:<11} {result['workload']:<23} {result['num_gpu_blocks']:>6} {gpu['tok_s']:>9} "
            f"{auto['tok_s']:>10} {result['auto_over_gpu']:>8.3f}  "
            f"{gpu['device_steps']:>7} x {gpu['device_rows_per_step']:>6.1f}  "
            f"{auto['device_steps']:>8} x {auto['device_rows_per_step']:>6.1f} {auto['host_tokens']:>8} "
            f"{auto['demotions']:>6} {auto['promotions']:>7} {recomputes:>18}")


# --grid: ten shapes at 1/2, 1/4 and 1/8 of the batch's KV, equal and +-50% lengths, then the suite and the points
# measured off it. Rules are checked here before a device run: min, mean and points below 0.97 (NOTES.md).
GRID_SHAPES = (("qwen3-0.6b", 64, 2048, 256), ("qwen3-0.6b", 32, 1024, 1024), ("qwen3-0.6b", 64, 512, 2048),
               ("qwen3-0.6b", 16, 4096, 1024), ("qwen3-8b", 32, 4096, 128), ("qwen3-8b", 64, 1024, 1024),
               ("qwen3-8b", 48, 2048, 512), ("qwen3-8b", 32, 4096, 512), ("qwen3-8b", 96, 1024, 1024),
               ("qwen3-8b", 128, 512, 512))


def grid_points() -> list[Point]:
    points = list(SUITE)
    for model, seqs, prompt, output in GRID_SHAPES:
        blocks = seqs * -(-(prompt + output) // DEVICE_BLOCK_SIZE)
        points += [Point(model, seqs, prompt, output, blocks // share, spread)
                   for share in (2, 4, 8) for spread in (0.0, 0.5)]
    return points + [Point("qwen3-8b", 48, 2048, 512, blocks) for blocks in (2560, 1920)] + [
        Point("qwen3-8b", 32, 4096, 512, blocks) for blocks in (3296, 3072)]


SINGLE_POINT_OPTIONS = ("model", "num_seqs", "prompt_len", "output_len", "num_gpu_blocks")
SPREAD_GRID = (0.5, 0.9)  # --mixed: the suite's points again at these spreads


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(COST_MODELS))
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--num-gpu-blocks", type=int)
    parser.add_argument("--spread", type=float, default=0.0,
                        help="a single point's lengths uniform in [L(1 - spread), L(1 + spread)]")
    parser.add_argument("--mixed", action="store_true",
                        help=f"the suite's points with mixed lengths (spreads {', '.join(map(str, SPREAD_GRID))})")
    parser.add_argument("--grid", action="store_true",
                        help=f"{len(GRID_SHAPES)} shapes at three budgets and two spreads, the suite and points off it")
    parser.add_argument("--device-ms-per-host-step", type=float,
                        help="a single point's host steps each cost the device lane this many ms (its weight reads), "
                             "instead of the cost model's constant slowdown (8B on the H100 host: 2.7-3.3)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    if args.device_ms_per_host_step is not None and args.model is None:
        parser.error("--device-ms-per-host-step is per model: give it with a single point (--model ...)")
    given = [name for name in SINGLE_POINT_OPTIONS if getattr(args, name) is not None]
    if given and len(given) < len(SINGLE_POINT_OPTIONS):
        missing = [f"--{name.replace('_', '-')}" for name in SINGLE_POINT_OPTIONS if name not in given]
        parser.error(f"a single point needs all of its options; missing: {' '.join(missing)}")
    return args


def main() -> None:
    args = parse_args()
    points = [replace(point, spread=spread) for spread in SPREAD_GRID for point in SUITE] if args.mixed else SUITE
    points = grid_points() if args.grid else points
    if args.model is not None:
        points = [Point(*(getattr(args, name) for name in SINGLE_POINT_OPTIONS), spread=args.spread)]
    print(HEADER)
    results = []
    for point in points:
        results.append(compare(point, args.device_ms_per_host_step))
        print(format_line(results[-1]), flush=True)
    ratios = [result["auto_over_gpu"] for result in results]
    print(f"auto/gpu over {len(ratios)} points: min {min(ratios):.3f}, mean {sum(ratios) / len(ratios):.4f}, "
          f"{sum(ratio < 0.97 for ratio in ratios)} below 0.97")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
