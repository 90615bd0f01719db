"""Long contexts across both tiers, against the platform's ceilings measured in the same process.

    python -m benchmarks.bench_long_context --workload c|c256|c512|batch8b|tiny [--out-dir DIR] [--skip-peer]
        [--skip-cpu] [--peer-only JSON]

Workloads: c, one 262,144-token context (262,080 + 64) on the 0.6B shape with a 32,768-token device budget
(workloads.py's full profile), and the same context with 256 or 512 new tokens (c256, c512); batch8b, 8 x (32,768 +
256) on the 8B shape at a 24 GB card's 3,296 device blocks; tiny, the embedded model on the CPU (the test's). Each
runs kv_placement="auto" with streaming (the entry), the same with stream_host_kv=False (the CPU path alone),
kv_placement="cpu", and transformers' generate with the offloaded cache on the same prompts. The result merges, by
workload, into <out-dir>/long_context.json = {"device", "date", "commit", "entries"} (default out-dir
benchmarks/results/<device>/); it is written after every run.
- decode_tok_per_s: tokens made by decode steps over the decode steps' seconds (the call less its prefill steps).
  rows / median step (rows_over_median_step_tok_per_s) agrees where every row is in every step (c), but where
  device rows step on their own lane beside a host lane (batch8b) a median step is a device step.
- bound_tok_per_s: those tokens over the slower of the device's bytes / hbm_gbps and host KV bytes / the host's
  rate, the two paths' sum_gbps measured at once (platform_ceilings; off CUDA, the kernel's alone, for both). Host
  bytes are what the lane stats counted over the timed call (stream_bytes + host_kernel_bytes). The device's bytes
  are the rest of the KV the decode steps read (a row's step j reads prompt + j tokens) and the weights, once per
  decode step of either lane (a host step runs its rows' dense layers on the device): the two lanes run at once,
  so the slower side bounds the call. That is the bound of the engine's plan (which rows decode where); the plan
  itself is placement's (docs/design.md).
- host_step_parts: the host steps' seconds over the timed call, split into the CPU kernels' work, their waits for
  the device's side of each layer, and the rest (LaneStats.host_step_parts).
- streamed_share: stream_bytes / (stream_bytes + host_kernel_bytes) over the timed call.
- output_tok_per_s: generated tokens over the whole generate call, prefill included, as the peer is timed;
  vs_hf_offloaded_decode sets decode_tok_per_s against the peer's tokens after its first (its prefill set apart).
- combined_over_kernel_alone: the ceilings' both-at-once over the kernel alone, at the workload's shape: what
  stream_on_over_off could reach if streaming off ran at the kernel's ceiling and streaming on at the combined one.
- hf_offloaded_*: each attempt a subprocess with a time limit (a full batch was OOM-killed for host memory), the
  largest batch first; every failure is recorded with its reason. --deadline-s bounds the process so that a
  workload fits one 10-minute device call: the peer gets what is left, and the host-only run is skipped (recorded)
  when less is left than it should take. Where the peer needs a call of its own (c512), --skip-peer runs the rest
  and --peer-only JSON, on the same warm machine, runs the peer for the entry in JSON and writes it with the peer.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from benchmarks.bench_throughput import RESULTS, _host_pool_gb, device_slug, model_dir
from benchmarks.engine_run import measure, random_prompts
from benchmarks.workloads import PROFILES, QWEN3_8B_ON_24_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_MARK = "PEER_RESULT "
PEER_LOAD_S = 90.0  # a peer attempt's start beyond its generate budget: imports, weights to the device, warm-up
MIN_PEER_S = 20.0  # a generate budget below this is not attempted (recorded as such)
WRITE_RESERVE_S = 15.0  # kept back from the deadline for writing the result
_STARTED = time.perf_counter()


@dataclass(frozen=True)
class LongContext:
    name: str
    model: str  # a config in benchmarks/configs, or "tiny"
    num_seqs: int
    prompt_len: int
    output_len: int
    num_gpu_blocks: int  # of 16 tokens
    peer_batches: tuple[int, ...]  # tried in this order until one runs
    peer_seconds: float = 120.0  # the peer's generate budget per attempt
    vocab: int = 10000
    ceilings: dict = field(default_factory=dict)  # measure_ceilings' arguments
    llm_kwargs: dict = field(default_factory=dict)

    @property
    def context(self) -> int:
        return self.prompt_len + self.output_len

    def prompts(self) -> list[list[int]]:
        return random_prompts([self.prompt_len] * self.num_seqs, self.vocab, seed=2)


_FULL = PROFILES["full"]
# c's new tokens: the suite's 16 left 15 decode steps, of which the first few settle the streamed share; 64 measure
# the steady state (the context stays 262,144 tokens).
C_OUTPUT = 64
# The ceilings at c's own shape (0.6B: 16 query heads over 8 KV heads; one row of the host's 229,376 tokens): fewer
# query heads make the kernel lighter per byte, so the 8B shape's ceiling would understate c's kernel alone.
C_CEILINGS = dict(batch=1, tokens=_FULL.c_context - _FULL.c_budget_tokens, q_heads=16)
WORKLOADS = {
    "c": LongContext("c", _FULL.c_model, 1, _FULL.c_context - C_OUTPUT, C_OUTPUT, _FULL.c_budget_tokens // 16,
                     peer_batches=(1,), ceilings=C_CEILINGS),
    # c generating as many tokens as batch8b: its one 262k prefill (which neither engine can shorten) weighs less on
    # the whole call. The peer needs ~210 s at this length; its budget lets it finish (a peer cut short would read
    # slower than it is), so this runs with --skip-cpu in one call.
    "c256": LongContext("c256", _FULL.c_model, 1, _FULL.c_context - 256, 256, _FULL.c_budget_tokens // 16,
                        peer_batches=(1,), peer_seconds=260.0, ceilings=C_CEILINGS),
    # c at 512 new tokens: the whole call's ratio to the peer rises with the new tokens toward decode's (3.36x on the
    # H200 host at c256, 3.65x on the H100 host at c). Its peer (~360 s on the H200 host, ~400 s on the H100 host)
    # takes a call of its own: --skip-peer here, then --peer-only on the same warm host.
    "c512": LongContext("c512", _FULL.c_model, 1, _FULL.c_context - 512, 512, _FULL.c_budget_tokens // 16,
                        peer_batches=(1,), peer_seconds=470.0, ceilings=C_CEILINGS),
    "batch8b": LongContext("batch8b", "qwen3-8b", 8, 32768, 256, QWEN3_8B_ON_24_GIB, peer_batches=(8, 4, 2, 1)),
    # Both rows longer than the device pool (128 tokens): split, on the host lane, as c's row is.
    "tiny": LongContext("tiny", "tiny", 2, 240, 8, 8, peer_batches=(2, 1), peer_seconds=10.0, vocab=400,
                        ceilings=dict(seconds=0.2, batch=2, tokens=1024),
                        llm_kwargs=dict(device="cpu", num_cpu_blocks=16)),
}


class Deadline:
    def __init__(self, seconds: float):
        self.at = time.perf_counter() + seconds

    def left(self) -> float:
        return self.at - time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _STARTED:5.0f}s] {message}", flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def host_reads(run: dict) -> dict:
    """Host KV bytes each path read over the timed call (LaneStats.snapshot deltas), and the streamed share."""
    after, before = run.get("lane_stats") or {}, run.get("lane_stats_before") or {}
    if "stream_bytes" not in after:
        return {"stream_bytes": None, "host_kernel_bytes": None, "streamed_share": None}
    stream = after["stream_bytes"] - before.get("stream_bytes", 0)
    kernel = after["host_kernel_bytes"] - before.get("host_kernel_bytes", 0)
    return {"stream_bytes": stream, "host_kernel_bytes": kernel,
            "streamed_share": stream / (stream + kernel) if stream + kernel else None}


def decode_bound(num_seqs: int, prompt_len: int, output_len: int, kv_bytes_per_token: int, host_bytes: int,
                 decode_tokens: int, hbm_gbps: float, host_gbps: float, weight_bytes: int = 0,
                 decode_steps: int = 0) -> dict:
    """Decode tokens over the slower of the device's and the host's reads (module docstring). Decode step j (1 to
    output_len - 1; the prefill made token 0) of a row reads prompt_len + j tokens' KV; each of decode_steps
    (both lanes') reads weight_bytes on the device."""
    steps = output_len - 1
    total = num_seqs * (steps * prompt_len + steps * (steps + 1) // 2) * kv_bytes_per_token
    device_kv = max(0, total - host_bytes)
    device_weights = weight_bytes * decode_steps
    device_seconds = (device_kv + device_weights) / (hbm_gbps * 1e9)
    host_seconds = host_bytes / (host_gbps * 1e9)
    seconds = max(device_seconds, host_seconds)
    return {"bound_tok_per_s": decode_tokens / seconds if seconds else None, "device_kv_bytes": device_kv,
            "device_weight_bytes": device_weights, "host_kv_bytes": host_bytes, "bound_hbm_gbps": hbm_gbps,
            "bound_host_gbps": host_gbps, "bound_device_seconds": device_seconds, "bound_host_seconds": host_seconds,
            "bound_limited_by": "host" if host_seconds >= device_seconds else "device"}


def host_step_parts(run: dict) -> dict | None:
    """The host steps' seconds over the timed call: per step, and the shares of kernel work, device waits, rest."""
    after = (run.get("lane_stats") or {}).get("host_step_parts")
    before = (run.get("lane_stats_before") or {}).get("host_step_parts") or {}
    if not after:
        return None
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    steps, seconds = delta["steps"], delta["seconds"]
    if not steps or seconds <= 0:
        return None
    rest = seconds - delta["kernel_seconds"] - delta["device_wait_seconds"]
    return {"steps": steps, "ms_per_step": 1e3 * seconds / steps,
            "kernel_share": delta["kernel_seconds"] / seconds,
            "device_wait_share": delta["device_wait_seconds"] / seconds, "rest_share": rest / seconds}


def bound_rates(ceilings: dict) -> tuple[float, float, str]:
    """(device GB/s, host GB/s, where the host's comes from) for the bounds."""
    together = ceilings.get("together")
    host, source = (together["sum_gbps"], "together.sum_gbps") if together else \
        (ceilings["host_kernel_gbps"], "host_kernel_gbps")
    return ceilings.get("hbm_gbps") or host, host, source


def derived(spec: LongContext, run: dict, ceilings: dict) -> dict:
    """A run's rates, host reads, bound and fraction of it (None where the run failed)."""
    if "error" in run:
        return {"decode_tok_per_s": None, "bound_tok_per_s": None, "fraction_of_bound": None, "streamed_share": None,
                "prefill_tok_per_s": None, "output_tok_per_s": None}
    decoded = sum(run["decoded_by_lane"].values())
    decode_seconds = run["seconds"] - run["prefill_seconds"]
    rates = {"decode_tokens": decoded, "decode_seconds": decode_seconds,
             "decode_tok_per_s": decoded / decode_seconds if decode_seconds > 0 else None,
             "rows_over_median_step_tok_per_s": ratio(1e3 * spec.num_seqs, run["decode_step_ms_median"]),
             "prefill_tok_per_s": ratio(spec.num_seqs * spec.prompt_len, run["prefill_seconds"]),
             "output_tok_per_s": run["output_tok_per_s"], **host_reads(run)}
    hbm, host, source = bound_rates(ceilings)
    host_bytes = rates["host_kernel_bytes"]
    if host_bytes is None or (host_bytes + rates["stream_bytes"] == 0 and run["decoded_by_lane"].get("host")):
        return {**rates, "bound_tok_per_s": None, "fraction_of_bound": None,
                "bound_note": "the lane stats counted no host KV reads over a call with host-lane tokens"}
    bound = decode_bound(spec.num_seqs, spec.prompt_len, spec.output_len, run["kv_bytes_per_token"],
                         host_bytes + rates["stream_bytes"], decoded, hbm, host, run.get("weight_bytes", 0),
                         sum((run.get("steps_by_lane") or {}).values()))
    return {**rates, **bound, "bound_host_source": source, "host_step_parts": host_step_parts(run),
            "fraction_of_bound": ratio(rates["decode_tok_per_s"], bound["bound_tok_per_s"])}


def engine_run(spec: LongContext, path: str, placement: str, stream: bool, ceilings: dict) -> dict:
    """One measured engine run with its derived figures, or {"error": ...} with them None."""
    from offload_engine.config import ModelConfig

    config = ModelConfig.from_model_dir(path)
    kwargs = {"max_model_len": spec.context, "max_num_seqs": spec.num_seqs, "block_size": 16,
              "num_gpu_blocks": spec.num_gpu_blocks, **spec.llm_kwargs}
    if "num_cpu_blocks" not in kwargs:  # the whole batch fits the host tier
        kwargs["cpu_kv_cache_gb"] = _host_pool_gb(spec.num_seqs * spec.context * config.kv_bytes_per_token(config.dtype)
                                                  / 2**30)
    began = time.perf_counter()
    try:
        run = measure(path, spec.prompts(), [spec.output_len] * spec.num_seqs, lane_stats_before=True,
                      kv_placement=placement, stream_host_kv=stream, **kwargs)
    except (ValueError, RuntimeError, TypeError, OSError, torch.OutOfMemoryError) as error:
        run = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    run = {"kv_placement": placement, "stream_host_kv": stream, "wall_seconds": time.perf_counter() - began, **run}
    return {**run, **derived(spec, run, ceilings)}


def summary(spec: LongContext, label: str, run: dict) -> str:
    def f(x, form=".2f"):
        return "-" if x is None else format(x, form)

    return (f"[{spec.name}] {label}: decode {f(run['decode_tok_per_s'])} tok/s = {f(run['fraction_of_bound'])} of its "
            f"bound {f(run['bound_tok_per_s'])}, streamed share {f(run['streamed_share'])}, prefill "
            f"{f(run['prefill_tok_per_s'], '.0f')} tok/s, output {f(run['output_tok_per_s'])} tok/s, "
            f"{run.get('kv_location', '')} {run.get('error', '')}")


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}" + (" (the OOM killer's signal: host memory?)" if -code == signal.SIGKILL else "")


def run_peer_attempt(request: dict, timeout_s: float) -> dict:
    """One hf_generate (offloaded cache) in a subprocess: its result, or {"error": why it gave none}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.bench_long_context", "--peer-attempt", json.dumps(request)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"killed at its time limit of {timeout_s:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(PEER_MARK):
            return json.loads(line[len(PEER_MARK):])
    return {"error": f"{describe_exit(done.returncode)}, no result; stderr: {done.stderr[-400:].strip()}"}


def peer_attempt(request: dict) -> None:
    """The subprocess's side: the prompts rebuilt from their seed, generate run, the result printed."""
    from benchmarks.peers import hf_generate

    prompts = random_prompts(request["lengths"], request["vocab"], seed=request["seed"])
    result = hf_generate(request["model_dir"], prompts, request["output_len"], "offloaded", request["batch_size"],
                         request["seconds"])
    print(PEER_MARK + json.dumps(result), flush=True)


def hf_offloaded(spec: LongContext, path: str, deadline: Deadline, batches: tuple[int, ...] | None = None) -> dict:
    """transformers' offloaded cache on the workload's prompts, the largest batch first, smaller ones on failure.

    batches (default the workload's) narrows the attempts; a batch left out is recorded as not attempted.
    """
    base = {"model_dir": path, "lengths": [spec.prompt_len] * spec.num_seqs, "vocab": spec.vocab, "seed": 2,
            "output_len": spec.output_len}
    batches = spec.peer_batches if batches is None else batches
    failures = [{"batch": b, "reason": "not attempted: --peer-batches"} for b in spec.peer_batches
                if b not in batches and b > max(batches)]
    for batch in batches:
        left = deadline.left() - WRITE_RESERVE_S
        budget = min(spec.peer_seconds, left - PEER_LOAD_S)
        if budget < min(MIN_PEER_S, spec.peer_seconds):
            failures.append({"batch": batch, "reason": f"not attempted: {left:.0f} s left before the deadline"})
            log(f"[{spec.name}] transformers offloaded, batch {batch} {failures[-1]['reason']}")
            continue
        log(f"[{spec.name}] transformers offloaded, batch {batch}, {budget:.0f} s generate budget")
        began = time.perf_counter()
        result = run_peer_attempt({**base, "batch_size": batch, "seconds": budget}, budget + PEER_LOAD_S)
        seconds = time.perf_counter() - began
        if result.get("error") or not result.get("output_tokens"):
            failures.append({"batch": batch, "reason": result.get("error") or "no tokens within its budget",
                             "seconds": seconds})
            log(f"[{spec.name}] transformers offloaded, batch {batch} failed: {failures[-1]['reason']}")
            continue
        log(f"[{spec.name}] transformers offloaded, batch {batch}: {result['output_tok_per_s']:.2f} output tok/s")
        return {"hf_offloaded_tok_per_s": result["output_tok_per_s"], "hf_offloaded_batch": batch,
                "hf_offloaded_decode_tok_per_s": result.get("decode_tok_per_s"), "hf_offloaded_failures": failures,
                "hf_offloaded": result}
    return {"hf_offloaded_tok_per_s": None, "hf_offloaded_batch": None, "hf_offloaded_decode_tok_per_s": None,
            "hf_offloaded_failures": failures, "hf_offloaded": None}


def merge_entry(path: str, entry: dict, header: dict) -> dict:
    """Writes header + entries to path, entry in place of the one of its workload (others kept); returns it."""
    try:
        with open(path) as f:
            entries = json.load(f).get("entries", [])
    except (OSError, ValueError):
        entries = []
    names = [e.get("workload") for e in entries]
    if entry["workload"] in names:
        entries[names.index(entry["workload"])] = entry
    else:
        entries.append(entry)
    document = {**header, "entries": entries}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(document, f, indent=2, default=str)
    os.replace(path + ".partial", path)
    return document


def commit() -> str | None:
    """BENCH_COMMIT where set (the device machine's copy of the tree may carry a stale .git), else the checkout's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


HEADLINE = ("decode_tok_per_s", "bound_tok_per_s", "fraction_of_bound", "bound_limited_by", "streamed_share", "stream_bytes",
            "host_kernel_bytes", "prefill_tok_per_s", "output_tok_per_s")


def plot(json_path: str, png_path: str) -> None:
    """long_context.json's entries: decode as a fraction of the bound (streaming on, off, host-only placement), and
    output tok/s against transformers' offloaded cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        entries = json.load(f)["entries"]
    names = [f"{e.get('workload')}\n{e.get('num_seqs', 0)} x {e.get('prompt_len', 0):,}\n({e.get('commit')})"
             for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    width, x = 0.25, range(len(entries))
    host_only_bound = lambda e: (e.get("runs", {}).get("cpu") or {}).get("bound_tok_per_s")
    for k, (label, rate, bound) in enumerate((
            ("streaming on (auto)", "decode_tok_per_s", lambda e: e.get("bound_tok_per_s")),
            ("streaming off", "decode_tok_per_s_cpu_path_only", lambda e: e.get("bound_tok_per_s")),
            ("host-only placement (of its own bound)", "cpu_placement_tok_per_s", host_only_bound))):
        values = [ratio(e.get(rate), bound(e)) or 0 for e in entries]
        _bars(left, [i + (k - 1) * width for i in x], values, width, label)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set_xticks(list(x), names, fontsize=8)
    left.set_ylabel("decode tok/s / bound (both paths' ceilings)")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    ours = [e.get("output_tok_per_s") or 0 for e in entries]
    peer = [e.get("hf_offloaded_tok_per_s") or 0 for e in entries]
    for k, (label, values) in enumerate((("offload-engine", ours), ("transformers offloaded cache", peer))):
        _bars(right, [i + (k - 0.5) * width for i in x], values, width, label, log=True)
    right.set_xticks(list(x), names, fontsize=8)
    right.set_ylabel("output tok/s (prefill included)")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    fig.suptitle(f"Long contexts beyond VRAM, {entries[0].get('device', '') if entries else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _bars(ax, xs: list[float], values: list[float], width: float, label: str, log: bool = False) -> None:
    """Bars labelled with their values; a missing value (0) is written "not run" at the axis' foot."""
    if log:
        ax.set_yscale("log")
    bars = ax.bar(xs, [v or float("nan") for v in values], width, label=label)
    ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in values], fontsize=7)
    for x, v in zip(xs, values):
        if not v:
            ax.text(x, 0.02, "not run", transform=ax.get_xaxis_transform(), ha="center", fontsize=7, rotation=90)


def with_peer(entry: dict, spec: LongContext, path: str, deadline: Deadline,
              peer_batches: tuple[int, ...] | None = None) -> dict:
    """The entry with transformers' offloaded cache run on its prompts, and our rates set against the peer's."""
    entry.update(hf_offloaded(spec, path, deadline, peer_batches))
    entry["skipped"].pop("hf_offloaded", None)
    return with_peer_ratios(entry)


def with_peer_ratios(entry: dict) -> dict:
    entry["vs_hf_offloaded"] = ratio(entry["output_tok_per_s"], entry["hf_offloaded_tok_per_s"])
    entry["vs_hf_offloaded_decode"] = ratio(entry["decode_tok_per_s"], entry["hf_offloaded_decode_tok_per_s"])
    return entry


def entry_of(json_path: str, workload: str) -> dict:
    """The workload's entry in a long_context.json, for --peer-only; an OSError or ValueError names what is missing."""
    try:
        with open(json_path) as f:
            entries = json.load(f).get("entries", [])
    except ValueError as e:
        raise ValueError(f"--peer-only {json_path}: not a long_context.json ({e})") from None
    found = [e for e in entries if e.get("workload") == workload]
    if not found:
        raise ValueError(f"--peer-only {json_path} has no entry of workload {workload!r} (it has "
                         f"{[e.get('workload') for e in entries]}): run --workload {workload} --skip-peer first")
    return found[0]


def peer_only(spec: LongContext, entry_path: str, out_path: str, deadline: Deadline, model_cache: str,
              peer_batches: tuple[int, ...] | None = None) -> dict:
    """The peer alone, for an entry an earlier call of this machine measured with --skip-peer: where the peer needs
    a call of its own. The entry keeps its own date and commit; the peer's call adds its own (hf_offloaded_call)."""
    entry = entry_of(entry_path, spec.name)
    if entry.get("device") != device_slug():
        raise ValueError(f"--peer-only {entry_path}: its {spec.name} entry ran on {entry.get('device')}, this is "
                         f"{device_slug()}: set the peer against runs of the same machine")
    header = {"device": device_slug(), "date": time.strftime("%Y-%m-%d"), "commit": commit()}
    entry["hf_offloaded_call"] = header
    with_peer(entry, spec, model_dir(spec.model, model_cache), deadline, peer_batches)
    merge_entry(out_path, entry, {k: entry[k] for k in ("device", "date", "commit")})
    log(f"[{spec.name}] wrote {out_path}: transformers offloaded {entry['hf_offloaded_tok_per_s']} tok/s at batch "
        f"{entry['hf_offloaded_batch']}, vs transformers offloaded {entry['vs_hf_offloaded']}")
    return entry


def run_workload(spec: LongContext, ceilings: dict, out_path: str, deadline: Deadline, model_cache: str,
                 skip_peer: bool = False, skip_cpu: bool = False, peer_batches: tuple[int, ...] | None = None) -> dict:
    """The workload's entry, written to out_path after every run (see the module docstring)."""
    header = {"device": device_slug(), "date": time.strftime("%Y-%m-%d"), "commit": commit()}
    log(f"[{spec.name}] model {spec.model}")
    path = model_dir(spec.model, model_cache)
    entry = {"workload": spec.name, "model": spec.model, "num_seqs": spec.num_seqs, "prompt_len": spec.prompt_len,
             "output_len": spec.output_len, "num_gpu_blocks": spec.num_gpu_blocks, **header, "ceilings": ceilings,
             "skipped": {}, "runs": {}}

    def save():
        merge_entry(out_path, entry, header)

    for label, placement, stream in (("stream_on", "auto", True), ("stream_off", "auto", False)):
        log(f"[{spec.name}] {label}: kv_placement={placement}, stream_host_kv={stream}")
        entry["runs"][label] = engine_run(spec, path, placement, stream, ceilings)
        log(summary(spec, label, entry["runs"][label]))
        save()
    on, off = entry["runs"]["stream_on"], entry["runs"]["stream_off"]
    entry.update({key: on.get(key) for key in HEADLINE})
    entry["decode_tok_per_s_cpu_path_only"] = off["decode_tok_per_s"]
    entry["stream_on_over_off"] = ratio(on["decode_tok_per_s"], off["decode_tok_per_s"])
    entry["combined_over_kernel_alone"] = ceilings.get("combined_over_kernel_alone")  # what on / off could reach
    entry["cpu_placement_tok_per_s"] = None
    needed = 1.2 * off["wall_seconds"]
    if skip_cpu:
        entry["skipped"]["cpu_placement"] = "--skip-cpu"
    elif deadline.left() - WRITE_RESERVE_S < needed:
        entry["skipped"]["cpu_placement"] = f"{deadline.left():.0f} s left before the deadline, ~{needed:.0f} s needed"
    else:
        log(f"[{spec.name}] cpu: kv_placement=cpu")
        entry["runs"]["cpu"] = engine_run(spec, path, "cpu", True, ceilings)
        entry["cpu_placement_tok_per_s"] = entry["runs"]["cpu"]["decode_tok_per_s"]
        log(summary(spec, "cpu", entry["runs"]["cpu"]))
    save()
    if skip_peer:
        entry["skipped"]["hf_offloaded"] = "--skip-peer"
        entry.update(hf_offloaded_tok_per_s=None, hf_offloaded_batch=None, hf_offloaded_decode_tok_per_s=None,
                     hf_offloaded_failures=[], hf_offloaded=None)
        with_peer_ratios(entry)
    else:
        with_peer(entry, spec, path, deadline, peer_batches)
    for reason in entry["skipped"].items():
        log(f"[{spec.name}] skipped {reason[0]}: {reason[1]}")
    save()
    log(f"[{spec.name}] wrote {out_path}: decode {entry['decode_tok_per_s']} tok/s, stream on / off "
        f"{entry['stream_on_over_off']}, vs transformers offloaded {entry['vs_hf_offloaded']}")
    return entry


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--out-dir", default=None, help="default benchmarks/results/<device>")
    parser.add_argument("--skip-peer", action="store_true", help="no transformers run (recorded as skipped)")
    parser.add_argument("--skip-cpu", action="store_true", help="no kv_placement='cpu' run (recorded as skipped)")
    parser.add_argument("--peer-batches", default=None, help="comma-separated batch sizes for transformers, tried "
                        "in order (default the workload's); larger ones left out are recorded as not attempted")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="the process's wall-clock budget")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--peer-only", default=None, metavar="JSON",
                        help="only the peer, for the workload's entry in JSON (a --skip-peer run of this machine)")
    parser.add_argument("--peer-attempt", default=None, help=argparse.SUPPRESS)  # a peer subprocess's request
    parser.add_argument("--plot", default=None, metavar="JSON", help="only plot a long_context.json beside it")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return None
    if args.peer_attempt:
        peer_attempt(json.loads(args.peer_attempt))
        return None
    from benchmarks.platform_ceilings import measure_ceilings

    spec, deadline = WORKLOADS[args.workload], Deadline(args.deadline_s)
    out_dir = args.out_dir or os.path.join(RESULTS, device_slug())
    out_path = os.path.join(out_dir, "long_context.json")
    peer_batches = tuple(int(b) for b in args.peer_batches.split(",")) if args.peer_batches else None
    if args.peer_only:
        return peer_only(spec, args.peer_only, out_path, deadline, args.model_cache, peer_batches)
    log(f"[{spec.name}] platform ceilings")
    ceilings = measure_ceilings(**spec.ceilings)
    log(f"[{spec.name}] ceilings: host kernel {ceilings['host_kernel_gbps']:.1f} GB/s, stream "
        f"{ceilings['stream_gbps']} GB/s, together {ceilings['together']}, HBM {ceilings['hbm_gbps']} GB/s "
        f"{ceilings['stream_error'] or ''}")
    entry = run_workload(spec, ceilings, out_path, deadline, args.model_cache, args.skip_peer, args.skip_cpu,
                         peer_batches)
    plot(out_path, os.path.splitext(out_path)[0] + ".png")
    return entry


if __name__ == "__main__":
    main()
