"""Async scheduling and the persistent input batch: the device lane queues step N+1 before it reads step N, takes
N's sampled ids on the device, and its rows stay in place; tokens, stops and seeds are as with it off."""
import numpy as np
import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner.deferred_tokens import DeferredTokens
from offload_engine.engine.runner.input_batch import DecodeInputBatch
from offload_engine.engine.runner.step_inputs import StepInputBuilder
from offload_engine.engine.sequence import PENDING_TOKEN, BlockLocation, Sequence
from tests.conftest import TEST_DEVICE, requires_cuda
from tests.oracle import hf_greedy, random_prompts

PLACEMENTS = {  # every path a device-lane row can take: plain, preempted and recomputed, demoted to the host lane
    "gpu": dict(kv_placement="gpu"),
    "gpu-preempting": dict(kv_placement="gpu", num_gpu_blocks=7),
    "auto-demoting": dict(kv_placement="auto", kv_promotion=False, num_gpu_blocks=7, num_cpu_blocks=40,
                          cpu_block_size=16),
}


def _stop_params(model_dir, prompts, new_tokens):
    """Per prompt: greedy, stopping at a token its own reference continuation reaches at a different step, so rows
    finish by stop token while the step after theirs is already queued."""
    refs = hf_greedy(model_dir, prompts, new_tokens)
    params = []
    for i, ref in enumerate(refs):
        stop = ref[min(2 + 3 * i, len(ref) - 1)]
        params.append(SamplingParams(temperature=0, max_tokens=new_tokens, stop_token_ids=[stop]))
    return refs, params


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_stops_and_lengths_match_transformers_with_and_without_async(qwen3_dir, placement):
    prompts = random_prompts((30, 31, 17, 5, 40), 256, seed=70)
    refs, params = _stop_params(qwen3_dir, prompts, 20)
    results = {}
    for async_scheduling in (True, False):
        llm = LLM(qwen3_dir, device=TEST_DEVICE, async_scheduling=async_scheduling, **PLACEMENTS[placement])
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output, ref, p in zip(outputs, refs, params):
            stop = ref.index(p.stop_token_ids[0])  # its first place: it may come earlier than where it was taken
            assert output.token_ids == ref[: stop + 1]  # the stop token is the last, nothing after it
            assert output.finish_reason == "stop"
        results[async_scheduling] = [o.token_ids for o in outputs]
        scheduler = llm.engine.scheduler  # the path the placement is there for was taken
        assert scheduler.num_preemptions > 0 if placement == "gpu-preempting" else True
        assert scheduler.num_demotions > 0 if placement == "auto-demoting" else True
        assert not llm.engine.has_work() and llm.engine.pending is None
        llm.close()
    assert results[True] == results[False]


def test_seeded_sampling_is_the_same_with_and_without_async(qwen3_dir):
    prompts = random_prompts((12, 20, 7), 256, seed=71)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    tokens = []
    for async_scheduling in (True, False):
        with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", async_scheduling=async_scheduling) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1] and all(len(t) == 16 for t in tokens[0])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_next_step_is_queued_before_this_one_is_read(qwen3_dir, async_scheduling, monkeypatch):
    events = []
    result = DeferredTokens.result

    def logged_result(self):
        events.append(("read", id(self)))
        return result(self)

    monkeypatch.setattr(DeferredTokens, "result", logged_result)
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", async_scheduling=async_scheduling)
    launch = llm.engine.runner.launch_device_decode

    def logged_launch(seqs):
        out = launch(seqs)
        events.append(("queued", id(out)))
        return out

    llm.engine.runner.launch_device_decode = logged_launch
    prompts = random_prompts((9, 14), 256, seed=72)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 10)):
        assert len(output.token_ids) == 10 and output.token_ids[: len(ref)] == ref
    queued = [i for i, (kind, _) in enumerate(events) if kind == "queued"]
    ahead = sum(events[i + 1][0] == "read" and events[i + 1][1] != events[i][1] for i in queued if i + 1 < len(events))
    # 9 decode steps after the prefill: with async every one but the first is queued before its predecessor is read.
    assert ahead == (8 if async_scheduling else 0)
    llm.close()


