"""A fault inside generate() comes out of it with its cause; no thread is left busy; the engine stays usable.

Faults are injected where they would really arise: a host kernel raising on the host-lane thread, a host
write raising on the executor during prefill, a promotion's copy raising (on the executor where it gathers host
blocks, on the engine's thread where the device reads them), and a KeyboardInterrupt landing on the engine's
thread in the middle of a step's bookkeeping while a host step is in flight.
"""
import threading
import time

import pytest

import cpu_attention
from cpu_attention import layer_loop
from offload_engine import LLM, SamplingParams
from offload_engine.engine.sequence import BlockLocation
from offload_engine.engine.tiers import kv_promotion
from offload_engine.layers import attention
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

PROMPTS = random_prompts((40, 41, 39, 42, 17), 256, seed=90)
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _engine(model_dir: str) -> LLM:
    # The first two prompts fill the 6-block device pool; the rest decode in the host lane.
    return LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", kv_promotion=False, num_gpu_blocks=6,
               num_cpu_blocks=24, cpu_block_size=16)


def _fails_on_call(function, number: int, error: BaseException, delay: float = 0.0):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if delay:
            time.sleep(delay)
        if len(calls) == number:
            raise error
        return function(*args, **kwargs)

    return wrapper


def _assert_idle_and_usable(llm: LLM, model_dir: str) -> None:
    engine = llm.engine
    assert engine.in_flight is None and not engine.has_work()
    for tier in BlockLocation:
        pool = engine.blocks.pool(tier)
        assert pool.num_free == pool.num_blocks
    done = threading.Event()
    engine.runner.executor.submit(done.set)
    assert done.wait(timeout=5), "the host executor is stuck"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, PROMPTS, GREEDY.max_tokens)


def test_host_kernel_error_comes_out_of_generate(qwen3_dir, monkeypatch):
    llm = _engine(qwen3_dir)
    kernel, loop = cpu_attention.paged_decode_attention, layer_loop.decode_layers
    # The kernel per layer on CPU; on CUDA the host lane's whole steps call decode_layers once a step.
    monkeypatch.setattr(cpu_attention, "paged_decode_attention",
                        _fails_on_call(kernel, 7, RuntimeError("injected host kernel fault")))
    monkeypatch.setattr(layer_loop, "decode_layers", _fails_on_call(loop, 2, RuntimeError("injected host kernel fault")))
    with pytest.raises(RuntimeError, match="injected host kernel fault"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", kernel)
    monkeypatch.setattr(layer_loop, "decode_layers", loop)
    _assert_idle_and_usable(llm, qwen3_dir)
    llm.close()


@pytest.mark.parametrize("path", ["executor", "direct"])
def test_host_write_error_during_prefill_comes_out_of_generate(qwen3_dir, monkeypatch, path):
    """Host-tier prefill K/V reach the host pool two ways (layers/host_block_writes.py): whole blocks written by
    the device (or, on the CPU, by the engine's thread), the rest by the executor. A fault in either comes out."""
    llm = _engine(qwen3_dir)
    runner = llm.engine.runner
    if path == "executor":  # every host-tier token the executor's way
        monkeypatch.setattr(runner.inputs, "direct_host_writes", False)
        owner, name = cpu_attention, "store_kvcache"
    else:
        assert runner.inputs.direct_host_writes
        owner, name = attention, "write_host_blocks"
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, _fails_on_call(original, 1, ValueError("injected store fault")))
    with pytest.raises(ValueError, match="injected store fault"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(owner, name, original)
    monkeypatch.setattr(runner.inputs, "direct_host_writes", True)
    _assert_idle_and_usable(llm, qwen3_dir)
    llm.close()


def test_promotion_copy_error_comes_out_of_generate(qwen3_dir, monkeypatch):
    """The two short rows end first; the host rows are promoted into the room they leave, and the first copy fails."""
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=24,
              cpu_block_size=16)
    fault = RuntimeError("injected promotion copy fault")
    originals = {name: getattr(kv_promotion, name) for name in ("gather_blocks", "gather_host_blocks")}
    for name, original in originals.items():
        monkeypatch.setattr(kv_promotion, name, _fails_on_call(original, 1, fault))
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 2, 12, 12, 12)]
    with pytest.raises(RuntimeError, match="injected promotion copy fault"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    for name, original in originals.items():
        monkeypatch.setattr(kv_promotion, name, original)
    _assert_idle_and_usable(llm, qwen3_dir)
    llm.close()


@pytest.mark.parametrize("interrupt_at", [3, 11, 20])
def test_keyboard_interrupt_mid_step_leaves_the_engine_usable(qwen3_dir, monkeypatch, interrupt_at):
    llm = _engine(qwen3_dir)
    # A slow host kernel keeps a host step in flight while the engine's thread is interrupted.
    kernel = cpu_attention.paged_decode_attention
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", _fails_on_call(kernel, -1, None, delay=0.005))
    blocks = llm.engine.blocks
    register = blocks.register_computed_blocks  # runs inside postprocess, between a sequence's updates
    blocks.register_computed_blocks = _fails_on_call(register, interrupt_at, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", kernel)
    # abort() replaced the block manager's pools, not the object: restore the method on the instance.
    del blocks.register_computed_blocks
    _assert_idle_and_usable(llm, qwen3_dir)
    llm.close()


def test_a_failed_write_left_behind_by_another_fault_does_not_haunt_the_next_call(qwen3_dir, monkeypatch):
    """A host write fails on the executor, but a KeyboardInterrupt stops generate() before that failure was
    looked at. The interrupt is what comes out; the next generate() must not re-raise the old write error."""
    llm = _engine(qwen3_dir)
    store = cpu_attention.store_kvcache
    monkeypatch.setattr(cpu_attention, "store_kvcache", _fails_on_call(store, 1, ValueError("stale store fault")))
    scheduler = llm.engine.scheduler
    postprocess = scheduler.postprocess
    scheduler.postprocess = _fails_on_call(postprocess, 1, KeyboardInterrupt())  # right after the first prefill
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(cpu_attention, "store_kvcache", store)
    del scheduler.postprocess
    _assert_idle_and_usable(llm, qwen3_dir)
    llm.close()
