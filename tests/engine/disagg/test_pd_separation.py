"""Prefill/decode separation: prompts prefill on `prefill_device` (the prefill lane, on its own thread), their KV
crosses to `device` once, and decode goes on there meanwhile. Greedy tokens equal transformers' in every placement.

On the CPU the two devices are two model instances on the CPU; with OFFLOAD_ENGINE_TEST_DEVICE=cuda they are
cuda:1 (decode) and cuda:0 (prefill), and the tests skip on a host with fewer than two GPUs.
"""
import gc
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.engine.sequence import BlockLocation, Sequence
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10)
POOLS = {  # "auto": a device pool too small for the batch, so rows are demoted and promoted back
    "gpu": dict(num_gpu_blocks=32),
    "cpu": dict(num_gpu_blocks=4, num_cpu_blocks=32, cpu_block_size=16),
    "auto": dict(num_gpu_blocks=7, num_cpu_blocks=40, cpu_block_size=16),
}


@pytest.fixture
def pd():
    """The devices of a PD engine on TEST_DEVICE."""
    if TEST_DEVICE == "cuda":
        if torch.cuda.device_count() < 2:
            pytest.skip("prefill/decode separation needs two GPUs; this host has one")
        return dict(device="cuda:1", prefill_device="cuda:0")
    return dict(device="cpu", prefill_device="cpu")


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("prefill-lane")]


def _check_idle(llm: LLM) -> None:
    """Nothing in flight and every block back: no request or block was left behind."""
    engine = llm.engine
    assert not engine.has_work() and engine.pending is None
    assert not engine.prefill.busy
    for location in (BlockLocation.GPU, BlockLocation.CPU):
        pool = engine.blocks.pool(location)
        assert pool.num_free == pool.num_blocks


def _count_lane_chunks(lane) -> dict[int, int]:
    """Counts, from now on, the prompt chunks each sequence runs on the lane."""
    chunks, submit = {}, lane.submit

    def counting_submit(rows, decode_device_prefills):
        submit(rows, decode_device_prefills)
        for seq in rows:
            chunks[seq.seq_id] = chunks.get(seq.seq_id, 0) + 1

    lane.submit = counting_submit
    return chunks


def _count_decode_device_prefills(llm: LLM) -> list[Sequence]:
    """Records, from now on, the rows of every prefill step the decode device runs, as they stand then."""
    rows, prefill = [], llm.engine.runner.prefill

    def recording_prefill(seqs):
        rows.extend((seq, seq.location, seq.is_split) for seq in seqs)
        return prefill(seqs)

    llm.engine.runner.prefill = recording_prefill
    return rows


@pytest.mark.parametrize("placement", ["gpu", "cpu", "auto"])
def test_greedy_matches_transformers_in_every_placement(qwen3_dir, pd, placement):
    """Prompts longer than max_num_batched_tokens take several lane steps; under "auto" rows are demoted to the
    host lane and promoted back. Every unsplit prompt prefills on the lane, its KV landing in the tier it decodes
    from: the decode device's pool (crossing by the handoff) or the host pool (written by the lane)."""
    prompts = random_prompts((30, 31, 17, 5, 40, 22, 9, 35), 256, seed=70)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(qwen3_dir, kv_placement=placement, max_num_batched_tokens=24, **POOLS[placement], **pd)
    lane, scheduler = llm.engine.prefill, llm.engine.scheduler
    chunks, on_decode_device = _count_lane_chunks(lane), _count_decode_device_prefills(llm)
    segments, lane_segment = [], lane.runner._prefill_segment
    lane.runner._prefill_segment = lambda seq: segments.append(seq.location) or lane_segment(seq)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 20)):
        assert output.token_ids[: len(ref)] == ref  # (transformers stops at eos)
    # All but its last token at least (a chunk that leaves one makes it a decode row), the long ones in several steps.
    assert all(is_split for _, _, is_split in on_decode_device)
    assert len(chunks) == len(prompts) - len({seq.seq_id for seq, _, _ in on_decode_device})
    assert lane.num_prompt_tokens >= sum(map(len, prompts)) - 2 * len(prompts) and max(chunks.values()) >= 2
    on_device = [o for o in outputs if o.kv_location == "gpu"]
    if placement == "cpu":  # a host-tier prompt longer than a step's budget takes a layer-major segment, on the lane
        assert not on_device and lane.handoff.num_sent_blocks == 0 and BlockLocation.CPU in segments
    else:
        assert on_device and lane.handoff.num_sent_blocks
    if placement == "auto":
        assert scheduler.num_demotions > 0 and scheduler.num_promotions > 0
    _check_idle(llm)
    llm.close()


