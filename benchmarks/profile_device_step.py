"""Where the device lane's slowdown comes from: per device decode step, the host time before the graph launch
(prep), the graph's GPU time (CUDA events), the rest (wait, sample, tolist) and the thread's CPU time, with the
host lane idle and busy. Decode-heavy 8B, 64 x (1024 + 1024), by default at a 24 GB card's budget:

    python benchmarks/profile_device_step.py [auto|gpu] [device blocks]   # writes $OUT/where_slow_<...>.json
"""
import collections, json, os, statistics, sys, time, subprocess
import torch
from benchmarks.bench_throughput import model_dir
from benchmarks.engine_run import measure, random_prompts
from offload_engine.engine.runner import model_runner
from offload_engine.engine.graphs import cuda_graphs
from offload_engine.engine import llm_engine

placement = sys.argv[1] if len(sys.argv) > 1 else "auto"
blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 3296
rec = []  # (rows, busy, wall, prep, gpu_event_pair, post)
cur = {}
engine_ref = {}
orig_whole = cuda_graphs.DecodeGraphs.replay
def run_whole(self, size, batch):
    cur["prep_end"] = time.perf_counter()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); out = orig_whole(self, size, batch); b.record()
    cur["ev"] = (a, b); cur["launched"] = time.perf_counter()
    return out
cuda_graphs.DecodeGraphs.replay = run_whole
orig_run = model_runner.ModelRunner.run
def run(self, seqs, is_prefill, lane="device"):
    if lane != "device" or is_prefill:
        return orig_run(self, seqs, is_prefill, lane)
    eng = engine_ref.get("e"); busy = eng is not None and eng.in_flight is not None
    cur.clear(); t = time.perf_counter(); c = time.thread_time()
    out = orig_run(self, seqs, is_prefill, lane)
    end = time.perf_counter()
    if "ev" in cur:
        rec.append((len(seqs), busy, end - t, cur["prep_end"] - t, cur["ev"], end - cur["launched"], time.thread_time() - c))
    return out
model_runner.ModelRunner.run = run
orig_init = llm_engine.LLMEngine.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k); engine_ref["e"] = self
llm_engine.LLMEngine.__init__ = init

r = measure(model_dir("qwen3-8b", "/tmp/offload_engine_models"), random_prompts([1024] * 64, 10000), [1024] * 64,
            kv_placement=placement, num_gpu_blocks=blocks, max_num_seqs=256)
rows = [(n, busy, w, p, a.elapsed_time(b) / 1e3, post, cpu) for n, busy, w, p, (a, b), post, cpu in rec]
by = collections.defaultdict(list)
for x in rows: by[(x[0], x[1])].append(x)
table = {}
for n in sorted({k[0] for k in by}):
    ent = {}
    for busy in (False, True):
        xs = by.get((n, busy), [])
        if len(xs) < 8: continue
        med = lambda i: round(1e3 * statistics.median(x[i] for x in xs), 3)
        ent["busy" if busy else "idle"] = {"n": len(xs), "wall": med(2), "prep": med(3), "gpu": med(4), "post": med(5), "cpu": med(6)}
    if len(ent) == 2: table[n] = ent
def agg(key):
    tot = wsum = 0
    for n, e in table.items():
        w = min(e["idle"]["n"], e["busy"]["n"]); tot += w * e["busy"][key] / e["idle"][key]; wsum += w
    return tot / wsum if wsum else None
summary = {"placement": placement, "blocks": blocks, "tok_s": r["output_tok_per_s"], "lane_stats": r.get("lane_stats"),
           "ratio_busy_idle": {k: agg(k) for k in ("wall", "prep", "gpu", "post")}, "table": table,
           "lscpu": subprocess.run("lscpu | grep -E 'Thread|Core|Socket|NUMA|Model name'", shell=True, capture_output=True, text=True).stdout}
print(json.dumps(summary, indent=1))
json.dump({"summary": summary, "steps": rows}, open(os.path.join(os.environ.get("OUT", "."), f"where_slow_{placement}_{blocks}.json"), "w"))
