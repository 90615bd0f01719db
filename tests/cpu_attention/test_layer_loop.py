"""A whole host-lane step on the executor (layer_loop.py) against the float64 reference, layer by layer.

A thread stands in for the device: it opens each layer's gate 0 and waits for gate 1 before the next, as the
step's CUDA graph does. The new token's slot holds NaN until the loop stores it, so a step that attends before
storing, or stores into the wrong slot, fails.
"""
import threading
import time

import numpy as np
import pytest
import torch
from numba.core.errors import TypingError

from cpu_attention import CpuAttentionExecutor
from cpu_attention.decode import kernel_view
from cpu_attention.decode_layers import decode_layers
from cpu_attention.layer_loop import LayerLoop, check_step
from tests.cpu_attention.test_decode import LSE_ATOL, TOLERANCE
from tests.reference import paged_decode_reference, random_paged_kv, relative_error

# head_dim 32: with OFFLOAD_ENGINE_BF16_DOT=1, bfloat16 caches take the kernel's vdpbf16ps path on CPUs that
# have it (a multiple of 32 only).
NUM_LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 2, 2, 32, 8
LENS = [1, 8, 9, 23, 0]  # a one-token row, block boundaries, and a padding row (no context, no slot)


@pytest.fixture(scope="module")
def executor():
    with CpuAttentionExecutor(num_threads=2, dtypes=(torch.float32, torch.bfloat16)) as pool:
        yield pool


