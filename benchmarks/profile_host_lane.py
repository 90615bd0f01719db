"""Where a host-lane decode step's time goes, layer by layer, with the device lane idle and busy (GPU host).

    python benchmarks/profile_host_lane.py --out results.json

Host-tier rows decode beside (or without) device-tier rows, placement forced as in bench_lane_interference.
Every stage of the host lane's per-layer loop is timed on the thread that runs it:
- host-lane thread: graph-piece replay, submitting the layer's CPU job (q/k/v copies, event, queue), waiting
  for its result, and bringing the result back (copy to the device, merge, attention-output copy);
- executor thread: the delay from submit to the job starting, the wait for q/k/v to reach the host, the K/V
  store and the attention kernel.
The rest of a host step (inputs, sampling, the thread hand-offs around it) is the step time minus the layers.
Cases differ in the device lane (idle or busy) and in Python's GIL switch interval (sys.setswitchinterval):
a thread that wants the GIL while another runs Python waits up to that interval.
"""
import argparse
import json
import sys
import time
from collections import defaultdict

import torch

from benchmarks.bench_lane_interference import force_placement, summarize, timed_runs
from benchmarks.engine_run import random_prompts
from offload_engine import LLM, SamplingParams
from offload_engine.engine.graphs.cuda_graphs import DecodeGraphs
from offload_engine.layers import attention as attention_module

STAGES = defaultdict(float)  # seconds per stage, summed over the case


def _add(stage: str, began: float) -> float:
    now = time.perf_counter()
    STAGES[stage] += now - began
    return now


def instrument() -> None:
    """Replaces the host-lane path's functions with timed copies (same logic, timers between the stages)."""
    Attention = attention_module.Attention

    def submit_host_decode(self, q, k, v, meta):
        began = time.perf_counter()
        q_host, k_host, v_host = attention_module._to_host(q), attention_module._to_host(k), attention_module._to_host(v)
        arrived = attention_module._record_event(q)
        from cpu_attention import paged_decode_attention, store_kvcache
        submitted = time.perf_counter()

        def run():
            t = _add("exec_queue_delay", submitted)
            if arrived is not None:
                arrived.synchronize()
            t = _add("exec_event_wait", t)
            store_kvcache(k_host, v_host, self.k_cache_cpu, self.v_cache_cpu, meta.slot_mapping_cpu)
            t = _add("exec_store", t)
            out = paged_decode_attention(q_host, self.k_cache_cpu, self.v_cache_cpu, meta.block_tables_cpu,
                                         meta.context_lens_cpu, self.scale)
            _add("exec_kernel", t)
            meta.host_kernel_seconds.append(0.0)
            return out

        job = self.executor.submit(run)
        _add("lane_submit", began)
        return job

    device_decode = Attention._decode

    def decode(self, q, k, v, meta):
        if meta.has_gpu_rows:  # a device-lane step: untimed (the lanes never mix rows in one step)
            return device_decode(self, q, k, v, meta)
        job = self._submit_host_decode(q, k, v, meta)
        began = time.perf_counter()
        result = job.result()
        t = _add("lane_wait_result", began)
        out = result[0].to(q.device, non_blocking=True)
        _add("lane_result_to_device", t)
        return out

    Attention._submit_host_decode, Attention._decode = submit_host_decode, decode
    run_graphs = DecodeGraphs.run

    def timed_run(self, token_ids, positions, meta):
        if self.device_maps is not None:
            return run_graphs(self, token_ids, positions, meta)
        began = time.perf_counter()
        batch = token_ids.shape[0]
        size = next(b for b in self.buckets if b >= batch)
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        graphs, outputs = self.graphs[size], self.outputs[size]
        t = _add("lane_inputs", began)
        for layer in range(self.num_layers):
            graphs[layer].replay()
            t = _add("lane_replay", t)
            q, k, v, _ = outputs[layer]
            out = self.model.model.attend(layer, q[:batch], k[:batch], v[:batch], meta)
            t = time.perf_counter()
            self.attn_out[:batch].copy_(out)
            t = _add("lane_attn_out_copy", t)
        graphs[-1].replay()
        _add("lane_replay", t)
        return outputs[-1][:batch]

    DecodeGraphs.run = timed_run


