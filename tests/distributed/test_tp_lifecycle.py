"""A tensor-parallel engine's processes: close() (and `with`) stops and joins every worker and leaves the process
groups, so another engine starts after it; a worker that fails, or dies, surfaces on rank 0 as an exception (never
a hang), and the engine still closes cleanly."""
import multiprocessing
import os
import signal
import threading
import time
import types

import psutil
import pytest
import torch
import torch.distributed as dist

from offload_engine import LLM, SamplingParams
from offload_engine.distributed import parallel_state
from offload_engine.distributed.wire import Call
from offload_engine.distributed.workers import WorkerError
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

# Two ranks on CUDA need two GPUs (make test-gpu on a one-GPU host skips these; CI runs them on gloo).
pytestmark = pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="tensor_parallel_size=2 on CUDA needs two GPUs")

POOLS = dict(kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16, cpu_block_size=16)


def _engine(model_dir):
    return LLM(model_dir, device=TEST_DEVICE, tensor_parallel_size=2, **POOLS)


def _check_generates(llm, model_dir, seed: int):
    prompts = random_prompts((9, 40), 256, seed=seed)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, 6)


def _workers(llm) -> list:
    return list(llm.engine.runner.workers.processes)


def _assert_all_gone(workers) -> None:
    for process in workers:
        assert not process.is_alive()
        assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
    assert not any(t.name == "tp-watcher" for t in threading.enumerate())


def test_close_stops_every_worker_and_another_engine_starts_after(qwen3_dir):
    llm = _engine(qwen3_dir)
    workers = _workers(llm)
    assert [p.is_alive() for p in workers] == [True]
    _check_generates(llm, qwen3_dir, seed=1)
    llm.close()
    assert [p.exitcode for p in workers] == [0]  # stopped cleanly, not terminated
    _assert_all_gone(workers)
    llm.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    with _engine(qwen3_dir) as again:
        workers = _workers(again)
        _check_generates(again, qwen3_dir, seed=2)
    assert [p.exitcode for p in workers] == [0]
    _assert_all_gone(workers)


def test_a_worker_error_surfaces_on_rank_0(qwen3_dir):
    """The worker raises inside a call while rank 0 waits in a collective for it (on the engine's device: on NCCL a
    kernel that spins until the communicator is aborted): rank 0 gets the worker's error (not a hang); the engine
    refuses further work and still closes."""
    llm = _engine(qwen3_dir)
    workers = _workers(llm)
    tp = llm.engine.runner
    bad = Call("prefill", (["not a sequence"],), tp.finished["host"])
    with pytest.raises(WorkerError, match=r"rank 1 failed(.|\n)*ValueError"):
        tp._mirror("device", bad, lambda: parallel_state.all_reduce(torch.ones(1, device=tp.device)).item())
    with pytest.raises(WorkerError, match="close this LLM"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    _assert_all_gone(workers)


def test_a_killed_worker_surfaces_on_rank_0(qwen3_dir):
    llm = _engine(qwen3_dir)
    workers = _workers(llm)
    _check_generates(llm, qwen3_dir, seed=3)
    os.kill(workers[0].pid, signal.SIGKILL)
    workers[0].join(10)
    with pytest.raises(WorkerError, match="rank 1 failed"):
        llm.generate(random_prompts((9, 40), 256, seed=4), SamplingParams(max_tokens=4), use_tqdm=False)
    llm.close()
    _assert_all_gone(workers)


def test_a_process_group_of_its_own_is_refused_before_any_work(qwen3_dir, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already has a process group"):
            _engine(qwen3_dir)
        assert multiprocessing.active_children() == []
    finally:
        dist.destroy_process_group()


def test_an_abort_that_blocks_holds_up_neither_the_watcher_nor_close(monkeypatch):
    """NCCL's abort runs on a thread of its own: the watcher (which holds the lock rank 0 waits on to hear of a
    failure) returns at once, a second abort starts nothing, and leaving the groups waits for it only so long."""
    release = threading.Event()
    aborts = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda group=None: aborts.append(group) or release.wait())
    monkeypatch.setattr(parallel_state, "_groups", types.SimpleNamespace(backend="nccl"))
    monkeypatch.setattr(parallel_state, "ABORT_PATIENCE", 0.3)
    began = time.monotonic()
    parallel_state.abort()
    parallel_state.abort()
    assert time.monotonic() - began < 0.2
    with pytest.warns(UserWarning, match="left as they are"):
        parallel_state.destroy()  # still stuck: not waited on longer, nor the groups destroyed under it
    assert 0.3 <= time.monotonic() - began < 2.0
    release.set()
    assert aborts == [None]  # WORLD: every group in one call
