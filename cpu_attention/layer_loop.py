"""A whole host-lane decode step on the executor: `decode_layers` runs each layer as the device hands it over.

The device side is one CUDA graph per batch size (engine/host_step_graphs.py). Per layer it copies q and the new
K/V into pinned host buffers, opens gate 0 of the layer, and waits on gate 1 before it copies the attention
output back; all of it is queued at once. This side runs the layers in one native call, without the GIL, so a
step costs two GIL hand-offs in all instead of several per layer on two threads.
"""
import time
from concurrent.futures import Future

import numpy as np

from cpu_attention.decode import kernel_view
from cpu_attention.decode_kernel import ERRORS, _check_tables, decode_layers


def check_step(pools, slots: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray) -> None:
    """ValueError before any work if the step's maps do not fit the host pool (pools [L, 2, blocks, Hkv, bs, D])."""
    num_blocks, block_size = pools.shape[2], pools.shape[4]
    error = _check_tables(block_tables, context_lens, num_blocks, block_size)
    if error:
        raise ValueError(f"host decode step: {ERRORS[error]}")
    if slots.size and (slots.min() < -1 or slots.max() >= num_blocks * block_size):
        raise ValueError(f"host decode step: a slot is outside the host pool (valid: -1 or 0..{num_blocks * block_size - 1})")


def start_decode_layers(executor, gates: np.ndarray, q, k_new, v_new, pools, slots: np.ndarray,
                        block_tables: np.ndarray, context_lens: np.ndarray, batch: int, scale: float,
                        out: np.ndarray) -> Future:
    """Queues the step's layers on `executor` (a CpuAttentionExecutor); the Future gives the seconds its calls took
    (the kernels' time plus the short waits for the device between layers), or the error. q, k_new, v_new and
    pools are torch tensors in the caches' dtype (zero-copy views are taken here); the rest numpy arrays."""
    arrays = [kernel_view(t) for t in (q, k_new, v_new, pools)]
    num_layers = q.shape[0]
    lse = np.empty((batch, q.shape[2]), np.float32)
    done, spent = Future(), [0.0]

    def run(layer: int) -> None:
        began = time.perf_counter()
        try:
            next_layer = decode_layers(gates, layer, executor.pending, *arrays, slots, block_tables, context_lens,
                                       batch, scale, executor.num_threads, out, lse)
        except BaseException as error:  # let the device's step end, then report
            gates[1, :] = 1
            done.set_exception(error)
            return
        spent[0] += time.perf_counter() - began
        if next_layer < 0:
            done.set_exception(ValueError(f"host decode step: {ERRORS[-next_layer]}"))
        elif next_layer < num_layers:
            executor.submit(run, next_layer)  # behind the job that is waiting: the rest of the layers after it
        else:
            done.set_result(spent[0])

    executor.submit(run, 0)
    return done


def warm_decode_layers(dtype, head_dim: int = 8, block_size: int = 4) -> None:
    """Compiles decode_layers (or loads it from numba's cache) for one cache dtype: one layer, gates open."""
    import torch

    pools = torch.zeros(1, 2, 2, 1, block_size, head_dim, dtype=dtype)
    q = torch.ones(1, 1, 2, head_dim, dtype=dtype)
    new = torch.ones(1, 1, 1, head_dim, dtype=dtype)
    gates = np.ones((2, 1), np.int32)
    arrays = [kernel_view(t) for t in (q, new, new.clone(), pools)]
    decode_layers(gates, 0, np.zeros(2, np.int64), *arrays, np.zeros(1, np.int64), np.zeros((1, 1), np.int32),
                  np.ones(1, np.int32), 1, 1.0, 1, np.empty((1, 1, 2, head_dim), np.float32),
                  np.empty((1, 2), np.float32))
