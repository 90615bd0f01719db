"""What compiles while a run is measured, not at start-up: every Triton kernel compile (an in-memory cache miss)
and every numba compile (a miss of its on-disk cache too), with its seconds, thread and time from the run's first
device-lane decode step, over one benchmarks.trace_placement run (whose --slow-calls shows what they stall).

    TRITON_CACHE_DIR=/tmp/fresh NUMBA_CACHE_DIR=/tmp/fresh_numba python -m benchmarks.probe_run_compiles OUT.json \\
        auto --model qwen3-0.6b --num-seqs 64 --prompt-len 2048 --output-len 256 --num-gpu-blocks 2304 --slow-calls

Found with it (H100 host, 2026-11-24): nothing compiled in the run, yet a fresh machine's first run held the engine's
thread 0.27-0.41 s in its first demotion: Triton loads a kernel and builds its launcher at its first launch, which
`warmup` does not make (kernels/host_block_copies.compile_host_block_copies).
"""
import json
import sys
import threading
import time

import triton.runtime.jit as triton_jit
from numba.core import event as numba_event

compiles = []


def _watch_triton() -> None:
    original = triton_jit.JITFunction._do_compile

    def compiled(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            compiles.append({"t": began, "seconds": round(time.perf_counter() - began, 4), "what": self.fn.__name__,
                             "thread": threading.current_thread().name})
    triton_jit.JITFunction._do_compile = compiled


class _NumbaCompiles(numba_event.Listener):
    def on_start(self, event):
        event.data["began"] = time.perf_counter()

    def on_end(self, event):
        began = event.data["began"]
        compiles.append({"t": began, "seconds": round(time.perf_counter() - began, 4),
                         "what": "numba " + event.data["dispatcher"].py_func.__qualname__,
                         "signature": str(event.data["args"])[:300], "thread": threading.current_thread().name})


def main() -> None:
    out, sys.argv = sys.argv[1], ["trace_placement", *sys.argv[2:]]
    _watch_triton()
    numba_event.register("numba:compile", _NumbaCompiles())
    from benchmarks import trace_placement
    trace_placement.main()
    first_step = trace_placement.steps[0]["t"] if trace_placement.steps else 0.0
    for entry in compiles:
        entry["from_first_step"] = round(entry.pop("t") - first_step, 3)
        print(f"compiled {entry['what']} in {entry['seconds']:.3f} s, {entry['from_first_step']:+.3f} s from the first "
              f"decode step, on {entry['thread']}")
    with open(out, "w") as f:
        json.dump({"compiles": compiles, "slow_calls": trace_placement.slow_calls}, f, indent=1)


if __name__ == "__main__":
    main()