def _seq(length: int, table: list[int], last_token: int | None = None) -> Sequence:
    seq = Sequence(torch.randint(0, 100, (length,)).tolist(), SamplingParams(), budget=length + 50)
    seq.location, seq.block_table, seq.num_computed_tokens = BlockLocation.GPU, table, length - 1
    if last_token is not None:
        seq.token_ids[-1] = last_token
    return seq


def test_rows_stay_in_place_and_only_new_blocks_are_written():
    gen = torch.Generator().manual_seed(73)
    blocks = torch.randperm(64, generator=gen).tolist()
    a, b, c = _seq(33, blocks[0:3]), _seq(16, blocks[3:4]), _seq(70, blocks[4:9])
    batch = DecodeInputBatch(max_rows=8, max_blocks=16, block_size=16, device=torch.device("cpu"))
    assert batch.place([a, b, c]) == [a, b, c]
    batch.prepare(4, None)
    assert batch.block_writes == 3 + 1 + 5
    # b leaves, a gains a token, c gains a block, d joins: c moves into b's row, a stays, d goes last.
    a.token_ids.append(5)
    c.token_ids += [6] * 11  # 81 tokens: a sixth block
    c.block_table.append(blocks[9])
    d = _seq(17, blocks[10:12])
    assert batch.place([d, c, a]) == [a, c, d]
    meta = batch.prepare(4, None)
    assert batch.block_writes == 9 + 1 + 2  # c's new block and d's two, nothing rewritten
    ref = StepInputBuilder(torch.device("cpu"), 16, 64).decode([a, c, d])  # the per-step builder: independent
    assert batch.gather_tokens(3).tolist() == ref.token_ids.tolist()
    assert batch.positions[:3].tolist() == ref.positions.tolist()
    assert meta.slot_mapping[:3].tolist() == ref.meta.slot_mapping.tolist()
    assert meta.context_lens.tolist() == ref.meta.context_lens.tolist() + [0]  # the padded row reads nothing
    assert meta.slot_mapping[3].item() == -1
    width = ref.meta.block_tables.shape[1]
    assert torch.equal(meta.block_tables[:3, :width], ref.meta.block_tables)


def test_pending_tokens_are_taken_from_the_step_in_flight_on_the_device():
    blocks = list(range(20))
    a, b = _seq(20, blocks[0:2], last_token=PENDING_TOKEN), _seq(9, blocks[2:3])
    c = _seq(40, blocks[3:6], last_token=PENDING_TOKEN)
    batch = DecodeInputBatch(max_rows=4, max_blocks=8, block_size=16, device=torch.device("cpu"))
    batch.sampled[:3] = torch.tensor([111, 222, 333])  # the step in flight left its ids there
    in_flight = DeferredTokens([c, Sequence([1], SamplingParams(), 2), a], batch.sampled[:3],
                               torch.empty(3, dtype=torch.int64))
    batch.place([a, b, c])
    batch.prepare(3, in_flight)
    assert batch.gather_tokens(3).tolist() == [333, b.token_ids[-1], 111]
    # b leaves: the padding rows of a larger graph bucket read valid token ids, never a pending row's -1
    batch.place([a, c])
    batch.prepare(3, in_flight)
    batch.place([a, c])
    batch.prepare(4, in_flight)
    assert (batch.gather_tokens(4) >= 0).all()
    with pytest.raises(RuntimeError, match="pending"):
        batch.prepare(3, None)


def test_async_scheduling_must_be_a_bool(qwen3_dir):
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        LLM(qwen3_dir, device=TEST_DEVICE, async_scheduling="yes")


@requires_cuda
def test_decode_steps_allocate_no_pinned_memory(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=8, num_cpu_blocks=40,
              cpu_block_size=16)
    prompts = random_prompts((30, 31, 17, 5, 40), 256, seed=74)
    params = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs, caches
    pins = []
    pin_memory = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pins.append(self.shape) or pin_memory(self, *a))
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.decoded_by_lane["host"] > 0 and not pins
    llm.close()