def test_host_tier_prompts_hit_host_blocks_the_lane_and_the_decode_device_wrote(qwen3_dir, pd):
    """A prompt that repeats a host-tier one with its completion hits host blocks the lane wrote (its prompt) and
    ones the decode device's host lane wrote (its decode steps); the lane stages both from the host pool."""
    llm = LLM(qwen3_dir, kv_placement="cpu", max_num_batched_tokens=24, **POOLS["cpu"], **pd)
    first = random_prompts((20,), 256, seed=74)
    out = llm.generate(first, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    blocks, lane = llm.engine.blocks, llm.engine.prefill
    hits, lane_tokens = blocks.num_prefix_hit_tokens, lane.num_prompt_tokens
    second = [first[0] + out[0].token_ids + random_prompts((7,), 256, seed=75)[0]]
    again = llm.generate(second, GREEDY, use_tqdm=False)
    assert blocks.num_prefix_hit_tokens - hits == 48 and lane.num_prompt_tokens > lane_tokens
    assert again[0].kv_location == "cpu"
    assert again[0].token_ids == hf_greedy(qwen3_dir, second, GREEDY.max_tokens)[0]
    _check_idle(llm)
    llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_other_architectures(tiny_models, pd, arch):
    prompts = random_prompts((1, 16, 33, 15, 17, 47), 256, seed=71)
    llm = LLM(tiny_models[arch], kv_placement="gpu", num_gpu_blocks=32, max_num_batched_tokens=20, **pd)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, GREEDY.max_tokens)
    llm.close()


def test_prefix_hits_made_on_either_device(qwen3_dir, pd):
    """A prompt that repeats an earlier one with its completion hits blocks whose KV the lane made (the mirror
    holds it: nothing is copied back) and blocks that decode steps filled (only the decode device has their KV:
    they are copied to the mirror before the prompt's first chunk attends over them)."""
    llm = LLM(qwen3_dir, kv_placement="gpu", num_gpu_blocks=32, max_num_batched_tokens=24, **pd)
    first = random_prompts((20,), 256, seed=72)
    out = llm.generate(first, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    handoff, blocks = llm.engine.prefill.handoff, llm.engine.blocks
    assert handoff.num_filled_blocks == 0
    hits_before = blocks.num_prefix_hit_tokens
    # The first 16 tokens' block came from the lane; tokens 16-47 were filled (partly or wholly) by decode steps.
    second = [first[0] + out[0].token_ids + random_prompts((7,), 256, seed=73)[0]]
    again = llm.generate(second, GREEDY, use_tqdm=False)
    assert blocks.num_prefix_hit_tokens - hits_before == 48
    assert handoff.num_filled_blocks == 2
    # A third prompt with the same 32-token prefix: both blocks are in the mirror now.
    third = [second[0][:33]]
    last = llm.generate(third, GREEDY, use_tqdm=False)
    assert handoff.num_filled_blocks == 2 and blocks.num_prefix_hit_tokens - hits_before == 48 + 32
    assert [again[0].token_ids, last[0].token_ids] == hf_greedy(qwen3_dir, second + third, GREEDY.max_tokens)
    _check_idle(llm)
    llm.close()


def test_a_host_tier_chunk_waits_for_the_decode_devices_host_accesses_and_is_taken_in_once_written(qwen3_dir, pd):
    """The lane waits for the host-pool accesses the decode device queued before its batch (a promotion may still
    read a block just freed), and a host-tier chunk's row comes back only once the lane's host writes have landed
    (taking it in registers its blocks for prefix hits)."""
    llm = LLM(qwen3_dir, kv_placement="cpu", max_num_batched_tokens=24, **POOLS["cpu"], **pd)
    lane, order = llm.engine.prefill, []

    class Access:
        def synchronize(self):
            order.append("decode-device access waited for")

    llm.engine.runner.accesses.marks = lambda: [Access()]
    lane_prefill, take_writes = lane.runner.prefill, lane.runner.executor_writes.take
    lane.runner.prefill = lambda seqs: order.append("lane prefill") or lane_prefill(seqs)
    held, released = Future(), []

    def release():
        time.sleep(0.3)
        released.append(time.perf_counter())
        held.set_result(None)

    lane.runner.executor_writes.take = lambda: take_writes() + [held]
    scheduler_postprocess, taken_in = llm.engine.scheduler.postprocess, []
    llm.engine.scheduler.postprocess = lambda rows, tokens: (rows and taken_in.append(time.perf_counter())) or \
        scheduler_postprocess(rows, tokens)
    threading.Thread(target=release).start()
    out = llm.generate(random_prompts((20,), 256, seed=79), GREEDY, use_tqdm=False)
    assert order[:2] == ["decode-device access waited for", "lane prefill"]
    assert taken_in and min(taken_in) >= released[0]
    assert out[0].token_ids == hf_greedy(qwen3_dir, random_prompts((20,), 256, seed=79), GREEDY.max_tokens)[0]
    _check_idle(llm)
    llm.close()


def test_a_split_row_prefills_on_the_decode_device_over_blocks_the_lane_made(qwen3_dir, pd):
    """A prompt too long for the device pool is split (placement.py) and prefills on the decode device; its device
    part reuses the blocks of an earlier prompt that the lane prefilled, whose KV crossed by the handoff."""
    llm = LLM(qwen3_dir, kv_placement="auto", num_gpu_blocks=10, num_cpu_blocks=64, cpu_block_size=32,
              max_num_batched_tokens=40, **pd)
    shared = random_prompts((64,), 256, seed=80)[0]
    prompts = [shared, shared + random_prompts((136,), 256, seed=81)[0]]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    lane_tokens, hits = llm.engine.prefill.num_prompt_tokens, llm.engine.blocks.num_prefix_hit_tokens
    second = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].kv_location == "gpu" and second[0].kv_location == "split"
    assert llm.engine.blocks.num_prefix_hit_tokens - hits == 64 and llm.engine.prefill.num_prompt_tokens == lane_tokens
    assert [first[0].token_ids, second[0].token_ids] == hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    _check_idle(llm)
    llm.close()


