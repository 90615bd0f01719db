"""Where auto's time goes against gpu's on a decode-heavy workload (default: 0.6B, 32 x (1024 + 1024) at 1,024 device
blocks): per device-lane step its kind, batch and time; promote and demote time; waits for the host lane; per
host-lane step its rows, KV bytes, host work and waits for the device. Prints totals, the median device step
time per batch size with the host lane idle and busy, the host lane's rows and read rate over ten slices of the
run, and the mean device batch over the same slices.

    python -m benchmarks.profile_timeline {gpu,auto}      # writes $OUT/timeline_<placement>.json
    python -m benchmarks.profile_timeline auto --model qwen3-8b --num-seqs 64 --num-gpu-blocks 3296 --tag 8b
"""
import argparse
import collections, json, os, time, statistics
from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import measure, random_prompts
from offload_engine.engine.runner import model_runner
from offload_engine.engine import llm_engine
from offload_engine.engine.sched import lane_stats

host_steps = []  # (end time, rows, KV bytes, seconds, host work seconds, waits for the device)
orig_host_step = llm_engine.LLMEngine._host_step
def host_step(self, batch):
    t = time.perf_counter()
    tokens = orig_host_step(self, batch)
    graphs = self.runner.decode_graphs.get("host")
    waits = getattr(graphs, "last_device_wait_seconds", float("nan"))
    host_steps.append((time.perf_counter(), len(batch), sum(map(len, batch)) * self.stats.kv_bytes_per_token,
                       time.perf_counter() - t, self.runner.host_kernel_seconds["host"], waits))
    return tokens
llm_engine.LLMEngine._host_step = host_step
timed_steps = collections.defaultdict(list)  # (rows, host busy) -> seconds, steps without KV moves only
orig_done = lane_stats.LaneStats.device_step_done
def device_step_done(self, rows, seconds, host_busy):
    timed_steps[(rows, host_busy)].append(seconds)
    orig_done(self, rows, seconds, host_busy)
lane_stats.LaneStats.device_step_done = device_step_done

