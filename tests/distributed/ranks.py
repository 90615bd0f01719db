"""Run a check on two gloo ranks, each its own spawned process (the test process never joins a process group, so
the engines of later tests can). A check is a function of (rank, tmp_dir) in this package that raises on failure."""
import importlib
import multiprocessing
import os

import torch

from offload_engine.distributed import parallel_state

TIMEOUT = 60


def run_on_two_ranks(check, tmp_dir: str, device: str = "cpu") -> None:
    """device "cuda": rank r on GPU r over NCCL, the groups made for bfloat16 activations."""
    context = multiprocessing.get_context("spawn")
    store = os.path.join(tmp_dir, "rendezvous")
    processes = [context.Process(target=_rank_main, args=(check.__module__, check.__name__, rank, store, tmp_dir,
                                                          device)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(TIMEOUT)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    codes = [process.exitcode for process in processes]
    assert codes == [0, 0], f"{check.__name__} failed on a rank (exit codes {codes}; the traceback is above)"


def _rank_main(module: str, name: str, rank: int, store: str, tmp_dir: str, device: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        parallel_state.init(rank, 2, torch.device("cuda", rank), store, torch.bfloat16)
    else:
        parallel_state.init(rank, 2, torch.device("cpu"), store, torch.float32)
    try:
        getattr(importlib.import_module(module), name)(rank, tmp_dir)
    finally:
        parallel_state.destroy()
