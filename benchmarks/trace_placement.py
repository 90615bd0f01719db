"""Where each placement's rows are over one engine run: per device-lane decode step, its rows and their mean
context, the free device blocks, the waiting requests (and whether the one at the head is held for a promotion),
and the host-tier rows (in flight in a host step or parked). Prints the run in ten slices of its device steps and
writes every step to JSON: what simulate_placement.py replays, measured on the device.

    python -m benchmarks.trace_placement auto --model qwen3-8b --num-seqs 96 --num-gpu-blocks 3296 --out PATH
"""
import argparse
import functools
import gc
import json
import statistics
import time

from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import measure, random_prompts
from offload_engine.engine import llm_engine
from offload_engine.engine.runner import model_runner
from offload_engine.engine.sched import placement
from offload_engine.engine.sched import scheduler
from offload_engine.engine.sequence import BlockLocation

GPU, CPU = BlockLocation.GPU, BlockLocation.CPU
steps = []  # one dict per device-lane decode step
slow_calls = []  # engine calls of SLOW_CALL_S or more, and garbage collections of SLOW_COLLECTION_S or more
SLOW_CALL_S = 0.03
SLOW_COLLECTION_S = 0.003  # a collection holds every thread: shorter ones still add up
held = set()  # ids of requests held for a promotion in the step being scheduled


def _traced_hold(original):
    def held_for_promotion(seq, running, blocks, step):
        result = original(seq, running, blocks, step)
        if result:
            held.add(seq.seq_id)
        return result
    return held_for_promotion


def _traced_decode(original):
    def schedule_decode(self, tier, hold_back=frozenset()):
        batch = original(self, tier, hold_back)
        if tier == GPU and batch:
            host = [s for s in self.running if s.location == CPU]
            steps.append({"t": time.perf_counter(), "rows": len(batch),
                          "context": statistics.mean(len(s) for s in batch),
                          "free": self.blocks.pool(GPU).num_free, "waiting": len(self.waiting),
                          "head_held": bool(self.waiting) and self.waiting[0].seq_id in held,
                          "host_rows": len(host), "host_in_flight": sum(s.in_flight for s in host),
                          "promotions": self.num_promotions, "demotions": self.num_demotions})
            held.clear()
        return batch
    return schedule_decode


def _timed_call(owner, name: str) -> None:
    """Records each call of owner.name that takes SLOW_CALL_S or more, with the device step it came after."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - began
            if seconds >= SLOW_CALL_S:
                prefill = kwargs.get("is_prefill", len(args) > 2 and args[2] is True)
                slow_calls.append({"step": len(steps), "call": name + (" (prefill)" if prefill else ""),
                                   "seconds": round(seconds, 4)})
    setattr(owner, name, timed)


def _watch_collections() -> None:
    began = {}

    def collection(phase, info):
        if phase == "start":
            began["t"] = time.perf_counter()
        elif time.perf_counter() - began["t"] >= SLOW_COLLECTION_S:
            slow_calls.append({"step": len(steps), "call": f"gc generation {info['generation']}",
                               "seconds": round(time.perf_counter() - began["t"], 4)})
    gc.callbacks.append(collection)


def watch_slow_calls() -> None:
    """Which of the engine's step parts (or a garbage collection) hold its thread long enough to stall the device
    lane: a gap between two device steps with no prefill in it."""
    for name in ("_take_host_step", "_land_promotions", "_promote", "_schedule_prefill", "_resolve_device_step",
                 "_start_host_step"):
        _timed_call(llm_engine.LLMEngine, name)
    for name in ("run", "demote", "promote"):
        _timed_call(model_runner.ModelRunner, name)
    for name in ("schedule_decode", "take_demotions", "schedule_promotions", "postprocess"):
        _timed_call(scheduler.Scheduler, name)
    _watch_collections()


def slices(trace: list[dict], count: int = 10) -> list[dict]:
    out = []
    for i in range(count):
        part = trace[i * len(trace) // count:(i + 1) * len(trace) // count]
        if not part:
            continue
        mean = lambda key: round(statistics.mean(float(s[key]) for s in part), 2)
        out.append({"seconds": round(part[-1]["t"] - trace[0]["t"], 2), "steps": len(part),
                    **{key: mean(key) for key in ("rows", "context", "free", "waiting", "head_held", "host_rows",
                                                  "host_in_flight")}})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("placement", choices=("gpu", "auto"))
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--num-seqs", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--num-gpu-blocks", type=int, default=3296)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    parser.add_argument("--slow-calls", action="store_true", help=f"record engine calls of {SLOW_CALL_S * 1000:.0f} "
                        f"ms or more and garbage collections of {SLOW_COLLECTION_S * 1000:.0f} ms or more")
    args = parser.parse_args()
    placement._held_for_promotion = _traced_hold(placement._held_for_promotion)  # choose_tier looks it up by name
    scheduler.Scheduler.schedule_decode = _traced_decode(scheduler.Scheduler.schedule_decode)
    if args.slow_calls:
        watch_slow_calls()
    vocab = 400 if args.model == "tiny" else 10000
    result = measure(model_dir(args.model, args.model_cache),
                     random_prompts([args.prompt_len] * args.num_seqs, vocab), [args.output_len] * args.num_seqs,
                     kv_placement=args.placement, num_gpu_blocks=args.num_gpu_blocks,
                     cpu_kv_cache_gb=args.cpu_kv_cache_gb, max_model_len=args.prompt_len + args.output_len,
                     max_num_seqs=256)
    summary = {"config": vars(args), "tok_s": result["output_tok_per_s"], "seconds": result["seconds"],
               "decode_steps": len(steps), "promotions": result.get("promotions"),
               "demotions": result.get("demotions"), "preemptions": result.get("preemptions"),
               "slices": slices(steps), "slow_calls": slow_calls}
    print(f"{args.placement}: {summary['tok_s']:.0f} tok/s, {len(steps)} device steps")
    for part in summary["slices"]:
        print("  " + " ".join(f"{k} {v}" for k, v in part.items()))
    for call in slow_calls:
        print(f"  slow: after device step {call['step']}: {call['call']} {call['seconds'] * 1000:.0f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "steps": steps}, f)


if __name__ == "__main__":
    main()