spent = collections.Counter(); count = collections.Counter(); steps = []
def timed(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try: return original(*a, **k)
        finally: spent[key] += time.perf_counter() - t; count[key] += 1
    setattr(owner, name, wrapper)
timed(model_runner.ModelRunner, "promote", "promote")
timed(model_runner.ModelRunner, "demote", "demote")
from offload_engine.engine.tiers import pinned_ring
from offload_engine.layers import attention
timed(pinned_ring.PinnedRing, "_retire_oldest", "ring_wait")  # host-tier prefill writes falling behind
timed(attention.Attention, "_stage_prefix", "stage_prefix")
orig_take = llm_engine.LLMEngine._take_host_step
def take(self, wait):
    t = time.perf_counter()
    try: return orig_take(self, wait)
    finally:
        if wait: spent["wait_host"] += time.perf_counter() - t; count["wait_host"] += 1
llm_engine.LLMEngine._take_host_step = take
orig_run = model_runner.ModelRunner.run
def run(self, seqs, is_prefill, lane="device"):
    if is_prefill and lane == "device" and gpu_events and gpu_events[-1] is not None:
        gpu_events.append(None)  # the next decode step's gap holds this prefill: not counted
    t = time.perf_counter()
    try: return orig_run(self, seqs, is_prefill, lane)
    finally:
        if lane == "device":
            steps.append((time.perf_counter(), is_prefill, len(seqs), time.perf_counter() - t,
                          sum(s.num_scheduled_tokens for s in seqs) if is_prefill else 0,
                          sum(s.num_scheduled_tokens for s in seqs if s.location == model_runner.BlockLocation.CPU)
                          if is_prefill else 0))
model_runner.ModelRunner.run = run
# Per device-lane decode step, CUDA events on its stream around its queued work: the GPU's time on the step, and
# the gap before it in which the GPU waited for the host (async scheduling hides the host's work only while it is
# shorter than the GPU's). Tagged with the step's rows and whether a host-lane step was in flight.
from offload_engine.engine.runner import device_decode
gpu_events, engines = [], []
orig_launch = device_decode.DeviceLaneDecode.launch
def launch(self, seqs, *a, **k):
    import torch
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    try: return orig_launch(self, seqs, *a, **k)
    finally:
        end.record()
        gpu_events.append((len(seqs), bool(engines and engines[0].in_flight is not None), begin, end, time.perf_counter()))
if __import__("torch").cuda.is_available(): device_decode.DeviceLaneDecode.launch = launch
# Where the engine thread's time goes in its slow steps (> 3 ms, where the GPU's ~2 queued ms run out) against
# the rest: each phase of LLMEngine._step timed, summed per kind of step.
move_calls = []  # (promote or demote, start, seconds) on the engine's thread
phase_now, phase_slow, phase_fast, slow_steps = collections.Counter(), collections.Counter(), collections.Counter(), [0, 0]
def phase(owner, name):
    original = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try: return original(*a, **k)
        finally:
            if __import__("threading").current_thread() is __import__("threading").main_thread():
                phase_now[name] += time.perf_counter() - t
                if name in ("promote", "demote"): move_calls.append((name, round(t, 5), round(time.perf_counter() - t, 5)))
    setattr(owner, name, wrapper)
from offload_engine.engine.sched import scheduler as scheduler_mod
for name in ("_take_host_step", "_land_promotions", "_promote", "_start_host_step", "_resolve_device_step"):
    phase(llm_engine.LLMEngine, name)
for name in ("schedule_promotions", "schedule_prefill", "promotion_hold_back", "host_step_pays", "schedule_decode",
             "launched", "postprocess", "resolve", "take_demotions"):
    phase(scheduler_mod.Scheduler, name)
for name in ("run", "demote", "promote"):
    phase(model_runner.ModelRunner, name)
orig_step = llm_engine.LLMEngine._step
def engine_step(self):
    if not engines: engines.append(self)
    phase_now.clear()
    t = time.perf_counter()
    try: return orig_step(self)
    finally:
        total = time.perf_counter() - t
        phase_now["total"] += total
        (phase_slow if total > 0.003 else phase_fast).update(phase_now)
        slow_steps[total > 0.003] += 1
llm_engine.LLMEngine._step = engine_step
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("placement", choices=("gpu", "auto", "cpu"))
parser.add_argument("--model", default="qwen3-0.6b")
parser.add_argument("--num-seqs", type=int, default=32)
parser.add_argument("--prompt-len", type=int, default=1024)
parser.add_argument("--output-len", type=int, default=1024)
parser.add_argument("--num-gpu-blocks", type=int, default=1024)
parser.add_argument("--tag", default="", help="appended to the output file's name")
parser.add_argument("--switch-interval", type=float, default=None, help="Python's GIL switch interval (seconds) for the run")
args = parser.parse_args()
if args.switch_interval is not None:
    __import__("sys").setswitchinterval(args.switch_interval)
placement = args.placement
vocab = 400 if args.model == "tiny" else 10000  # random ids below every model's vocabulary
r = measure(model_dir(args.model, "/tmp/offload_engine_models"), random_prompts([args.prompt_len] * args.num_seqs, vocab),
            [args.output_len] * args.num_seqs, kv_placement=placement, num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=256)
dec = [s for s in steps if not s[1]]; pre = [s for s in steps if s[1]]
by_batch = collections.defaultdict(list)
for s in dec: by_batch[s[2]].append(s[3])
summary = {"placement": placement, "workload": vars(args), "tok_s": r["output_tok_per_s"], "decoded_by_lane": r.get("decoded_by_lane"),
           "decode_steps": len(dec), "decode_s": sum(s[3] for s in dec), "mean_batch": statistics.mean(s[2] for s in dec),
           "prefill_steps": len(pre), "prefill_s": sum(s[3] for s in pre), "prefill_tokens": sum(s[4] for s in pre),
           "prefill_host_tokens": sum(s[5] for s in pre),
           "spent": dict(spent), "count": dict(count),
           "step_ms_by_batch": {b: round(1e3 * statistics.median(v), 2) for b, v in sorted(by_batch.items()) if len(v) > 20},
           "steps_by_batch": {b: len(v) for b, v in sorted(by_batch.items())}}
# device batch over time in 10 slices of the decode steps
n = len(dec); summary["batch_deciles"] = [round(statistics.mean(s[2] for s in dec[i * n // 10:(i + 1) * n // 10]), 1) for i in range(10)]
summary["step_ms_idle_busy"] = {
    b: [round(1e3 * statistics.median(timed_steps[(b, busy)]), 2) if len(timed_steps[(b, busy)]) > 10 else None
        for busy in (False, True)] for b in sorted({b for b, _ in timed_steps})}
summary["engine_phases_ms"] = {"slow_steps": slow_steps[1], "fast_steps": slow_steps[0],
                               "slow": {k: round(1e3 * v, 1) for k, v in phase_slow.most_common()},
                               "fast": {k: round(1e3 * v, 1) for k, v in phase_fast.most_common()}}
if gpu_events:
    per = collections.defaultdict(lambda: ([], []))  # (rows, busy) -> (GPU ms, gap ms before it)
    all_gpu, all_gap, step_gpu_ms = [], [], []
    for before, after in zip(gpu_events, gpu_events[1:]):
        if before is None or after is None: continue
        (_, _, _, prev_end, _), (rows, busy, begin, end, launched) = before, after
        gpu_ms, gap_ms = begin.elapsed_time(end), max(0.0, prev_end.elapsed_time(begin))
        if gap_ms < 50:  # not across a prefill or an idle device lane
            per[(rows, busy)][0].append(gpu_ms); per[(rows, busy)][1].append(gap_ms)
            all_gpu.append(gpu_ms); all_gap.append(gap_ms)
            step_gpu_ms.append((round(launched, 5), rows, busy, round(gpu_ms, 3)))
    typical = statistics.median(all_gpu)
    summary["gpu_totals_ms"] = {"steps": len(all_gpu), "gpu": round(sum(all_gpu)), "gaps": round(sum(all_gap)),
                                "gpu_over_1.5x_median": round(sum(g - typical for g in all_gpu if g > 1.5 * typical)),
                                "steps_over_1.5x_median": sum(g > 1.5 * typical for g in all_gpu)}
    summary["gpu_ms_gap_ms_idle_busy"] = {
        b: [[round(statistics.median(per[(b, busy)][i]), 3) for i in (0, 1)] if len(per[(b, busy)][0]) > 10 else None
            for busy in (False, True)] for b in sorted({b for b, _ in per})}
if host_steps:
    m = len(host_steps)
    sl = [host_steps[i * m // 10:(i + 1) * m // 10] for i in range(10)]
    summary["host"] = {"steps": m, "rows_mean": statistics.mean(h[1] for h in host_steps),
                       "step_ms_mean": 1e3 * statistics.mean(h[3] for h in host_steps),
                       "work_gbps": sum(h[2] for h in host_steps) / sum(h[4] for h in host_steps) / 1e9,
                       "waits_ms_mean": 1e3 * statistics.mean(h[5] for h in host_steps),
                       "rows_deciles": [round(statistics.mean(h[1] for h in x), 1) for x in sl if x],
                       "step_ms_deciles": [round(1e3 * statistics.mean(h[3] for h in x), 1) for x in sl if x],
                       "work_gbps_deciles": [round(sum(h[2] for h in x) / sum(h[4] for h in x) / 1e9, 1) for x in sl if x]}
print(json.dumps(summary))
with open(os.path.join(os.environ.get("OUT", "."), f"timeline_{placement}{'_' + args.tag if args.tag else ''}.json"), "w") as f:
    json.dump({"summary": summary, "result": r, "host_steps": host_steps, "move_calls": move_calls,
               "step_gpu_ms": step_gpu_ms if gpu_events else [],
               "device_steps": [(round(t, 4), p, rows, round(sec, 5), tokens, host_tokens)
                                for t, p, rows, sec, tokens, host_tokens in steps]}, f)