def run_case(path: str, args, device_seqs: int, switch_interval: float) -> dict:
    sys.setswitchinterval(switch_interval)
    STAGES.clear()
    vocab = 400 if args.model == "tiny" else 10000
    prompts = (random_prompts([args.device_prompt] * device_seqs, vocab, seed=1)
               + random_prompts([args.host_prompt] * args.host_seqs, vocab, seed=2))
    budget = -(-(args.device_prompt + args.device_output) // 16)
    # async_scheduling=False: each device step is timed from its launch to its tokens (timed_runs wraps run).
    llm = LLM(path, kv_placement="auto", kv_promotion=False, async_scheduling=False, num_gpu_blocks=max(1, device_seqs) * budget + 16,
              cpu_kv_cache_gb=args.cpu_kv_cache_gb, max_num_seqs=device_seqs + args.host_seqs,
              max_model_len=max(args.device_prompt + args.device_output, args.host_prompt + args.host_output))
    llm.generate([[7] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    force_placement(device_seqs)
    records = timed_runs(llm)
    STAGES.clear()
    params = [SamplingParams(temperature=0.6, max_tokens=args.device_output, ignore_eos=True)] * device_seqs
    params += [SamplingParams(temperature=0.6, max_tokens=args.host_output, ignore_eos=True)] * args.host_seqs
    llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    host_steps = [r for r in records if r["lane"] == "host"]
    n = max(1, len(host_steps))
    result = {"device_seqs": device_seqs, "switch_interval_s": switch_interval,
              "host_step_ms_mean": sum(r["wall_ms"] for r in host_steps) / n,
              "host_step_cpu_ms_mean": sum(r["cpu_ms"] for r in host_steps) / n,
              "stages_ms_per_host_step": {k: 1e3 * v / n for k, v in sorted(STAGES.items())},
              **summarize(records, device_seqs)}
    in_layers = sum(v for k, v in result["stages_ms_per_host_step"].items() if k.startswith("lane_"))
    result["stages_ms_per_host_step"]["outside_layers"] = result["host_step_ms_mean"] - in_layers
    return result


def main() -> None:
    from benchmarks.bench_throughput import model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--host-seqs", type=int, default=32)
    parser.add_argument("--host-prompt", type=int, default=1024)
    parser.add_argument("--host-output", type=int, default=32)
    parser.add_argument("--device-seqs", type=int, default=16)
    parser.add_argument("--device-prompt", type=int, default=1024)
    parser.add_argument("--device-output", type=int, default=1024)
    parser.add_argument("--switch-intervals", default="0.005,0.0002")
    parser.add_argument("--device-rows-cases", default=None, help="device rows per case (default: 0 and --device-seqs)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads first: torch CPU ops on the engine's thread then use this many")
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=10.0)
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = model_dir(args.model, args.model_cache)
    instrument()
    if args.torch_threads:  # before the engine starts: torch's CPU thread team is then made at this size
        torch.set_num_threads(args.torch_threads)
    rows_cases = ([int(n) for n in args.device_rows_cases.split(",")] if args.device_rows_cases
                  else [0, args.device_seqs])
    cases = []
    for interval in map(float, args.switch_intervals.split(",")):
        for device_seqs in rows_cases:
            case = run_case(path, args, device_seqs, interval)
            case["torch_threads"] = torch.get_num_threads()
            cases.append(case)
            stages = " ".join(f"{k}={v:.1f}" for k, v in case["stages_ms_per_host_step"].items())
            print(f"torch threads {torch.get_num_threads()}, device rows {device_seqs:>3}, switch interval {interval * 1e3:.1f} ms: host step "
                  f"{case['host_step_ms_mean']:.1f} ms (cpu {case['host_step_cpu_ms_mean']:.1f}), device step "
                  f"{case['device_step_ms_busy']} ms busy | {stages}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "cases": cases}, f, indent=2)


if __name__ == "__main__":
    main()
