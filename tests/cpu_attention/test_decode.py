"""cpu_attention.paged_decode_attention against the float64 reference, on shuffled paged head-major caches.

Unowned cache slots hold NaN (tests.reference.random_paged_kv), so reading past a context length fails loudly.
"""
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from numba import njit

from cpu_attention import CpuAttentionExecutor, paged_decode_attention, split_plan
from cpu_attention.decode_kernel import ITEMS_PER_THREAD, plan_work
from cpu_attention.numerics import exp_nonpositive, widen
from tests.reference import paged_decode_reference, random_paged_kv, relative_error

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
LSE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}
# (query heads per kv head, head_dim, block_size): GQA 1/2/4/8 plus groups that are not a multiple of four,
# the model head dims 64/128, the tiny models' odd ones, and a block size that is not a power of two.
SHAPES = [(1, 64, 16), (2, 128, 32), (4, 128, 64), (8, 64, 16), (6, 64, 16), (3, 32, 5), (4, 24, 16), (3, 8, 5)]


def _boundary_lengths(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 0, 3 * block_size + 5]


def _run_and_check(context_lens, group, head_dim, block_size, dtype, num_kv_heads=2, seed=0, scale=None):
    k_cache, v_cache, tables, keys, values = random_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, layout="head_major", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref_out, ref_lse = paged_decode_reference(q, keys, values, scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    filled = lens > 0
    assert relative_error(out[filled], ref_out[filled]) < TOLERANCE[dtype]
    torch.testing.assert_close(lse[filled].double(), ref_lse[filled], rtol=0, atol=LSE_ATOL[dtype])
    assert torch.all(out[~filled] == 0) and torch.all(lse[~filled] == -math.inf)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,block_size", SHAPES)
def test_matches_reference_at_block_boundaries(dtype, group, head_dim, block_size):
    _run_and_check(_boundary_lengths(block_size), group, head_dim, block_size, dtype, seed=group * head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_context_is_split_across_threads(dtype):
    lens, block_size, num_kv_heads = [3000, 70], 16, 2
    assert split_plan(lens, block_size, num_kv_heads, num_threads=1)[0] > 1
    assert split_plan(lens, block_size, num_kv_heads)[0] > 1  # the plan the call below uses
    _run_and_check(lens, 4, 64, block_size, dtype, num_kv_heads=num_kv_heads, seed=7)


def test_split_plan_keeps_short_work_whole():
    assert list(split_plan([0, 1, 100, 255], 16, 8, num_threads=16)) == [1, 1, 1, 1]
    lens = np.full(64, 8192, np.int32)  # 64 x 8 (sequence, head) pairs of 128 blocks already feed 16 threads
    chunk_blocks, item_heads = plan_work(lens, 64, 8, 16)
    items = split_plan(lens, 64, 8, num_threads=16).sum() * (8 // item_heads)
    assert item_heads == 8 and items <= 16 * ITEMS_PER_THREAD


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,block_size,num_kv_heads", [(4, 128, 16, 2), (2, 64, 16, 4), (3, 8, 8, 4)])
def test_items_that_take_several_kv_heads(dtype, group, head_dim, block_size, num_kv_heads):
    """A long sequence's items read all of a block's kv heads in a row (plan_work): the partials of every head
    and split still merge exactly, beside a short row, an empty one and one that ends inside a block."""
    lens = [300 * block_size + 3, 40, 0, 2 * block_size]
    threads = numba.get_num_threads()
    numba.set_num_threads(min(2, threads))  # the plan depends on the thread count; this one gives runs of heads
    try:
        _, item_heads = plan_work(np.array(lens, np.int32), block_size, num_kv_heads, numba.get_num_threads())
        assert item_heads > 1 and split_plan(lens, block_size, num_kv_heads)[0] > 1
        _run_and_check(lens, group, head_dim, block_size, dtype, num_kv_heads=num_kv_heads, seed=group + head_dim)
    finally:
        numba.set_num_threads(threads)


def test_table_entries_past_the_context_are_never_read():
    lens, block_size = [5, 17, 0], 16
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 2, 32, block_size, torch.float32,
                                                             layout="head_major", seed=3)
    tables = torch.where(tables < 0, torch.full_like(tables, 10**6), tables)  # garbage, not just -1
    q = torch.randn(3, 4, 32)
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.2)
    ref_out, ref_lse = paged_decode_reference(q, keys, values, 0.2)
    assert relative_error(out[:2], ref_out[:2]) < 1e-5
    assert torch.all(out[2] == 0) and torch.all(lse[2] == -math.inf)


def test_accepts_strided_q_and_int64_metadata():
    lens = [40, 9]
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 2, 16, 8, torch.float32, layout="head_major")
    q = torch.randn(16, 4, 2).transpose(0, 2)  # [2, 4, 16], not contiguous
    out, _ = paged_decode_attention(q, k_cache, v_cache, tables.long(), torch.tensor(lens), 0.25)
    assert relative_error(out, paged_decode_reference(q, keys, values, 0.25)[0]) < 1e-5


