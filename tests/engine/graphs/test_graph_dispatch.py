"""The CUDA-graph dispatcher: FULL for device-lane steps over whole-step graphs, PIECEWISE for host steps and for
piecewise device graphs, NONE past the largest bucket, without graphs, or for split rows the graphs cannot hold."""
from types import SimpleNamespace

import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.engine.graphs.graph_dispatch import BatchDescriptor, GraphDispatcher, GraphMode
from tests.conftest import TEST_DEVICE, requires_cuda
from tests.oracle import random_prompts


def _graphs(whole: bool, split_width: int = 0):
    fits = lambda rows, meta: meta is None or not meta.has_gpu_rows or meta.width <= split_width
    return SimpleNamespace(buckets=[1, 2, 4, 8, 16, 32], whole_steps=whole, fits=fits)


def test_modes_follow_the_lane_the_graphs_and_the_batch():
    dispatcher = GraphDispatcher({"device": _graphs(whole=True), "host": _graphs(whole=False, split_width=4)})
    host_only = SimpleNamespace(has_gpu_rows=False)
    assert dispatcher.dispatch("device", 3) == (GraphMode.FULL, BatchDescriptor("device", 4, False))
    assert dispatcher.dispatch("device", 32) == (GraphMode.FULL, BatchDescriptor("device", 32, False))
    assert dispatcher.dispatch("device", 33) == (GraphMode.NONE, BatchDescriptor("device", 33, False))
    assert dispatcher.dispatch("host", 9, host_only) == (GraphMode.PIECEWISE, BatchDescriptor("host", 16, False))
    split = SimpleNamespace(has_gpu_rows=True, width=3)
    assert dispatcher.dispatch("host", 5, split) == (GraphMode.PIECEWISE, BatchDescriptor("host", 8, True))
    too_wide = SimpleNamespace(has_gpu_rows=True, width=9)
    assert dispatcher.dispatch("host", 5, too_wide) == (GraphMode.NONE, BatchDescriptor("host", 5, True))
    assert dispatcher.steps("device", GraphMode.FULL) == 2 and dispatcher.steps("host", GraphMode.NONE) == 1


def test_piecewise_device_graphs_and_no_graphs():
    dispatcher = GraphDispatcher({"device": _graphs(whole=False)})
    assert dispatcher.dispatch("device", 7)[0] == GraphMode.PIECEWISE
    assert dispatcher.dispatch("host", 7, SimpleNamespace(has_gpu_rows=False))[0] == GraphMode.NONE
    assert GraphDispatcher({}).dispatch("device", 1)[0] == GraphMode.NONE


def test_prefill_steps_replay_their_token_bucket_where_the_prefill_graphs_take_them():
    dispatcher = GraphDispatcher({})
    assert dispatcher.dispatch_prefill(300, SimpleNamespace(has_cpu_rows=False)) == (
        GraphMode.NONE, BatchDescriptor("prefill", 300, False))
    dispatcher.prefill_graphs = SimpleNamespace(fits=lambda tokens, meta: None if meta.has_cpu_rows else 512)
    assert dispatcher.dispatch_prefill(300, SimpleNamespace(has_cpu_rows=False)) == (
        GraphMode.FULL, BatchDescriptor("prefill", 512, False))
    assert dispatcher.dispatch_prefill(300, SimpleNamespace(has_cpu_rows=True))[0] == GraphMode.NONE
    assert dispatcher.steps("prefill", GraphMode.FULL) == 1 and dispatcher.steps("prefill", GraphMode.NONE) == 2


def test_cpu_engines_run_eagerly(qwen3_dir):
    if TEST_DEVICE != "cpu":
        pytest.skip("a CPU engine")
    llm = LLM(qwen3_dir, device="cpu", kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=40, cpu_block_size=16)
    llm.generate(random_prompts((30, 31, 17), 256, seed=81), SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True), use_tqdm=False)
    counts = llm.engine.runner.dispatcher
    assert counts.steps("device", GraphMode.NONE) > 0 and counts.steps("host", GraphMode.NONE) > 0
    assert not any(mode != GraphMode.NONE for mode, _ in counts.counts)
    llm.close()


@requires_cuda
def test_device_steps_replay_full_graphs_and_host_steps_piecewise(qwen3_dir):
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=8, num_cpu_blocks=40,
              cpu_block_size=16)
    llm.generate(random_prompts((30, 31, 17, 5, 40), 256, seed=82),
                 SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True), use_tqdm=False)
    dispatcher = llm.engine.runner.dispatcher
    assert dispatcher.steps("device", GraphMode.FULL) > 0 and dispatcher.steps("host", GraphMode.PIECEWISE) > 0
    assert dispatcher.steps("device", GraphMode.NONE) == dispatcher.steps("host", GraphMode.NONE) == 0
    llm.close()
