"""Freezes the heap start-up leaves out of the garbage collector's full scans while any engine is open: a full
collection holds the engine's thread throughout (docs/decisions/memory.md, "The frozen GC heap"). Process-wide;
cycles among frozen objects wait until the last open engine closes.
"""
import gc
import threading

# Reentrant: a collection may run an unclosed engine's finalizer (its close()) on a thread that holds it.
_lock = threading.RLock()
_open = 0  # engines that froze the heap and have not closed yet


def freeze_after_start_up() -> None:
    global _open
    # Garbage from before (an engine closed earlier) goes now, not into the frozen heap. Outside the lock: an engine
    # left open in that garbage is closed by its finalizer here, and close() takes the lock.
    gc.collect()
    with _lock:
        gc.freeze()
        _open += 1


def unfreeze_at_close() -> None:
    global _open
    with _lock:
        _open = max(0, _open - 1)
        if _open == 0:
            gc.unfreeze()
