"""Sequences across both tiers: a sequence too long for the device pool keeps its first tokens' KV there and the
rest on the host; it decodes over both parts, merged by LSE, and its greedy tokens equal transformers'.

The device pool holds 6 blocks of 16 tokens and host blocks hold 32, so a device part is a whole number of
32-token host blocks. max_num_batched_tokens is small, so prompts prefill in chunks that lie inside the device
part, cross into the host part, and lie past it.
"""
import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.engine.sched import placement
from offload_engine.engine.sched.block_manager import BlockManager
from offload_engine.engine.sequence import BlockLocation, Sequence
from tests.conftest import TEST_DEVICE, requires_cuda
from tests.oracle import hf_greedy, random_prompts

NEW_TOKENS = 12
POOLS = dict(num_gpu_blocks=6, num_cpu_blocks=64, cpu_block_size=32, max_num_batched_tokens=40)


def _engine(model_dir, **overrides):
    return LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", **{**POOLS, **overrides})


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("prompt_len", [95, 96, 97, 150])
def test_one_long_sequence_across_both_tiers(tiny_models, arch, prompt_len):
    """Device parts of 64 and 96 tokens (the whole pool), with the prompt ending just before, at and after
    them; the first new token lands in the host part's first block or further in."""
    model_dir = tiny_models[arch]
    prompts = random_prompts([prompt_len], 256, seed=91)
    with _engine(model_dir) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert llm.engine.blocks.pool(BlockLocation.GPU).num_free == 6  # both parts freed at the end
    assert outputs[0].kv_location == "split" and outputs[0].kv_device_tokens == min(prompt_len, 96) // 32 * 32
    assert outputs[0].token_ids == hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


def test_split_sequences_beside_whole_ones(tiny_models):
    """One batch with every kind of row. In a 10-block device pool the 10-token request takes 1 block (2 at its
    end); the 200-token one is split, keeping 4 of the 9 free blocks: what the first row and the 30-token
    request queued behind it will still need (1 + 3) is left out, in whole 32-token host blocks. The
    30-token one then fits the device, and the 150-token one (too long for the pool too) finds only 1 spare
    block, less than a host block: it goes wholly to the host tier. Nobody is demoted, all are exact."""
    model_dir = tiny_models["qwen3"]
    lengths = [10, 200, 30, 150]
    prompts = random_prompts(lengths, 256, seed=92)
    with _engine(model_dir, num_gpu_blocks=10) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert llm.engine.scheduler.num_demotions == 0 and llm.engine.scheduler.num_preemptions == 0
    assert [o.kv_location for o in outputs] == ["gpu", "split", "gpu", "cpu"]
    for output, ref, n in zip(outputs, hf_greedy(model_dir, prompts, NEW_TOKENS), lengths):
        assert output.token_ids == ref, f"prompt of {n} tokens, KV on {output.kv_location}"


def test_prefix_cache_hits_on_the_device_part(tiny_models):
    """A second request that shares a split request's first 80 tokens reuses the 5 device blocks that hold them
    and stays exact."""
    model_dir = tiny_models["llama"]
    shared, tails = random_prompts([80, 60, 70], 256, seed=93)[0], random_prompts([60, 70], 256, seed=94)
    prompts = [shared + tails[0], shared + tails[1]]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    with _engine(model_dir) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        hits_before = llm.engine.blocks.num_prefix_hit_tokens
        second = llm.generate(prompts[1:], params, use_tqdm=False)
        assert llm.engine.blocks.num_prefix_hit_tokens - hits_before == 80
    assert [o.kv_location for o in first + second] == ["split", "split"]
    assert [o.token_ids for o in first + second] == hf_greedy(model_dir, prompts, NEW_TOKENS)


def _seq(num_tokens, max_tokens):
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=max_tokens), num_tokens + max_tokens)