def test_rejects_bad_inputs_with_value_error():
    k_cache, v_cache, tables, _, _ = random_paged_kv([20], 2, 16, 8, torch.float32, layout="head_major")
    q, lens = torch.randn(1, 4, 16), torch.tensor([20], dtype=torch.int32)
    cases = {
        "device": (q.to("meta"), k_cache, v_cache, tables, lens),
        "dtype": (q.half(), k_cache, v_cache, tables, lens),
        "head_dim": (torch.randn(1, 4, 8), k_cache, v_cache, tables, lens),
        "group": (torch.randn(1, 3, 16), k_cache, v_cache, tables, lens),
        "strided cache": (q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables, lens),
        "batch": (q, k_cache, v_cache, tables, torch.tensor([20, 3], dtype=torch.int32)),
        "float table": (q, k_cache, v_cache, tables.float(), lens),
        "block id": (q, k_cache, v_cache, torch.full_like(tables, k_cache.shape[0]), lens),
        "context too long": (q, k_cache, v_cache, tables, lens * 100),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError):
            paged_decode_attention(*args, 0.25)
            pytest.fail(f"accepted a bad {name}")


@njit
def _widen_all(bits):
    out = np.empty(bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        out[i] = widen(bits[i])
    return out


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_widening_is_exact_for_every_16_bit_pattern(dtype):
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # zero, subnormal, inf, nan
    bits = patterns.numpy().view(np.uint16) if dtype == torch.bfloat16 else patterns.numpy()
    ours = torch.from_numpy(_widen_all(bits))
    expected = patterns.view(dtype).float()
    assert torch.equal(ours.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(ours[finite].view(torch.int32), expected[finite].view(torch.int32))  # signed zeros too


@njit
def _exp_all(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = exp_nonpositive(x[i])
    return out


def test_polynomial_exp_is_float32_accurate():
    x = -np.random.default_rng(0).exponential(8.0, 100_000).astype(np.float32)
    x[:4] = (0.0, -1e-30, -80.0, -500.0)
    ours, expected = _exp_all(x), np.exp(x.astype(np.float64))
    error = np.abs(ours - expected) / expected
    # ~2e-7 where softmax weights matter; the float32 product x * log2(e) adds ~|x| * 6e-8 further out
    assert np.max(error[x > -16.0]) < 1e-6 and np.max(error[x > -87.0]) < 1e-5
    assert np.all(ours[x < -88.0] == np.float32(2.0**-126))  # where float32 would go subnormal: clamped


def test_executor_runs_the_kernel_on_its_worker_thread():
    lens = [33, 700, 0, 64]
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 2, 64, 16, torch.bfloat16, layout="head_major",
                                                             seed=5)
    q = torch.randn(4, 8, 64).to(torch.bfloat16)
    args = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    with CpuAttentionExecutor(num_threads=min(2, numba.config.NUMBA_NUM_THREADS)) as executor:
        executor.warmup()
        name = executor.submit(lambda: threading.current_thread().name).result()
        futures = [executor.submit(paged_decode_attention, *args) for _ in range(4)]  # queued, never overlapping
        results = [f.result() for f in futures]
    assert name.startswith("cpu-attention")
    ref_out = paged_decode_reference(q, keys, values, 0.125)[0]
    filled = torch.tensor(lens) > 0
    assert relative_error(results[0][0][filled], ref_out[filled]) < 1e-2
    for out, lse in results[1:]:  # the merge order is fixed by the plan, not by which worker ran what
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_calls_from_several_python_threads_through_one_executor():
    lens = [300, 5]
    k_cache, v_cache, tables, keys, values = random_paged_kv(lens, 1, 32, 16, torch.float32, layout="head_major")
    q = torch.randn(2, 2, 32)
    executor = CpuAttentionExecutor(warm=False)
    results = [None] * 4

    def client(i):
        results[i] = executor.submit(paged_decode_attention, q, k_cache, v_cache, tables,
                                     torch.tensor(lens, dtype=torch.int32), 0.3).result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    executor.shutdown()
    ref = paged_decode_reference(q, keys, values, 0.3)[0]
    assert all(relative_error(out, ref) < 1e-5 for out, _ in results)


_WORKQUEUE_SCRIPT = """
import threading, torch
from cpu_attention import CpuAttentionExecutor, paged_decode_attention
from tests.reference import random_paged_kv
k, v, tables, _, _ = random_paged_kv([500, 40], 2, 32, 16, torch.bfloat16, layout="head_major")
q, lens = torch.randn(2, 4, 32).to(torch.bfloat16), torch.tensor([500, 40], dtype=torch.int32)
executor = CpuAttentionExecutor()
clients = [threading.Thread(target=lambda: [executor.submit(paged_decode_attention, q, k, v, tables, lens, 0.2)
                                            .result() for _ in range(20)]) for _ in range(3)]
[c.start() for c in clients]
[c.join() for c in clients]
executor.shutdown()
import numba
print("layer", numba.threading_layer())
"""


def test_one_worker_keeps_the_unsafe_workqueue_layer_alive():
    """numba's workqueue layer aborts the process on concurrent parallel launches; the executor never makes any."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # 600 s: with numba's cache cold (a kernel edited since the last run) the process compiles the kernels first,
    # which took over 120 s on a 2-core CI machine; a hang still fails.
    done = subprocess.run([sys.executable, "-c", _WORKQUEUE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layer workqueue" in done.stdout


_PATH_CHECK = """
import math, sys, numba, torch
from cpu_attention import kernel_switches, paged_decode_attention
from tests.reference import paged_decode_reference, random_paged_kv, relative_error
assert kernel_switches.BF16_DOT == (sys.argv[1] == "1") and kernel_switches.WORD_TILES == (sys.argv[2] == "1")
numba.set_num_threads(1)  # one thread: the long row's items take runs of kv heads (plan_work)
for group, head_dim, block_size, lens in ((4, 128, 64, [200, 64, 1, 0]), (2, 64, 16, [33, 16, 5]),
                                          (4, 128, 16, [300 * 16 + 3, 40, 0])):
    k, v, tables, keys, values = random_paged_kv(lens, 2, head_dim, block_size, torch.bfloat16, layout="head_major")
    q = torch.randn(len(lens), 2 * group, head_dim).to(torch.bfloat16)
    out, lse = paged_decode_attention(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), 1 / math.sqrt(head_dim))
    ref, ref_lse = paged_decode_reference(q, keys, values, 1 / math.sqrt(head_dim))
    filled = torch.tensor(lens) > 0
    print(relative_error(out[filled], ref[filled]), (lse[filled].double() - ref_lse[filled]).abs().max().item())
"""


# Every path for bfloat16 caches, by its switches (OFFLOAD_ENGINE_BF16_DOT, OFFLOAD_ENGINE_WORD_TILES).
BFLOAT16_PATHS = {"words": ("0", "1"), "widening": ("0", "0"), "bf16_dot": ("1", "1")}


@pytest.fixture(scope="module")
def bfloat16_path_checks(tmp_path_factory):
    """Each path's check in a process of its own, all started at once on one numba cache (each compiles its kernels
    first: ~20 s apiece on a 2-core CI machine, which run side by side). Yields the cache and the processes by path."""
    from cpu_attention.kernel_switches import host_has_bf16_dot

    cache, checks = tmp_path_factory.mktemp("numba_cache"), {}
    for path, (dot, words) in BFLOAT16_PATHS.items():
        if dot == "1" and not host_has_bf16_dot():
            continue
        env = dict(os.environ, OFFLOAD_ENGINE_BF16_DOT=dot, OFFLOAD_ENGINE_WORD_TILES=words,
                   NUMBA_CACHE_DIR=str(cache))
        checks[path] = subprocess.Popen([sys.executable, "-c", _PATH_CHECK, dot, words], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        cwd=Path(__file__).resolve().parents[2])
    yield cache, checks
    for check in checks.values():
        if check.poll() is None:
            check.kill()
            check.communicate()


@pytest.mark.parametrize("path", list(BFLOAT16_PATHS))
def test_bfloat16_paths_match(path, bfloat16_path_checks):
    """Every path for bfloat16 caches on any CPU that can run it: word tiles (the default), value-by-value widening
    (OFFLOAD_ENGINE_WORD_TILES=0) and vdpbf16ps (OFFLOAD_ENGINE_BF16_DOT=1, AVX-512 BF16 only). Each in a process of
    its own, all three on one numba cache: each must compile and keep its kernels under its own switches' tag."""
    cache, checks = bfloat16_path_checks
    if path not in checks:
        pytest.skip("this CPU has no AVX-512 BF16")
    stdout, stderr = checks[path].communicate(timeout=600)
    assert checks[path].returncode == 0, stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 3, stdout
    for line in lines:
        error, lse_error = map(float, line.split())
        assert error < TOLERANCE[torch.bfloat16] and lse_error < LSE_ATOL[torch.bfloat16]
    dot, words = BFLOAT16_PATHS[path]
    tag = f"words{words}-bf16dot{dot}"
    assert list(cache.rglob(f"{tag}/decode_kernel.decode_kernel-*.nbi")), "compiled under its tag"