def test_decode_steps_run_while_a_prefill_is_on_the_lane(qwen3_dir, pd):
    """An early request decodes while a later one's prompt chunks compute on the lane (made slow here): the device
    lane's steps fall inside the lane's steps, which run on the lane's own thread."""
    llm = LLM(qwen3_dir, kv_placement="gpu", num_gpu_blocks=32, max_num_batched_tokens=16, **pd)
    lane_runner, decode_runner = llm.engine.prefill.runner, llm.engine.runner
    lane_spans, decode_spans, prefills_here = [], [], []
    lane_prefill = lane_runner.prefill
    decode_prefill, decode_launch = decode_runner.prefill, decode_runner.launch_device_decode

    def slow_lane_prefill(seqs):
        start = time.perf_counter()
        if any(len(s) > 16 for s in seqs):  # the long prompt's chunks
            time.sleep(0.15)
        tokens = lane_prefill(seqs)
        lane_spans.append((start, time.perf_counter(), threading.current_thread().name))
        return tokens

    def prefill_here(seqs):
        prefills_here.append(seqs)
        return decode_prefill(seqs)

    def timed_launch(seqs):
        start = time.perf_counter()
        out = decode_launch(seqs)
        decode_spans.append((start, time.perf_counter()))
        return out

    lane_runner.prefill, decode_runner.prefill, decode_runner.launch_device_decode = (
        slow_lane_prefill, prefill_here, timed_launch)
    # The short prompt shares the first lane step with the long one's first 6 tokens, then decodes.
    prompts = random_prompts((10, 40), 256, seed=74)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 40)):
        assert output.token_ids[: len(ref)] == ref[: len(output.token_ids)]
    assert not prefills_here  # every prompt was prefilled on the lane
    assert len(lane_spans) >= 4 and all(name.startswith("prefill-lane") for _, _, name in lane_spans)
    inside = sum(any(a < d0 and d1 < b for a, b, _ in lane_spans) for d0, d1 in decode_spans)
    assert inside >= 5, f"only {inside} of {len(decode_spans)} decode steps ran during a prefill-lane step"
    llm.close()


SMALL_POOLS = {"gpu": dict(num_gpu_blocks=5), "cpu": dict(num_gpu_blocks=4, num_cpu_blocks=5, cpu_block_size=16)}


