"""Prefill through the static, bucket-padded tensors of engine/graphs/prefill_graphs.py against the eager forward: the same
hidden states, the same KV, and no write anywhere else (padding, or an earlier longer step's slots). On the CPU the
static path runs without capture; on CUDA the engine's own captured graphs replay. The engine with them, against
transformers."""
from types import SimpleNamespace

import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.engine.graphs.graph_dispatch import GraphMode
from offload_engine.engine.graphs.prefill_graphs import PrefillGraphs, token_buckets
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.sampling_params import SamplingParams as Params
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts


def test_buckets_pad_a_step_by_at_most_half_and_end_at_the_largest():
    for largest in (100, 256, 3000, 8192, 16384):
        buckets = token_buckets(largest)
        assert buckets == sorted(set(buckets)) and buckets[-1] == largest
        for tokens in range(1, largest + 1, 7):
            chosen = next(b for b in buckets if b >= tokens)
            assert chosen <= max(256, 2 * tokens) and (tokens <= 1024 or 2 * chosen <= 3 * tokens)


@pytest.fixture
def runner_and_graphs(qwen3_dir):
    llm = LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="triton", kv_placement="gpu", num_gpu_blocks=24,
              max_model_len=128, max_num_batched_tokens=96)
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    if graphs is None:  # the CPU: the same static tensors and padding, run eagerly
        graphs = PrefillGraphs(runner.model, 96, 4, -(-128 // 16), runner.dtype, runner.device)
    yield runner, graphs
    llm.close()


def _rows(lengths_and_prefixes, first_block=0, vocab=256, seed=0):
    """Device-tier sequences, each with `prefix` tokens already cached and the rest scheduled, blocks in order."""
    gen = torch.Generator().manual_seed(seed)
    seqs, block = [], first_block
    for length, prefix in lengths_and_prefixes:
        seq = Sequence(torch.randint(1, vocab, (length,), generator=gen).tolist(), Params(), budget=length)
        seq.location, seq.num_computed_tokens, seq.num_scheduled_tokens = BlockLocation.GPU, prefix, length - prefix
        seq.block_table = list(range(block, block + -(-length // 16)))
        block += len(seq.block_table)
        seqs.append(seq)
    return seqs


def _fill_pool(runner, seed):
    gen = torch.Generator().manual_seed(seed)
    for layer in runner.model.attention_layers():
        for cache in (layer.k_cache, layer.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))


def _pool(runner):
    return [cache.clone() for layer in runner.model.attention_layers() for cache in (layer.k_cache, layer.v_cache)]


def _run(runner, graphs, seqs, static: bool):
    step = runner.inputs.prefill(seqs)
    with torch.inference_mode():
        if not static:
            return runner.model(step.token_ids, step.positions, step.meta), step
        size = graphs.fits(step.token_ids.shape[0], step.meta)
        assert size is not None
        hidden = graphs.run(size, step.token_ids, step.positions, step.meta,
                            [s.num_scheduled_tokens for s in seqs], runner.inputs.to_device)
        return hidden.clone(), step


def _written(step, shape):
    """A mask of the pool's [blocks, block_size] slots the step writes."""
    mask = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    slots = step.meta.slot_mapping.cpu()
    mask[slots[slots >= 0]] = True
    return mask.view(shape[0], shape[1])


def test_host_tier_rows_wide_tables_and_buckets_that_do_not_pay_run_eagerly(runner_and_graphs):
    _, graphs = runner_and_graphs
    largest = graphs.buckets[-1]

    def meta(rows=2, width=2, host=False):
        return SimpleNamespace(has_cpu_rows=host, context_lens=torch.zeros(rows), block_tables=torch.zeros(rows, width))

    assert graphs.fits(40, meta()) == largest == 96
    assert graphs.fits(97, meta()) is None
    assert graphs.fits(40, meta(host=True)) is None
    assert graphs.fits(40, meta(rows=graphs.max_rows + 1)) is None
    assert graphs.fits(40, meta(width=graphs.max_blocks_per_seq + 1)) is None
    graphs.pays[largest] = False
    assert graphs.fits(40, meta()) is None
    graphs.pays[largest] = True


@pytest.mark.parametrize("launch_ms, paying, measured", [
    (10.0, 512, [256, 512, 1024]),  # 1,024 tokens take 10.24 ms: it and every larger bucket are left to eager steps
    (2.0, 0, [256]),  # no bucket pays: no graph, and no memory set aside for one
    (100.0, 4096, [256, 512, 1024, 1536, 2048, 3072, 4096]),
])
def test_buckets_pay_up_to_the_first_whose_gpu_time_passes_an_eager_launch(runner_and_graphs, launch_ms, paying,
                                                                           measured):
    runner, _ = runner_and_graphs
    graphs = PrefillGraphs(runner.model, 4096, 4, 8, runner.dtype, runner.device)
    timed = []
    graphs._forward = lambda size: None
    graphs._launch_seconds = lambda: launch_ms / 1e3
    graphs._gpu_seconds = lambda size: timed.append(size) or size * 1e-5
    assert graphs.largest_paying_bucket() == paying
    assert sorted(set(timed)) == measured


def test_a_launch_bound_model_pays_at_every_bucket_measured_on_the_gpu(runner_and_graphs):
    if TEST_DEVICE != "cuda":
        pytest.skip("the measurement times CUDA kernels")
    runner, _ = runner_and_graphs
    graphs = PrefillGraphs(runner.model, 96, 4, 8, runner.dtype, runner.device)
    # The tiny model's ~200 kernels take the GPU far less time than Python takes to launch them.
    assert graphs.largest_paying_bucket() == 96
    assert 0 < graphs.gpu_seconds[96] < graphs.launch_seconds


def test_padded_static_steps_write_and_return_what_eager_ones_do(runner_and_graphs):
    runner, graphs = runner_and_graphs
    # Block boundaries (16, 17), one token, a chunk after a cached prefix (attends over 20 + 9), GQA (the tiny model).
    seqs = _rows([(17, 0), (1, 0), (29, 20), (16, 0)])
    results = []
    for static in (False, True):
        _fill_pool(runner, seed=3)  # fresh random KV, the cached prefix included
        hidden, step = _run(runner, graphs, seqs, static)
        results.append((hidden, _pool(runner), step))
    (eager, eager_pool, step), (padded, padded_pool, _) = results
    tolerance = 1e-5 if eager.dtype == torch.float32 else 2e-2
    assert padded.shape == eager.shape
    assert torch.allclose(padded.float(), eager.float(), atol=tolerance, rtol=tolerance)
    _fill_pool(runner, seed=3)
    untouched = _pool(runner)
    written = _written(step, untouched[0].shape)
    for before, after_eager, after_padded in zip(untouched, eager_pool, padded_pool):
        assert torch.equal(after_padded[~written], before[~written])  # padding wrote nowhere
        assert torch.allclose(after_padded[written].float(), after_eager[written].float(), atol=tolerance,
                              rtol=tolerance)
        assert not torch.equal(after_padded[written], before[written])


def test_a_shorter_step_after_a_longer_one_writes_only_its_own_slots(runner_and_graphs):
    runner, graphs = runner_and_graphs
    _run(runner, graphs, _rows([(40, 0), (30, 0)]), static=True)  # fills the static slots of 70 tokens
    _fill_pool(runner, seed=5)
    before = _pool(runner)
    hidden, step = _run(runner, graphs, _rows([(5, 0)], first_block=10, seed=1), static=True)
    assert hidden.shape[0] == 5
    written = _written(step, before[0].shape)
    assert written.sum() == 5
    for cache_before, cache_after in zip(before, _pool(runner)):
        assert torch.equal(cache_after[~written], cache_before[~written])


def test_the_engine_replays_prefill_graphs_and_matches_transformers(qwen3_dir):
    if TEST_DEVICE != "cuda":
        pytest.skip("prefill graphs are captured on CUDA only; the static path is checked above on the CPU")
    # Two rows a step: (1, 17) and (40, 30) replay graphs, (16, 300) is past the largest bucket and runs eagerly.
    prompts = random_prompts((1, 17, 40, 30, 16, 300), 256, seed=41)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="triton", kv_placement="gpu", num_gpu_blocks=64,
              max_num_seqs=2, max_num_batched_tokens=320, prefill_graph_tokens=128)
    _check_generates(llm, qwen3_dir, prompts, max_tokens=6, graph_steps=2)


def test_only_buckets_that_pay_are_captured_and_the_kv_pool_gives_up_only_their_memory(qwen3_dir, monkeypatch):
    if TEST_DEVICE != "cuda":
        pytest.skip("prefill graphs are captured on CUDA only")
    from offload_engine.engine.runner import memory_profile

    measured, sized = [], []
    monkeypatch.setattr(PrefillGraphs, "largest_paying_bucket", lambda self: measured.append(1) or 256)
    peak = memory_profile.prefill_peak_bytes
    monkeypatch.setattr(memory_profile, "prefill_peak_bytes", lambda runner, tokens: sized.append(tokens) or
                        peak(runner, tokens))
    # The pool is sized from the device's memory (no num_gpu_blocks): the profile measures which buckets pay, and
    # the capture takes its answer.
    llm = LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="triton", kv_placement="gpu", max_num_seqs=1,
              max_model_len=512, max_num_batched_tokens=2048, prefill_graph_tokens=2048)
    graphs = llm.engine.runner.prefill_graphs
    assert measured == [1] and sized == [2048, 256]
    assert sorted(graphs.graphs) == [256] and graphs.buckets == [256]
    # One row a step: 200 tokens replay the 256 graph, 400 run eagerly; both decode as transformers does.
    prompts = random_prompts((200, 400), 256, seed=43)
    _check_generates(llm, qwen3_dir, prompts, max_tokens=4, graph_steps=1)


def _check_generates(llm, model_dir, prompts, max_tokens: int, graph_steps: int) -> None:
    """Greedy outputs equal to transformers', with at least graph_steps prefill steps on graphs and one eager; closes
    the engine."""
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    dispatcher = llm.engine.runner.dispatcher
    assert dispatcher.steps("prefill", GraphMode.FULL) >= graph_steps
    assert dispatcher.steps("prefill", GraphMode.NONE) >= 1
    for output, ref in zip(outputs, hf_greedy(model_dir, prompts, max_tokens)):
        assert output.token_ids == ref
    llm.close()
