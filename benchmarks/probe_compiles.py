"""Which Triton kernels and numba functions compile in each phase of the suite's b runs, one process: gpu, then auto
twice, at one budget, each as `engine_run.measure` runs it (start-up, a warm-up generate, the timed generate).
A compile in a timed generate is a start-up gap: it charged the first auto run of b 0.6B at 1/4 its compile time.

    python -m benchmarks.probe_compiles [--blocks 2304]   (prints one line per compile, then each run's tok/s)
"""
import argparse
import time

import numba.core.dispatcher as numba_dispatcher
import triton.runtime.jit as triton_jit

from benchmarks.bench_throughput import _host_pool_gb, model_dir
from benchmarks.engine_run import measure, random_prompts
from offload_engine import LLM

PHASE = ["start-up"]  # of the run in progress: start-up, warm-up, timed
CALLS = [0]  # generate calls in the run in progress (measure makes two: the warm-up, then the timed one)


def _in_phases(generate):
    def labelled(self, *args, **kwargs):
        CALLS[0] += 1
        PHASE[0] = "warm-up" if CALLS[0] == 1 else "timed"
        return generate(self, *args, **kwargs)
    return labelled


def _logged(compile_fn, kind: str, name_of):
    def logged(self, *args, **kwargs):
        began = time.perf_counter()
        out = compile_fn(self, *args, **kwargs)
        print(f"  {PHASE[0]:9s} {kind:6s} {name_of(self)} {time.perf_counter() - began:.3f} s", flush=True)
        return out
    return logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2304, help="device blocks (2304: a quarter of b 0.6B's KV)")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    args = parser.parse_args()
    LLM.generate = _in_phases(LLM.generate)
    triton_jit.JITFunction._do_compile = _logged(triton_jit.JITFunction._do_compile, "triton", lambda f: f.fn.__name__)
    numba_dispatcher.Dispatcher._compile_for_args = _logged(numba_dispatcher.Dispatcher._compile_for_args, "numba",
                                                            lambda f: f.py_func.__name__)
    path = model_dir("qwen3-0.6b", args.model_cache)
    prompts = random_prompts([2048] * 64, 10000, seed=1)
    common = dict(max_model_len=2304, max_num_seqs=64, block_size=16)
    for placement in ("gpu", "auto", "auto"):
        print(f"{placement} at {args.blocks} device blocks", flush=True)
        PHASE[0], CALLS[0] = "start-up", 0
        host = {} if placement == "gpu" else {"cpu_kv_cache_gb": _host_pool_gb(15.75)}
        run = measure(path, prompts, [256] * 64, kv_placement=placement, num_gpu_blocks=args.blocks, **common, **host)
        print(f"{placement}: {run['output_tok_per_s']:.0f} output tok/s, prefill {run['prefill_seconds']:.2f} s, "
              f"start-up {run['startup_seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
