"""An idealized schedule for a decode-heavy batch: how far the engine's placement rules are from rules that know
every request's future, and which host-lane costs a target auto/gpu would need.

benchmarks/simulate_placement.py replays the engine's own rules (cost checks, holds, headroom). This schedule has
none of them, and it is run on the same cost model (simulate_placement.CostModel):
- every prompt is prefilled at the start in one go; those the device pool cannot hold then go to the host tier,
  at the cost model's extra prefill per host-tier token;
- before each device step, device room goes to the parked rows with the most tokens left (promotions), and while
  the device rows' next tokens do not fit, the row with the fewest left goes down (demotions), each move at the
  cost model's price: rows advance together, and the batch does not end on a tail of a few device rows;
- every row off the device is in every host step, which starts when the last one has ended and at least
  `min_host_rows` rows are off the device (any number when the device lane has no rows); the fastest of a few
  floors is kept.
auto/gpu is its time against the replay's gpu run of the same point (which matches the device's within ~0.4% at
decode-heavy 8B). It is not a bound, and it is no rule for other batches: prefilling every prompt at once sends
prompt-heavy batches to the host tier wholesale (8B, 32 x (4096 + 128) at 3,296 blocks: 0.76x gpu, where the
engine reads 0.97-0.98x). It answers two questions at decode-heavy points: how much do the engine's rules leave
on the table, and what would the lanes have to cost for a given ratio.

    PYTHONPATH=. python -m benchmarks.ideal_schedule [--out PATH]      # decode-heavy 8B at 3,296 blocks
    PYTHONPATH=. python -m benchmarks.ideal_schedule --model qwen3-0.6b --num-seqs 32 --prompt-len 1024 \\
        --output-len 1024 --num-gpu-blocks 512
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

from benchmarks.simulate_placement import COST_MODELS, DEVICE_BLOCK_SIZE, CostModel, Point, simulate

MIN_HOST_ROWS = (1, 16, 24)  # the floors on a host step's rows tried; the fastest run is kept


@dataclass
class Row:
    prompt: int
    steps_left: int  # decode steps to go (a request's first token comes from its prefill)
    on_device: bool = False
    decoded: int = 0

    @property
    def tokens(self) -> int:
        """Tokens of KV it holds."""
        return self.prompt + self.decoded

    def advance(self) -> None:
        self.decoded += 1
        self.steps_left -= 1


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / DEVICE_BLOCK_SIZE)


class IdealSchedule:
    """One run of the schedule in the module's docstring, on a clock in seconds."""

    def __init__(self, point: Point, cost: CostModel, min_host_rows: int):
        self.point, self.cost, self.min_host_rows = point, cost, min_host_rows
        self.rows = [Row(prompt, output - 1) for prompt, output in zip(*point.lengths)]
        self.clock = 0.0
        self.device_steps = self.device_tokens = self.host_steps = self.host_tokens = self.moves = 0
        self.in_host_step: list[Row] = []
        self.host_step_ends = 0.0
        self.device_slowdown = 1.0

    def live(self) -> list[Row]:
        return [row for row in self.rows if row.steps_left > 0]

    def device_blocks(self, ahead: int = 0) -> int:
        """Device blocks the device rows hold, with room for `ahead` more tokens each."""
        return sum(_blocks(row.tokens + ahead) for row in self.rows if row.on_device)

    def fits(self, row: Row) -> bool:
        """Whether the row, and the next token of every device row and of it, fit the device pool."""
        return self.device_blocks(ahead=1) + _blocks(row.tokens + 1) <= self.point.num_gpu_blocks

    def prefill(self) -> None:
        for row in self.rows:
            row.on_device = self.fits(row)
        host_tokens = sum(row.prompt for row in self.rows if not row.on_device)
        self.clock += sum(row.prompt for row in self.rows) / self.cost.prefill_tok_s
        self.clock += host_tokens * self.cost.host_prefill_s_per_tok

    def move(self, row: Row, up: bool) -> None:
        row.on_device = up
        self.moves += 1
        self.clock += row.tokens * (self.cost.promote_s_per_tok if up else self.cost.demote_s_per_tok)

    def place(self) -> None:
        parked = [row for row in self.live() if not row.on_device and row not in self.in_host_step]
        for row in sorted(parked, key=lambda r: -r.steps_left):
            if self.fits(row):
                self.move(row, up=True)
        while self.device_blocks(ahead=1) > self.point.num_gpu_blocks:
            self.move(min((r for r in self.live() if r.on_device), key=lambda r: r.steps_left), up=False)

    def start_host_step(self, device_rows: int) -> None:
        rows = [row for row in self.live() if not row.on_device]
        if not rows or (device_rows and len(rows) < self.min_host_rows):
            return
        gigabytes = sum(row.tokens for row in rows) * self.cost.kv_bytes / 1e9
        seconds = self.cost.host_fixed + self.cost.host_per_gb * gigabytes
        self.in_host_step, self.host_step_ends = rows, self.clock + seconds
        self.device_slowdown = self.cost.busy_factor(seconds)
        self.host_steps += 1

    def end_host_step(self) -> None:
        for row in self.in_host_step:
            row.advance()
        self.host_tokens += len(self.in_host_step)
        self.in_host_step = []

    def device_step(self, rows: list[Row]) -> None:
        seconds = self.cost.device_step_seconds(len(rows), sum(row.tokens for row in rows))
        self.clock += seconds * (self.device_slowdown if self.in_host_step else 1.0)
        for row in rows:
            row.advance()
            row.on_device = row.steps_left > 0
        self.device_steps += 1
        self.device_tokens += len(rows)

    def run(self) -> dict:
        self.prefill()
        while self.live():
            if self.in_host_step and self.clock >= self.host_step_ends:
                self.end_host_step()
            self.place()
            device = [row for row in self.live() if row.on_device]
            if not self.in_host_step:
                self.start_host_step(len(device))
            if device:
                self.device_step(device)
            elif self.in_host_step:
                self.clock = max(self.clock, self.host_step_ends)
        return {"seconds": round(self.clock, 3), "device_steps": self.device_steps, "device_tokens": self.device_tokens,
                "host_steps": self.host_steps, "host_tokens": self.host_tokens, "moves": self.moves,
                "min_host_rows": self.min_host_rows}


