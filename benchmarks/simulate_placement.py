"""Replays the engine's scheduling on a simulated clock, to predict what "auto" does against "gpu" without a GPU.

Which rows demote or promote, and how many rows each lane runs, follow from the scheduler's state and the step
times it is fed: nothing else is random. So the real LLMEngine (built through its constructor), Scheduler,
BlockManager, placement and LaneStats run here with a fake model runner, host lane and clock whose step times come
from a cost model measured on the device (COST_MODELS). The GPU runs device steps back to back and the engine waits,
on the clock, only where it reads a step's tokens. Not modelled: the host lane's GPU work beyond a slowdown of device
steps (a constant factor, or with --device-ms-per-host-step a fixed cost per host step), host-tier prefill beyond a
constant per token, and a move beyond a constant per token of its context. Timings are a guide to which changes are
worth a device run; device runs decide. Where it was right and wrong: docs/decisions/placement.md, "The placement
replay".

    PYTHONPATH=. python -m benchmarks.simulate_placement [--mixed | --grid] [--out PATH]
    PYTHONPATH=. python -m benchmarks.simulate_placement --model qwen3-8b --num-seqs 64 --prompt-len 1024 \\
        --output-len 1024 --num-gpu-blocks 3296 [--spread 0.5] [--device-ms-per-host-step 3]

`--mixed` replays the suite's points with lengths spread around their means (workloads.mixed_lengths): a real
batch's requests end at different steps, so device room frees a row at a time instead of all at once. `--grid`
replays ten shapes at three budgets and two spreads, the suite and points measured off it.
"""
import argparse
import json
import random
import statistics
from dataclasses import asdict, dataclass, replace

from benchmarks.workloads import mixed_lengths
from offload_engine.config import EngineConfig
from offload_engine.engine.llm_engine import LLMEngine, promote_in_parts
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


# Calibrated on the H100 host from device runs: docs/decisions/placement.md, "The replay's cost model".
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

    def submit(self, _host_step, batch: list[Sequence], _streamed: list[int]) -> FakeFuture:
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
        self.host_busy, self.host_streams, self.quiet, self.moved = False, False, True, (0, 0.0)

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


def build_engine(policy: str, point: Point, clock: SimClock, cost: CostModel,
                 in_parts: bool | None = None) -> LLMEngine:
    """An LLMEngine with the real scheduler, pools and lane statistics around the fake runner, host lane and clock
    (in_parts: Scheduler.promote_in_parts; None: the engine's default, promote_in_parts())."""
    in_parts = promote_in_parts() if in_parts is None else in_parts
    blocks = BlockManager(point.num_gpu_blocks, DEVICE_BLOCK_SIZE, HOST_POOL_BLOCKS[point.model], HOST_BLOCK_SIZE,
                          enable_prefix_caching=True)
    stats = LaneStats(cost.kv_bytes, 1 / cost.link_bytes_per_s)
    scheduler = Scheduler(blocks, policy, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, point.max_model_len,
                          eos_token_ids=(), kv_promotion=True, stats=stats, promote_in_parts=in_parts)
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


def simulate(policy: str, point: Point, cost: CostModel | None = None, in_parts: bool | None = None) -> dict:
    """Runs every request of the point to its end under `policy`; returns what a device run would report."""
    clock = SimClock()
    engine = build_engine(policy, point, clock, cost or COST_MODELS[point.model], in_parts)
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


def compare(point: Point, device_ms_per_host_step: float | None = None, in_parts: bool | None = None) -> dict:
    cost = COST_MODELS[point.model]
    if device_ms_per_host_step is not None:
        cost = replace(cost, device_s_per_host_step=device_ms_per_host_step / 1e3)
    by_policy = {policy: simulate(policy, point, cost, in_parts) for policy in POLICIES}
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
# measured off it. Rules are checked here before a device run: min, mean and points below 0.97 (docs/decisions/placement.md).
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
    parser.add_argument("--promote-in-parts", action=argparse.BooleanOptionalAction, default=None,
                        help="host rows take spare device room as split rows (Scheduler.promote_in_parts; default: "
                             "the engine's, on unless OFFLOAD_ENGINE_PROMOTE_IN_PARTS=0); the fake runner charges "
                             "every copied token to the device lane, the parts' early copies too")
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
        results.append(compare(point, args.device_ms_per_host_step, args.promote_in_parts))
        print(format_line(results[-1]), flush=True)
    ratios = [result["auto_over_gpu"] for result in results]
    print(f"auto/gpu over {len(ratios)} points: min {min(ratios):.3f}, mean {sum(ratios) / len(ratios):.4f}, "
          f"{sum(ratio < 0.97 for ratio in ratios)} below 0.97")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
