"""Freezes the heap start-up leaves out of the garbage collector's full scans while any engine is open: a full
collection holds the engine's thread throughout (docs/decisions/memory.md, "The frozen GC heap"). Process-wide;
cycles among frozen objects wait until the last open engine closes.
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