def test_split_policy():
    """Only under "auto", only a sequence that can never fit the device pool whole, only room the device rows
    and the waiting requests that fit the device will not need, in whole host blocks, at most its prompt."""
    blocks = BlockManager(num_gpu_blocks=8, block_size=16, num_cpu_blocks=64, cpu_block_size=32)
    long, fits = _seq(200, 10), _seq(100, 10)
    assert placement.split_device_tokens(long, "auto", blocks, []) == 128
    assert placement.split_device_tokens(_seq(40, 200), "auto", blocks, []) == 32  # at most the prompt
    assert placement.split_device_tokens(fits, "auto", blocks, []) == 0  # 110 tokens fit 8 blocks someday
    assert placement.split_device_tokens(long, "gpu", blocks, []) == 0
    assert placement.split_device_tokens(long, "cpu", blocks, []) == 0
    assert placement.split_device_tokens(long, "auto", blocks, [], [_seq(20, 12), _seq(300, 1)]) == 96  # 8 - 2
    row = _seq(20, 30)  # a device row of 2 blocks that will need 4: 2 more are kept for it
    blocks.allocate(row, BlockLocation.GPU)
    assert placement.split_device_tokens(long, "auto", blocks, [row]) == 64  # 6 free - 2 kept = 4 blocks
    blocks.allocate(long, BlockLocation.CPU, 64)
    assert long.is_split and len(long.device_prefix) == 4 and len(long.block_table) == 5  # 136 host tokens
    assert placement.split_device_tokens(_seq(300, 1), "auto", blocks, [row, long]) == 0  # 2 free, 2 kept
    blocks.deallocate(long)
    assert blocks.pool(BlockLocation.GPU).num_free == 6 and blocks.pool(BlockLocation.CPU).num_free == 64


@requires_cuda
def test_split_rows_decode_in_the_host_lanes_graphs(tiny_models, monkeypatch):
    """On CUDA the host lane's whole-step graphs attend over split rows' device parts themselves (beside the
    host kernel, merged in the graph): no split step falls back to the eager model."""
    from offload_engine.engine.graphs.host_step_graphs import HostStepGraphs

    model_dir = tiny_models["qwen2"]
    prompts = random_prompts([150, 40], 256, seed=95)
    graph_steps, run = [], HostStepGraphs.run
    monkeypatch.setattr(HostStepGraphs, "run", lambda self, t, p, meta: graph_steps.append(meta.has_gpu_rows)
                        or run(self, t, p, meta))
    with _engine(model_dir, num_cpu_blocks=64) as llm:
        eager = llm.engine.runner.model.forward
        llm.engine.runner.model.forward = lambda *a: pytest.fail("a decode step ran eagerly") if not a[2].is_prefill \
            else eager(*a)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.kv_location for o in outputs] == ["split", "gpu"] and any(graph_steps)
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_device_part_grows_as_device_rows_end(tiny_models):
    """A 20-token request with 4 new tokens ends early; the 2 device blocks it held go to the split row's device
    part (one 32-token host block moves up) while the split row decodes. Exact all along,
    and every block is free at the end."""
    model_dir = tiny_models["llama"]
    prompts = random_prompts([20, 150], 256, seed=96)
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=40)]
    with _engine(model_dir, num_gpu_blocks=8) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler, blocks = llm.engine.scheduler, llm.engine.blocks
        assert scheduler.num_split_growths >= 1 and scheduler.num_demotions == scheduler.num_preemptions == 0
        assert blocks.pool(BlockLocation.GPU).num_free == 8 and blocks.pool(BlockLocation.CPU).num_free == 64
    assert [o.kv_location for o in outputs] == ["gpu", "split"]
    assert outputs[1].kv_device_tokens == 96  # at admission: 8 blocks less the 20-token row's 2 (its budget: 24)
    refs = hf_greedy(model_dir, prompts[:1], 4) + hf_greedy(model_dir, prompts[1:], 40)
    assert [o.token_ids for o in outputs] == refs


def test_growth_policy():
    """Computed, full host blocks only, into spare room only; never while in flight or in prefill."""
    blocks = BlockManager(num_gpu_blocks=8, block_size=16, num_cpu_blocks=64, cpu_block_size=32)
    long = _seq(200, 10)
    blocks.allocate(long, BlockLocation.CPU, 64)  # 4 device blocks, host part of 136 tokens
    long.num_computed_tokens = 199
    long.status = None
    assert placement.split_growth(long, blocks, [long]) == 2  # 4 spare device blocks = 2 host blocks
    long.in_flight = True
    assert placement.split_growth(long, blocks, [long]) == 0
    long.in_flight = False
    growth, old = blocks.grow_device_part(long, 2)
    assert growth.num_computed_tokens == 64 and len(growth.block_table) == 4 and len(old) == 2
    assert long.num_device_tokens == 128 and long.device_prefix[-4:] == growth.block_table
    assert len(long.block_table) == 3 and blocks.pool(BlockLocation.CPU).num_free == 61  # 72 host tokens left
    assert placement.split_growth(long, blocks, [long]) == 0  # no device room left
    short = _seq(80, 100)  # budget 180: too long for the pool, split with 64 device tokens in a fresh manager
    blocks = BlockManager(num_gpu_blocks=8, block_size=16, num_cpu_blocks=64, cpu_block_size=32)
    blocks.allocate(short, BlockLocation.CPU, 64)
    short.num_computed_tokens = 79
    assert placement.split_growth(short, blocks, [short]) == 0  # 15 computed host tokens: no full host block
