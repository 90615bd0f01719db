"""Streaming host KV (docs/design.md, "Streaming host KV"): a host step attends a share of each row's host blocks on
the device and the CPU kernel the rest, merged by LSE with split rows' device parts; greedy tokens equal
transformers' at every share, for host rows, split rows, GQA, block boundaries and prefix reuse, with the share
changing between steps; every host byte is read by exactly one path.

On a CPU device the streamed share is gathered on the host and attended by the torch backend: what these tests pin
is the maps and the merges. On CUDA (`make test-gpu`) the same tests run the host-step graphs' copies on their
stream, and check that the graphs ran and timed them.
"""
import itertools

import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.engine.graphs.graph_dispatch import GraphMode
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

NEW_TOKENS = 10
# Host blocks of 16 tokens: prompts end just before, at and after block boundaries, and the new tokens cross some.
LENGTHS = (15, 16, 17, 47, 80, 100)


def _generate(llm, prompts):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)


def _counted_bytes(llm) -> int:
    return llm.engine.stats.host_kernel_bytes + llm.engine.stats.stream_bytes


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_host_rows_are_exact_at_every_share(tiny_models, arch, share):
    model_dir = tiny_models[arch]
    prompts = random_prompts(LENGTHS, 256, seed=120)
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="cpu", cpu_block_size=16, num_cpu_blocks=96) as llm:
        llm.engine.stream.fixed = share
        outputs = _generate(llm, prompts)
        stats = llm.engine.stats
        assert (stats.stream_bytes > 0) == (share > 0)
        if share == 1.0:  # every full block streamed: the kernel reads only the blocks the new tokens go to
            assert stats.stream_bytes > stats.host_kernel_bytes
        if TEST_DEVICE == "cuda" and share > 0:  # the host-step graphs streamed it, and timed their copies
            assert llm.engine.runner.dispatcher.steps("host", GraphMode.PIECEWISE) > 0
            assert stats.snapshot()["stream_gbps"] > 0
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_split_rows_merge_three_partials(tiny_models, share):
    """Split rows (device part, streamed share, CPU part) beside whole host rows, in one host step."""
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts([150, 200, 90], 256, seed=121)
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=64,
             cpu_block_size=32, max_num_batched_tokens=64) as llm:
        llm.engine.stream.fixed = share
        outputs = _generate(llm, prompts)
        assert (llm.engine.stats.stream_bytes > 0) == (share > 0)
    assert "split" in {o.kv_location for o in outputs}
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_the_share_changes_between_steps_and_nothing_is_lost(tiny_models):
    """Each host step takes the next share of a cycle; the counted bytes are each row's host KV, read once."""
    model_dir = tiny_models["llama"]
    prompts = random_prompts(LENGTHS, 256, seed=122)
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="cpu", cpu_block_size=16, num_cpu_blocks=96) as llm:
        shares, seen = itertools.cycle([0.0, 1.0, 0.3, 0.7]), []
        llm.engine.stream.share = lambda *args: seen.append(next(shares)) or seen[-1]
        steps = []
        decode_host = llm.engine.runner.decode_host
        llm.engine.runner.decode_host = lambda seqs, *streamed: steps.append(sum(map(len, seqs))) or decode_host(
            seqs, *streamed)
        outputs = _generate(llm, prompts)
        per_token = llm.engine.stats.kv_bytes_per_token
        assert _counted_bytes(llm) == sum(steps) * per_token
    assert len(set(seen)) == 4
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_prefix_reuse_with_a_streamed_share(tiny_models):
    """A second request reuses the first's host blocks as its prefix; both stream part of them, and stay exact."""
    model_dir = tiny_models["qwen3"]
    shared, tails = random_prompts([64], 256, seed=123)[0], random_prompts([20, 37], 256, seed=124)
    prompts = [shared + tails[0], shared + tails[1]]
    with LLM(model_dir, device=TEST_DEVICE, kv_placement="cpu", cpu_block_size=16, num_cpu_blocks=64) as llm:
        llm.engine.stream.fixed = 0.6
        first = _generate(llm, prompts[:1])
        hits = llm.engine.blocks.num_prefix_hit_tokens
        second = _generate(llm, prompts[1:])
        assert llm.engine.blocks.num_prefix_hit_tokens - hits == 64
        assert llm.engine.stats.stream_bytes > 0
    assert [o.token_ids for o in first + second] == hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_the_switch_turns_streaming_off(tiny_models):
    with LLM(tiny_models["qwen3"], device=TEST_DEVICE, kv_placement="cpu", cpu_block_size=16, num_cpu_blocks=64,
             stream_host_kv=False) as llm:
        llm.engine.stream.fixed = 1.0
        _generate(llm, random_prompts([80], 256, seed=125))
        assert not llm.engine.stream.enabled and llm.engine.stats.stream_bytes == 0
        assert llm.engine.stats.host_kernel_bytes > 0
