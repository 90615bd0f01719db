"""The placement replay (simulate_placement.py) with prefill/decode separation: the real engine and scheduler, their
prefill lane replaced by one whose steps run on a second simulated GPU. It shows on CPU how PD's schedule differs
from one GPU's at the same decode budget: host-tier admissions, demotions, promotions, recomputes.

    PYTHONPATH=. python -m benchmarks.simulate_pd [--model qwen3-0.6b --num-seqs 64 --prompt-len 2048 \\
        --output-len 256 --num-gpu-blocks 2304] [--policy auto]

Modelled: a lane step takes the cost model's eager prefill time on its own GPU, and its KV's copy to the decode
device (over NVLink, LINK_BYTES_PER_S) or into the host pool (PCIe, HOST_LINK_BYTES_PER_S) delays the rows' return;
the decode device is not slowed by the copies. Not modelled: anything else PD costs the decode device. The replay guides; device runs decide.
"""
import argparse
import json

from benchmarks.simulate_placement import COST_MODELS, SUITE, Point, SimClock, add_requests, build_engine, summarize
from offload_engine.engine.sequence import BlockLocation

LINK_BYTES_PER_S = 100e9  # KV from the prefill GPU to the decode GPU (NVLink, peer copies)
HOST_LINK_BYTES_PER_S = 50e9  # host-tier rows' KV from the prefill GPU into the host pool (PCIe)


class FakePrefillLane:
    """PrefillLane's interface to the engine (engine/disagg/prefill_lane.py): one batch at a time on a GPU of its
    own, its rows taken in once their KV has crossed."""

    def __init__(self, clock: SimClock, cost):
        self.clock, self.cost = clock, cost
        self.step = None  # (rows, done_at, seconds, tokens)
        self.landing = []  # the real lane's final chunks in copy; folded into done_at here
        self.free_at = 0.0
        self.num_steps = self.num_prompt_tokens = self.num_host_prompt_tokens = 0

    @property
    def computing(self) -> bool:
        return self.step is not None

    @property
    def busy(self) -> bool:
        return self.step is not None

    def submit(self, rows: list, decode_device_prefills: bool) -> None:
        if not rows:
            return
        tokens = sum(seq.num_scheduled_tokens for seq in rows)
        host_tokens = sum(seq.num_scheduled_tokens for seq in rows if seq.location == BlockLocation.CPU)
        seconds = max(self.cost.prefill_fixed_s, tokens / self.cost.prefill_tok_s)
        copy = max((tokens - host_tokens) * self.cost.kv_bytes / LINK_BYTES_PER_S,
                   host_tokens * self.cost.kv_bytes / HOST_LINK_BYTES_PER_S)
        self.free_at = max(self.free_at, self.clock.now) + seconds
        self.step = (rows, self.free_at + copy, seconds, tokens)
        self.num_steps += 1
        self.num_prompt_tokens += tokens
        self.num_host_prompt_tokens += host_tokens

    def take(self, scheduler) -> tuple[list, int, float]:
        if self.step is None or self.clock.now < self.step[1]:
            return [], 0, 0.0
        (rows, _, seconds, tokens), self.step = self.step, None
        for seq in rows:
            seq.in_flight = False
        return scheduler.postprocess(rows, [1] * len(rows)), tokens, seconds

    def wait(self, other=None) -> None:
        if self.step is not None:
            until = self.step[1] if other is None else min(self.step[1], other.done_at)
            self.clock.now = max(self.clock.now, until)

    def abort(self) -> None:
        self.step = None

    def close(self) -> None:
        pass


def simulate(policy: str, point: Point, pd: bool) -> dict:
    clock = SimClock()
    cost = COST_MODELS[point.model]
    engine = build_engine(policy, point, clock, cost)
    lane = engine.prefill = FakePrefillLane(clock, cost) if pd else None
    engine.stats.device_prefill_elsewhere = pd  # as LLMEngine.load sets it
    add_requests(engine, point)
    while engine.has_work():
        engine.step()
    result = summarize(policy, point, engine, clock.now)
    result["host_admissions"] = engine.stats.snapshot()["checks"].get("admit_pays", 0)
    result["mode"] = "pd" if pd else "one_gpu"
    if lane is not None:
        result["lane_steps"], result["lane_host_prompt_tokens"] = lane.num_steps, lane.num_host_prompt_tokens
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(COST_MODELS))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-gpu-blocks", type=int, default=2304)
    parser.add_argument("--policy", default="auto", choices=("gpu", "auto"))
    parser.add_argument("--suite", action="store_true", help="every point of simulate_placement's SUITE, under gpu "
                        "and auto: one line each")
    args = parser.parse_args()
    if args.suite:
        for point, policy in ((p, policy) for p in SUITE for policy in ("gpu", "auto")):
            print(json.dumps(compare(policy, point, full=False)), flush=True)
        return
    point = Point(args.model, args.num_seqs, args.prompt_len, args.output_len, args.num_gpu_blocks)
    print(json.dumps(compare(args.policy, point), indent=1))


def compare(policy: str, point: Point, full: bool = True) -> dict:
    """One GPU and PD at one point; full=False keeps the counts that tell them apart."""
    results = {mode: simulate(policy, point, mode == "pd") for mode in ("one_gpu", "pd")}
    ratio = round(results["pd"]["tok_s"] / results["one_gpu"]["tok_s"], 3)
    if full:
        return {**results, "pd_over_one_gpu": ratio}
    keys = ("tok_s", "demotions", "promotions", "recomputes", "host_admissions")
    return {"point": f"{point.model} {point.num_seqs}x({point.prompt_len}+{point.output_len}) @{point.num_gpu_blocks}",
            "policy": policy, "pd_over_one_gpu": ratio,
            **{f"{mode}_{key}": results[mode].get(key) for mode in ("one_gpu", "pd") for key in keys}}


if __name__ == "__main__":
    main()
