"""How much a running host lane slows the device lane: device-tier decode step times, host lane idle vs busy.

    python benchmarks/bench_lane_interference.py            # GPU host, Qwen3-0.6B shape

The same D device-tier sequences decode twice: alone (the host lane idle), and beside H host-tier sequences
whose steps are in flight the whole time (promotion off, placement forced: the first D requests on the
device tier, the rest on the host tier). Every device-lane decode step is timed on the engine's thread
(wall and thread CPU time), and so is every host-lane step on its own thread. The slowdown is the median
device step at full batch with a host step in flight, over the median with the host lane idle. D takes
several values (--device-seqs 10,32): at 32 rows of 1k tokens the step is GPU-bound and the lanes barely touch,
while at the ~10 rows of the decode-heavy 0.6B workload auto's device steps ran 5-7% slower than gpu's (H100
host, 2026-11-22; measured with benchmarks/profile_timeline.py at commit 1d50936).

--async-scheduling times the device lane as the engine runs it by default: a step is the interval from one
device-step launch to the next, so host work that overlaps the GPU's step costs nothing. --beside names what
runs beside the device lane in the "busy" run: the host lane (default); "memory", 14 threads streaming reads over
4 GiB with no host lane (is it the host kernel's DRAM traffic?); or "spin", 14 threads spinning without memory
traffic (is it the cores?).
Writes benchmarks/results/<device>/lane_interference.json (or --out).
"""
import argparse
import contextlib
import json
import os
import statistics
import threading
import time

import numba
import numpy as np
import torch

from benchmarks.engine_run import random_prompts
from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner.deferred_tokens import DeferredTokens
from offload_engine.engine.sched import scheduler as scheduler_module
from offload_engine.engine.sequence import BlockLocation


def force_placement(num_device: int) -> None:
    """The first num_device admissions go to the device tier, every later one to the host tier."""
    admitted = []

    def choose(seq, policy, blocks, running, *args, **kwargs):
        tier = BlockLocation.GPU if len(admitted) < num_device else BlockLocation.CPU
        if not blocks.can_allocate(seq, tier):
            return None
        admitted.append(seq.seq_id)
        return tier

    scheduler_module.choose_tier = choose


def timed_runs(llm: LLM, cadence: bool = False, load: "BackgroundLoad | None" = None) -> list[dict]:
    """Wraps the runner so every step records its lane, batch, wall and thread CPU time, and (device lane)
    whether a host step (or the background load) was in flight while it ran. With cadence, a device decode
    step's wall time is the interval since the last device decode launch, and nothing waits for its tokens."""
    engine, records = llm.engine, []
    steps = {(lane, is_prefill): getattr(engine.runner, name) for name, lane, is_prefill in STEPS}
    last_launch = [None]

    def timed(seqs, is_prefill, lane="device"):
        run = lambda *_: steps[lane, is_prefill](seqs)
        busy = engine.in_flight is not None or (load is not None and load.running)
        wall, cpu = time.perf_counter(), time.thread_time()
        if cadence and lane == "device":
            previous, last_launch[0] = last_launch[0], None if is_prefill else wall
            tokens = run(seqs, is_prefill, lane)
            if is_prefill or previous is None:
                return tokens
            records.append({"lane": lane, "prefill": False, "batch": len(seqs), "host_busy": busy,
                            "wall_ms": 1e3 * (wall - previous), "cpu_ms": None,
                            "thread": threading.current_thread().name})
            return tokens
        tokens = run(seqs, is_prefill, lane)
        if isinstance(tokens, DeferredTokens):  # a device step returns once queued: time it to its tokens
            tokens.wait()
        record = {"lane": lane, "prefill": is_prefill, "batch": len(seqs), "host_busy": busy,
                  "wall_ms": 1e3 * (time.perf_counter() - wall), "cpu_ms": 1e3 * (time.thread_time() - cpu),
                  "thread": threading.current_thread().name}
        if lane == "host":  # the loop's own split of its step (whole-step host graphs only)
            record["host_work_ms"] = 1e3 * engine.runner.host_kernel_seconds["host"]
            graphs = engine.runner.decode_graphs.get("host")
            wait = getattr(graphs, "last_device_wait_seconds", None)  # None: no whole-step host graphs (CPU)
            record["device_wait_ms"] = None if wait is None else 1e3 * wait
        records.append(record)
        return tokens

    for name, lane, is_prefill in STEPS:
        setattr(engine.runner, name, lambda seqs, lane=lane, is_prefill=is_prefill: timed(seqs, is_prefill, lane))
    return records


STEPS = (("prefill", "device", True), ("launch_device_decode", "device", False), ("decode_host", "host", False))


@numba.njit(nogil=True, cache=True)
def _stream(data: np.ndarray, rounds: int) -> float:
    total = 0.0
    for _ in range(rounds):
        for i in range(0, data.size, 8):  # one float64 a cache line: the read rate, not the adds, bounds it
            total += data[i]
    return total


@numba.njit(nogil=True, cache=True)
def _spin(iterations: int) -> float:
    x = 1.0
    for _ in range(iterations):
        x = x * 1.0000001 + 1e-9
    return x


class BackgroundLoad:
    """Threads that read memory ("memory": 4 GiB split among them, as the host kernel streams its pool) or
    only spin ("spin") beside the device lane, in numba without the GIL, until stopped."""

    def __init__(self, kind: str, threads: int = 14):
        self.kind, self.running, self._stop = kind, False, threading.Event()
        chunk = (4 << 30) // 8 // threads
        self._data = [np.random.rand(chunk) for _ in range(threads)] if kind == "memory" else [None] * threads
        self._work(0)  # compile before the clock
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def _work(self, i: int) -> None:
        if self.kind == "memory":
            _stream(self._data[i], 1)
        else:
            _spin(2_000_000)

    def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            self._work(i)

    def __enter__(self):
        self.running = True
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.running = False


