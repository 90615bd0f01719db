"""A whole host-lane decode step on the executor: `decode_layers` runs each layer as the device hands it over.

The device side is one CUDA graph per batch size (engine/graphs/host_step_graphs.py): per layer it copies q and the
new K/V into pinned buffers, opens gate 0, and waits on gate 1 before it copies the output back. This side runs
every layer in one native call without the GIL. It cannot deadlock only if whoever opens a gate the device waits on
needs nothing another thread can hold: the device's graph is launched only once the loop runs natively
(`wait_running`), and the loop never hands the thread back before its last gate is open
(docs/decisions/host-kernel.md, "The layer loop's gates and the GIL").
"""
import threading
import time
from concurrent.futures import Future

import numpy as np

from cpu_attention.decode import kernel_view
from cpu_attention.decode_kernel import ABANDONED, ERRORS, check_tables
from cpu_attention.decode_layers import cycles, decode_layers

_cycle_hz: list[float] = []  # the cycle counter's rate, measured once per process


def cycle_hz() -> float:
    """Cycles per second of decode_kernel's cycle counter, against perf_counter over ~20 ms."""
    if not _cycle_hz:
        c0, t0 = cycles(), time.perf_counter()
        time.sleep(0.02)
        c1, t1 = cycles(), time.perf_counter()
        _cycle_hz.append(max(c1 - c0, 1) / (t1 - t0))
    return _cycle_hz[0]


def check_step(pools, slots: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray) -> None:
    """ValueError before any work if the step's maps do not fit the host pool (pools [L, 2, blocks, Hkv, bs, D])."""
    num_blocks, block_size = pools.shape[2], pools.shape[4]
    error = check_tables(block_tables, context_lens, num_blocks, block_size)
    if error:
        raise ValueError(f"host decode step: {ERRORS[error]}")
    if slots.size and (slots.min() < -1 or slots.max() >= num_blocks * block_size):
        raise ValueError(f"host decode step: a slot is outside the host pool (valid: -1 or 0..{num_blocks * block_size - 1})")


class LayerLoop:
    """One host step's layers, queued on `executor` (a CpuAttentionExecutor) at construction.

    q, k_new, v_new and pools are torch tensors in the caches' dtype (zero-copy views are taken here); the rest
    numpy arrays: gates int32 [2, L] in pinned memory, reset to 0 by the caller; out float32 [L, rows, Hq, D];
    lse float32 [L, rows, Hq] (made here if None): each layer's log-sum-exp, for rows whose attention also has a
    device part to merge with (split sequences).
    """

    def __init__(self, executor, gates: np.ndarray, q, k_new, v_new, pools, slots: np.ndarray,
                 block_tables: np.ndarray, context_lens: np.ndarray, batch: int, scale: float, out: np.ndarray,
                 lse: np.ndarray | None = None):
        # flags[0]: the loop sets it once it runs without the GIL; flags[1]: the lane sets it to abandon the step.
        self.flags = np.zeros(2, np.int64)
        self.times = np.zeros((q.shape[0] + 1, 2), np.int64)  # cycles: entry, then per layer handed over / done
        self.done: Future = Future()  # the seconds the loop took (its waits for the device included), or the error
        self._started = threading.Event()
        arrays = [kernel_view(t) for t in (q, k_new, v_new, pools)]
        if lse is None:
            lse = np.empty((q.shape[0], batch, q.shape[2]), np.float32)
        cycle_hz()  # measured here, not on the executor while the device waits
        executor.submit(self._run, gates, *arrays, slots, block_tables, context_lens, batch, scale,
                        executor.num_threads, out, lse, self.times)

    def _run(self, gates, *args) -> None:
        began = time.perf_counter()
        self._started.set()
        try:
            error = decode_layers(gates, self.flags, *args)
        except BaseException as failure:  # let the device's step end, then report
            gates[1, :] = 1
            self.done.set_exception(failure)
            return
        if error == ABANDONED:
            self.done.set_exception(RuntimeError(f"host decode step: {ERRORS[error]}"))
        elif error:
            self.done.set_exception(ValueError(f"host decode step: {ERRORS[error]}"))
        else:
            self.done.set_result(time.perf_counter() - began)

    def wait_running(self) -> None:
        """Blocks until the loop runs natively (from then on it needs no GIL until its last gate is open) or has
        ended; the jobs queued before it run first. Launch the device's graph only after this."""
        self._started.wait()
        while self.flags[0] == 0 and not self.done.done():
            time.sleep(0)  # a few microseconds: the executor thread is between the Event and the native call

    def result(self, timeout: float | None = None) -> float:
        return self.done.result(timeout)

    def split_seconds(self) -> tuple[float, float]:
        """(host work, waits for the device) of a finished step, in seconds: from each layer's gate 0 opening to
        its gate 1 opening, and from the entry or the last layer's end to the next layer's gate 0 (the device's
        turnaround: its copies, gates and the rows' device-side layers, queued among the device lane's work)."""
        done = self.times[1:, 1] > 0
        starts, ends = self.times[1:, 0][done], self.times[1:, 1][done]
        previous_ends = self.times[:-1, 1][done]
        hz = cycle_hz()
        return float((ends - starts).sum()) / hz, float((starts - previous_ends).sum()) / hz

    def abandon(self) -> None:
        """Stops the loop's wait for a device that will not hand its layers over (a failed or lost graph)."""
        self.flags[1] = 1


def warm_decode_layers(dtype, head_dim: int = 8, block_size: int = 4) -> None:
    """Compiles decode_layers (or loads it from numba's cache) for one cache dtype: one layer, gates open."""
    import torch

    pools = torch.zeros(1, 2, 2, 1, block_size, head_dim, dtype=dtype)
    q = torch.ones(1, 1, 2, head_dim, dtype=dtype)
    new = torch.ones(1, 1, 1, head_dim, dtype=dtype)
    gates = np.ones((2, 1), np.int32)
    arrays = [kernel_view(t) for t in (q, new, new.clone(), pools)]
    decode_layers(gates, np.zeros(2, np.int64), *arrays, np.zeros(1, np.int64), np.zeros((1, 1), np.int32),
                  np.ones(1, np.int32), 1, 1.0, 1, np.empty((1, 1, 2, head_dim), np.float32),
                  np.empty((1, 1, 2), np.float32), np.zeros((2, 2), np.int64))
    cycle_hz()