def make_step(dtype, seed=0):
    """Pools [L, 2, blocks, Hkv, BLOCK, D], every layer's q/k/v, and per-layer references."""
    k0, _, tables, _, _ = random_paged_kv(LENS, KV_HEADS, HEAD_DIM, BLOCK, dtype, layout="head_major", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pools = torch.full((NUM_LAYERS, 2, *k0.shape), float("nan")).to(dtype)
    rows = len(LENS) + 2  # the buffers are larger than the batch, as a graph's bucket is
    q = torch.randn(NUM_LAYERS, rows, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    k_new = torch.full((NUM_LAYERS, rows, KV_HEADS, HEAD_DIM), float("nan")).to(dtype)
    v_new = k_new.clone()
    slots = np.full(len(LENS), -1, np.int64)
    refs = []
    for layer in range(NUM_LAYERS):
        keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in LENS]
        values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in LENS]
        for b, n in enumerate(LENS):
            for t in range(n - 1):  # every token but the new one is in the pool already
                block = int(tables[b, t // BLOCK])
                pools[layer, 0, block, :, t % BLOCK] = keys[b][t]
                pools[layer, 1, block, :, t % BLOCK] = values[b][t]
            if n:
                k_new[layer, b], v_new[layer, b] = keys[b][n - 1], values[b][n - 1]
                slots[b] = int(tables[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
        refs.append(paged_decode_reference(q[layer, : len(LENS)], keys, values, HEAD_DIM ** -0.5))
    return pools, q, k_new, v_new, slots, tables.numpy(), np.asarray(LENS, np.int32), refs


def device_stand_in(gates, interleave=None, layer_seconds=0.0):
    """Opens gate 0 of each layer in turn, waiting for the loop's gate 1 first, as the step's graph does;
    layer_seconds: how long the device takes over each layer's own work before it hands the layer over."""
    def run():
        for layer in range(gates.shape[1]):
            time.sleep(layer_seconds)
            gates[0, layer] = 1
            if interleave is not None and layer == 0:
                interleave()
            given_up = time.monotonic() + 60
            while gates[1, layer] == 0 and time.monotonic() < given_up:
                time.sleep(0)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_every_layer_matches_reference_and_stores_its_token(executor, dtype):
    pools, q, k_new, v_new, slots, tables, lens, refs = make_step(dtype)
    out = np.full((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.nan, np.float32)
    lse = np.full((NUM_LAYERS, q.shape[1], q.shape[2]), np.nan, np.float32)
    gates = np.zeros((2, NUM_LAYERS), np.int32)
    order = []
    # A job queued mid-step waits for the whole step: the loop never hands the thread back while the device may
    # still wait on one of its gates (layer_loop.py).
    loop = LayerLoop(executor, gates, q, k_new, v_new, pools, slots, tables, lens, len(LENS), HEAD_DIM ** -0.5, out,
                     lse)
    loop.done.add_done_callback(lambda _: order.append("step"))
    loop.wait_running()  # as the lane does before it launches the device's graph
    device = device_stand_in(gates, interleave=lambda: executor.submit(order.append, "job"))
    assert loop.result(timeout=60) > 0
    device.join()
    executor.drain()
    assert order == ["step", "job"]
    for layer in range(NUM_LAYERS):
        filled = torch.from_numpy(out[layer, : len(LENS) - 1])
        ref_out, ref_lse = refs[layer]
        assert relative_error(filled, ref_out[:-1]) < TOLERANCE[dtype]
        # Each layer keeps its own log-sum-exp (a split row merges it with its device part's).
        assert torch.allclose(torch.from_numpy(lse[layer, : len(LENS) - 1]).double(), ref_lse[:-1],
                              atol=LSE_ATOL[dtype])
        assert lse[layer, len(LENS) - 1].tolist() == [float("-inf")] * q.shape[2]
        assert not np.any(out[layer, len(LENS) - 1])  # the padding row: no context, output 0
        for b, n in enumerate(LENS[:-1]):
            block, offset = divmod(int(slots[b]), BLOCK)
            assert torch.equal(pools[layer, 0, block, :, offset], k_new[layer, b])
            assert torch.equal(pools[layer, 1, block, :, offset], v_new[layer, b])


def test_step_time_splits_into_host_work_and_waits_for_the_device(executor):
    """The loop times itself from inside the native call: waits for the device's layers apart from its own
    work. A stand-in device that takes 30 ms over each layer must show up as waits, not as host work."""
    pools, q, k_new, v_new, slots, tables, lens, _ = make_step(torch.float32)
    gates = np.zeros((2, NUM_LAYERS), np.int32)
    out = np.empty((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.float32)
    loop = LayerLoop(executor, gates, q, k_new, v_new, pools, slots, tables, lens, len(LENS), 1.0, out)
    loop.wait_running()
    device = device_stand_in(gates, layer_seconds=0.03)
    total = loop.result(timeout=60)
    device.join()
    work, waits = loop.split_seconds()
    assert 0 < work < 0.03 * NUM_LAYERS / 2
    assert 0.03 * NUM_LAYERS * 0.9 < waits <= total * 1.01
    assert work + waits == pytest.approx(total, rel=0.05, abs=2e-3)


def test_bad_maps_are_refused_before_any_work():
    pools, q, k_new, v_new, slots, tables, lens, _ = make_step(torch.float32)
    bad = tables.copy()
    bad[1, 0] = pools.shape[2]  # past the pool
    with pytest.raises(ValueError, match="outside the cache"):
        check_step(pools, slots, bad, lens)
    bad_slots = slots.copy()
    bad_slots[0] = pools.shape[2] * BLOCK
    with pytest.raises(ValueError, match="slot is outside the host pool"):
        check_step(pools, bad_slots, tables, lens)
    check_step(pools, slots, tables, lens)


def test_kernel_error_opens_every_gate(executor):
    """A map the kernel refuses (check_step skipped) ends the step with ValueError and lets the device finish."""
    pools, q, k_new, v_new, slots, tables, lens, _ = make_step(torch.float32)
    tables = tables.copy()
    tables[2, 0] = -1  # a hole inside a context
    gates = np.zeros((2, NUM_LAYERS), np.int32)
    gates[0, :] = 1  # the device handed everything over
    loop = LayerLoop(executor, gates, q, k_new, v_new, pools, slots, tables, lens, len(LENS), 1.0,
                     np.empty((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.float32))
    with pytest.raises(ValueError, match="outside the cache"):
        loop.result(timeout=60)
    assert gates[1].all()


def test_abandoned_step_stops_waiting(executor):
    pools, q, k_new, v_new, slots, tables, lens, _ = make_step(torch.float32)
    gates = np.zeros((2, NUM_LAYERS), np.int32)  # the device never hands a layer over
    loop = LayerLoop(executor, gates, q, k_new, v_new, pools, slots, tables, lens, len(LENS), 1.0,
                     np.empty((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.float32))
    loop.wait_running()
    assert loop.flags[0] == 1 and not loop.done.done()  # in the native loop, waiting for gate 0
    loop.abandon()
    with pytest.raises(RuntimeError, match="abandoned"):
        loop.result(timeout=60)
    executor.drain()  # still usable


def test_loop_that_cannot_start_reports_before_any_launch(executor):
    """A call numba refuses (here gates that are not int32) ends wait_running with the error, so the lane raises
    it without launching the device's graph, and the executor stays usable."""
    pools, q, k_new, v_new, slots, tables, lens, _ = make_step(torch.float32)
    gates = np.zeros((2, NUM_LAYERS), np.float32)
    loop = LayerLoop(executor, gates, q, k_new, v_new, pools, slots, tables, lens, len(LENS), 1.0,
                     np.empty((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.float32))
    loop.wait_running()
    assert loop.done.done() and loop.flags[0] == 0
    with pytest.raises(TypingError):
        loop.result()
    executor.drain()


@pytest.mark.parametrize("workers", (1, 5), ids=("one worker", "more workers than threads"))
def test_step_is_exact_whatever_the_worker_count(executor, workers):
    """decode_layers runs one parallel region of `num_threads` workers that wait on each other's tallies, not on
    each other: with more workers than the team has threads (some run after others have finished) or with one,
    every layer is still computed, exactly as by the reference, and every gate opens."""
    pools, q, k_new, v_new, slots, tables, lens, refs = make_step(torch.float32, seed=3)
    out = np.full((NUM_LAYERS, q.shape[1], q.shape[2], HEAD_DIM), np.nan, np.float32)
    gates = np.zeros((2, NUM_LAYERS), np.int32)
    gates[0, :] = 1  # the device handed everything over
    arrays = [kernel_view(t) for t in (q, k_new, v_new, pools)]
    error = executor.submit(decode_layers, gates, np.zeros(2, np.int64), *arrays, slots, tables, lens, len(LENS),
                            HEAD_DIM ** -0.5, workers, out, np.empty((NUM_LAYERS, len(LENS), q.shape[2]), np.float32),
                            np.zeros((NUM_LAYERS + 1, 2), np.int64)).result(timeout=60)
    assert error == 0 and gates[1].all()
    for layer in range(NUM_LAYERS):
        assert relative_error(torch.from_numpy(out[layer, : len(LENS) - 1]), refs[layer][0][:-1]) < TOLERANCE[torch.float32]
        assert not np.any(out[layer, len(LENS) - 1])
