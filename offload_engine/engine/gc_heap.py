"""The heap that start-up leaves is frozen out of the garbage collector's full scans while an engine is open.

A full (generation 2) collection walks every object the collector tracks. After start-up that is several hundred
thousand of them (torch, transformers, triton, numba, the model's modules), and on the H100 host one such
collection took 0.28-0.32 s in the middle of an 8B run, holding the engine's thread, and so the device lane, for
all of it (benchmarks/trace_placement.py --slow-calls, 2026-11-24). Frozen objects are not scanned; what the steps
allocate is collected as before. vLLM freezes its engine process's heap after start-up for the same reason.

Frozen objects are still freed by reference counting: only cycles among them wait until the heap is unfrozen,
when the last open engine closes (close() and garbage collection of an LLM both get there). Freezing is
process-wide, so while any engine is open, cyclic garbage from before it opened is held too.
"""
import gc
import threading

_lock = threading.Lock()
_open = 0  # engines that froze the heap and have not closed yet


def freeze_after_start_up() -> None:
    global _open
    with _lock:
        gc.collect()  # garbage from before (an engine closed earlier) goes now, not into the frozen heap
        gc.freeze()
        _open += 1


def unfreeze_at_close() -> None:
    global _open
    with _lock:
        _open = max(0, _open - 1)
        if _open == 0:
            gc.unfreeze()