def summarize(records: list[dict], batch: int) -> dict:
    device = [r for r in records if r["lane"] == "device" and not r["prefill"] and r["batch"] == batch]
    host = [r for r in records if r["lane"] == "host"]

    def median(rows, key):  # None where no row measured it (cadence records no thread CPU time)
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    idle, busy = [r for r in device if not r["host_busy"]], [r for r in device if r["host_busy"]]
    return {"device_steps_idle": len(idle), "device_steps_busy": len(busy),
            "device_step_ms_idle": median(idle, "wall_ms"), "device_step_ms_busy": median(busy, "wall_ms"),
            "device_cpu_ms_idle": median(idle, "cpu_ms"), "device_cpu_ms_busy": median(busy, "cpu_ms"),
            "host_steps": len(host), "host_step_ms": median(host, "wall_ms"), "host_cpu_ms": median(host, "cpu_ms"),
            "host_work_ms": median(host, "host_work_ms"), "host_device_wait_ms": median(host, "device_wait_ms")}


def run_case(path: str, args, device_seqs: int, with_host: bool) -> dict:
    vocab = 400 if args.model == "tiny" else 10000
    device_prompts = random_prompts([args.device_prompt] * device_seqs, vocab, seed=1)
    with_host_rows = with_host and args.beside == "host"
    host_prompts = random_prompts([args.host_prompt] * args.host_seqs, vocab, seed=2) if with_host_rows else []
    budget = -(-(args.device_prompt + args.output) // 16)
    # async_scheduling=False (the default here): each device step is timed from its launch to its tokens.
    llm = LLM(path, kv_placement="auto", kv_promotion=False, async_scheduling=args.async_scheduling,
              num_gpu_blocks=device_seqs * budget + 16, cpu_kv_cache_gb=args.cpu_kv_cache_gb,
              max_num_seqs=device_seqs + args.host_seqs,
              max_model_len=max(args.device_prompt, args.host_prompt) + args.output)
    llm.generate([[7] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    force_placement(device_seqs)
    load = BackgroundLoad(args.beside) if with_host and not with_host_rows else None
    records = timed_runs(llm, cadence=args.async_scheduling, load=load)
    params = SamplingParams(temperature=0.6, max_tokens=args.output, ignore_eos=True)
    # Host-tier sequences are admitted after the device ones, so their prompts go last and start last.
    start = time.perf_counter()
    with load or contextlib.nullcontext():
        outputs = llm.generate(device_prompts + host_prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [o.kv_location for o in outputs] == ["gpu"] * device_seqs + ["cpu"] * len(host_prompts)
    llm.close()
    return {"seconds": seconds, **summarize(records, device_seqs)}


def main() -> None:
    from benchmarks.bench_throughput import RESULTS, device_slug, model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device-seqs", default="10,32", help="device-lane batch sizes, comma-separated")
    parser.add_argument("--device-prompt", type=int, default=1024)
    parser.add_argument("--host-seqs", type=int, default=32)
    parser.add_argument("--host-prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=384)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=10.0)
    parser.add_argument("--label", default="current", help="what code this measures (before/after a change)")
    parser.add_argument("--host-priority", type=int, default=None,
                        help="the host lane's CUDA stream priority for this run (lower is more urgent; the engine's "
                             "is engine/cuda_streams.PRIORITIES['host'])")
    parser.add_argument("--host-sm-share", type=int, default=None,
                        help="the host lane's matrix products target 1/N of the SMs for this run (1: all of them; the "
                             "engine's is engine/host_step_graphs.SM_SHARE)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="time the device lane's cadence (launch to launch) with async scheduling on")
    parser.add_argument("--beside", choices=("host", "memory", "spin"), default="host",
                        help="what runs beside the device lane in the busy run")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = model_dir(args.model, args.model_cache)
    if args.host_priority is not None:  # before the first engine makes the process's streams
        from offload_engine.engine.runner import cuda_streams

        cuda_streams.PRIORITIES["host"] = cuda_streams.PRIORITIES["capture-host"] = args.host_priority
    if args.host_sm_share is not None:
        from offload_engine.engine.graphs import host_step_graphs

        host_step_graphs.SM_SHARE = args.host_sm_share
    result = {"label": args.label, "model": args.model, "device": device_slug(), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "host_cores": os.cpu_count(), "config": vars(args),
              "switch_interval_s": __import__("sys").getswitchinterval()}
    result["by_batch"] = {}
    for size in (int(n) for n in args.device_seqs.split(",")):
        case = {"idle": run_case(path, args, size, with_host=False), "busy": run_case(path, args, size, with_host=True)}
        idle, busy = case["idle"]["device_step_ms_idle"], case["busy"]["device_step_ms_busy"]
        case["slowdown"] = busy / idle if idle and busy else None
        result["by_batch"][str(size)] = case
        busy_case = case["busy"]
        wait = busy_case["host_device_wait_ms"]
        host = (f"; host step {busy_case['host_step_ms']:.1f} ms (host work {busy_case['host_work_ms']:.1f}, waits "
                f"for the device {'n/a' if wait is None else f'{wait:.1f}'})" if busy_case["host_step_ms"] else "")
        print(f"[{args.label}] device step at batch {size}: {idle:.2f} ms idle, {busy:.2f} ms beside "
              f"{args.beside} = {case['slowdown']:.3f}x{host}", flush=True)
    out = args.out or os.path.join(RESULTS, result["device"], f"lane_interference_{args.label}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, allow_nan=False)


if __name__ == "__main__":
    main()
