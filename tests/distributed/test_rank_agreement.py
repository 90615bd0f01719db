"""Choices that decide which collectives a rank runs next come out the same on every rank: all_agree, and the
prefill graphs' timing loop, which runs forwards (collectives) until a bucket stops paying. With each rank timing
for itself, a rank that left the loop first would leave the other stuck in a collective."""
import functools

import torch

from offload_engine.distributed import parallel_state
from offload_engine.engine.graphs.prefill_graphs import PrefillGraphs
from tests.distributed.ranks import run_on_two_ranks


def test_ranks_agree_on_choices_that_decide_their_collectives(tmp_path):
    run_on_two_ranks(_check_agreement, str(tmp_path))


def _check_agreement(rank: int, tmp_dir: str) -> None:
    cpu = torch.device("cpu")
    with parallel_state.lane("device"):
        assert parallel_state.all_agree(True, cpu) is True
        assert parallel_state.all_agree(rank == 0, cpu) is False
        assert parallel_state.all_agree(False, cpu) is False
        forwards = []
        graphs = PrefillGraphs.__new__(PrefillGraphs)  # the timing loop alone: no model, no CUDA
        graphs.buckets, graphs.gpu_seconds = [16, 32, 64, 128], {}
        graphs.agree = functools.partial(parallel_state.all_agree, device=cpu)
        graphs._launch_seconds = lambda: 1.0
        graphs._forward = lambda size: forwards.append(parallel_state.all_reduce(torch.ones(1)))
        # Rank 0's buckets all pay; rank 1's stop paying at 64: both keep 32, after the same forwards.
        graphs._gpu_seconds = lambda size: 0.5 if rank == 0 or size < 64 else 2.0
        assert graphs.largest_paying_bucket() == 32
        assert len(forwards) == 3 and all(f.item() == 2 for f in forwards)