def ideal_run(point: Point, cost: CostModel) -> dict:
    """The fastest of the schedule's runs over MIN_HOST_ROWS."""
    return min((IdealSchedule(point, cost, rows).run() for rows in MIN_HOST_ROWS), key=lambda run: run["seconds"])


def compare(point: Point, fixed_ms, ms_per_gb, device_ms) -> dict:
    """The replay's gpu and auto and this schedule on the replay's cost model, then this schedule over a grid of
    host-lane costs: a host step's fixed ms and ms per GB of KV, and the device-lane ms each host step costs."""
    cost = COST_MODELS[point.model]
    gpu, auto = (simulate(policy, point, cost) for policy in ("gpu", "auto"))
    ratio = lambda seconds: round(gpu["seconds"] / seconds, 3)
    result = {**asdict(point), "workload": point.workload, "cost_model": asdict(cost),
              "replay_gpu_seconds": gpu["seconds"], "replay_auto_over_gpu": ratio(auto["seconds"])}
    ideal = ideal_run(point, cost)
    result["ideal_on_replay_costs"] = {"auto_over_gpu": ratio(ideal["seconds"]), **ideal}
    result["grid"] = []
    for device in device_ms:
        for per_gb in ms_per_gb:
            for fixed in fixed_ms:
                lanes = replace(cost, host_fixed=fixed / 1e3, host_per_gb=per_gb / 1e3,
                                device_s_per_host_step=device / 1e3)
                run = ideal_run(point, lanes)
                result["grid"].append({"device_ms_per_host_step": device, "host_ms_per_gb": per_gb,
                                       "host_fixed_ms": fixed, "auto_over_gpu": ratio(run["seconds"]), **run})
    return result


def print_result(result: dict, fixed_ms) -> None:
    print(f"{result['model']} {result['workload']} at {result['num_gpu_blocks']} blocks: replay gpu "
          f"{result['replay_gpu_seconds']} s; auto/gpu: the replay {result['replay_auto_over_gpu']}, this schedule on "
          f"the replay's costs {result['ideal_on_replay_costs']['auto_over_gpu']}")
    print("this schedule's auto/gpu by host-lane cost; columns: a host step's fixed ms "
          + " / ".join(f"{ms:g}" for ms in fixed_ms))
    rows: dict[tuple, list] = {}
    for cell in result["grid"]:
        rows.setdefault((cell["device_ms_per_host_step"], cell["host_ms_per_gb"]), []).append(cell)
    for (device, per_gb), cells in rows.items():
        ratios = "  ".join(f"{cell['auto_over_gpu']:.3f}" for cell in cells)
        print(f"  device {device:4.1f} ms a host step, host {per_gb:5.2f} ms/GB ({1e3 / per_gb:5.1f} GB/s): {ratios}")


def floats(text: str) -> list[float]:
    return [float(value) for value in text.split(",")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(COST_MODELS), default="qwen3-8b")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--num-gpu-blocks", type=int, default=3296)
    parser.add_argument("--spread", type=float, default=0.0)
    parser.add_argument("--fixed-ms", type=floats, default=[0, 10, 30], help="a host step's fixed ms, comma-separated")
    parser.add_argument("--ms-per-gb", type=floats, default=[10.1, 12.7, 15.0],
                        help="host-step ms per GB of KV (H100 host, 8B: 10.1 its read ceiling, 98.6 GB/s; 12.7 in the "
                             "suite's run, 15 in bench_lane_interference's)")
    parser.add_argument("--device-ms", type=floats, default=[0, 2.3, 3.0, 5.9],
                        help="device-lane ms a host step costs (H100 host, 8B: 2.3-5.9 measured, 2.7-3.3 on 2026-11-24)")
    parser.add_argument("--out", help="write the results here as JSON")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    point = Point(args.model, args.num_seqs, args.prompt_len, args.output_len, args.num_gpu_blocks, args.spread)
    result = compare(point, args.fixed_ms, args.ms_per_gb, args.device_ms)
    print_result(result, args.fixed_ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