@pytest.mark.parametrize("placement,async_scheduling", [("gpu", True), ("gpu", False), ("cpu", True)])
def test_no_request_is_lost(qwen3_dir, pd, placement, async_scheduling):
    """Many requests through few rows and a small pool: some end at their first token (sampled on the lane), some
    are preempted and recomputed on the lane, every one comes back whole, and every block is free at the end."""
    prompts = random_prompts([5 + (7 * i) % 40 for i in range(14)], 256, seed=75)
    params = [SamplingParams(temperature=0, max_tokens=1 + (5 * i) % 16, ignore_eos=True) for i in range(14)]
    llm = LLM(qwen3_dir, kv_placement=placement, max_num_seqs=4, max_num_batched_tokens=32,
              async_scheduling=async_scheduling, **SMALL_POOLS[placement], **pd)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    refs = hf_greedy(qwen3_dir, prompts, 16)
    for output, ref, p in zip(outputs, refs, params):
        assert len(output.token_ids) == p.max_tokens and output.finish_reason == "length"
        assert output.token_ids[: len(ref)] == ref[: p.max_tokens]
    assert llm.engine.scheduler.num_preemptions > 0
    _check_idle(llm)
    llm.close()


def test_seeded_sampling_equals_the_engine_without_pd(qwen3_dir, pd):
    """The first token is sampled on the lane with the same per-request keys as on the decode device."""
    prompts = random_prompts((12, 20, 7), 256, seed=76)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=8, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    tokens = []
    for prefill_device in (pd["prefill_device"], None):
        with LLM(qwen3_dir, device=pd["device"], prefill_device=prefill_device, kv_placement="gpu",
                 num_gpu_blocks=32) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("placement", ["gpu", "cpu"])
def test_an_error_mid_run_leaves_the_engine_usable(qwen3_dir, pd, placement):
    """A decode step fails while a prompt computes on the lane: abort waits for the lane's step and its copies (or
    its host writes), drops every request, and the next generate() is exact."""
    pools = {"gpu": POOLS["gpu"], "cpu": POOLS["cpu"]}[placement]
    llm = LLM(qwen3_dir, kv_placement=placement, max_num_batched_tokens=16, **pools, **pd)
    lane_runner, decode_runner = llm.engine.prefill.runner, llm.engine.runner
    lane_prefill = lane_runner.prefill
    decode_steps = {name: getattr(decode_runner, name) for name in ("prefill", "launch_device_decode", "decode_host")}
    calls = []

    def slow_lane_prefill(seqs):
        time.sleep(0.2)
        return lane_prefill(seqs)

    def failing(step):
        def failing_step(seqs, *args):
            calls.append(step)
            if len(calls) == 3:
                raise RuntimeError("a failed step")
            return step(seqs, *args)
        return failing_step

    lane = llm.engine.prefill
    abort, computing_at_abort = lane.abort, []

    def watched_abort():
        computing_at_abort.append(lane.computing)
        abort()

    lane_runner.prefill, lane.abort = slow_lane_prefill, watched_abort
    for name, step in decode_steps.items():
        setattr(decode_runner, name, failing(step))
    prompts = random_prompts((10, 40, 30), 256, seed=77)
    with pytest.raises(RuntimeError, match="a failed step"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert computing_at_abort == [True]  # the long prompt's second chunk was on the lane
    assert not lane.busy and not llm.engine.scheduler.has_work()
    lane_runner.prefill = lane_prefill
    for name, step in decode_steps.items():
        setattr(decode_runner, name, step)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    _check_idle(llm)
    llm.close()


def test_close_releases_the_lane_and_a_second_engine_works(qwen3_dir, pd):
    before = _lane_threads()
    llm = LLM(qwen3_dir, kv_placement="auto", **POOLS["auto"], **pd)
    prompts = random_prompts((20, 33), 256, seed=78)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    lane = llm.engine.prefill
    assert _lane_threads() != before
    llm.close()
    llm.close()
    assert _lane_threads() == before
    assert lane.runner.model is None and lane.runner.device_stacked is None and lane.handoff.mirror is None
    with LLM(qwen3_dir, kv_placement="auto", **POOLS["auto"], **pd) as second:
        outputs = second.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    assert _lane_threads() == before
    dropped = LLM(qwen3_dir, kv_placement="gpu", num_gpu_blocks=8, **pd)  # never closed: its finalizer releases it
    dropped.generate(prompts, GREEDY, use_tqdm=False)
    del dropped
    gc.collect()
    assert _lane_threads() == before


def test_without_prefill_device_nothing_changes(qwen3_dir):
    before = _lane_threads()
    device = "cuda:0" if TEST_DEVICE == "cuda" else "cpu"
    llm = LLM(qwen3_dir, device=device, kv_placement="gpu", num_gpu_blocks=32, max_num_batched_tokens=20)
    prompts = random_prompts((5, 33), 256, seed=79)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.prefill is None and _lane_threads() == before
    assert [o.token_ids for o in outputs] == hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    llm.close()
