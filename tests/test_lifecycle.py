"""What an engine starts it releases: on close(), on leaving `with`, and when it is garbage collected unclosed."""
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.engine.runner import model_runner
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6)
OUR_THREADS = ("host-lane", "cpu-attention", "pin-host")


def _our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(OUR_THREADS)]


def _two_tier_engine(model_dir: str, **kwargs) -> LLM:
    # Budgets of 45 tokens take 3 device blocks: the 6-block device pool takes two prompts, the host the rest.
    return LLM(model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
               cpu_block_size=16, **kwargs)


def _check_generates(llm: LLM, model_dir: str, seed: int) -> None:
    prompts = random_prompts((39, 40, 38, 20), 256, seed=seed)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_close_releases_threads_is_idempotent_and_refuses_later_use(qwen3_dir):
    before = _our_threads()
    llm = _two_tier_engine(qwen3_dir)
    _check_generates(llm, qwen3_dir, seed=70)
    assert _our_threads() != before  # the host lane and the executor were running
    llm.close()
    llm.close()
    assert _our_threads() == before
    assert llm.engine.runner.host_pool is None and llm.engine.runner.model is None
    with pytest.raises(ValueError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_with_block_closes_the_engine(qwen3_dir):
    before = _our_threads()
    with _two_tier_engine(qwen3_dir) as llm:
        _check_generates(llm, qwen3_dir, seed=71)
    assert _our_threads() == before
    with pytest.raises(ValueError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_engines_dropped_unclosed_one_after_another(qwen3_dir):
    """Each engine is dropped without close(); its finalizer must release it (on CUDA: unpin its host pool
    before the memory goes), so that the next one, in the same process, starts and generates exactly."""
    before = _our_threads()
    for round_ in range(6):
        llm = _two_tier_engine(qwen3_dir)
        _check_generates(llm, qwen3_dir, seed=72 + round_)
        engine = weakref.ref(llm.engine)
        del llm
        gc.collect()
        assert engine() is None, "a dropped LLM must be collected, engine and all"
        assert _our_threads() == before
    with _two_tier_engine(qwen3_dir) as llm:  # and a properly closed one after all of them
        _check_generates(llm, qwen3_dir, seed=79)


def test_an_engine_that_fails_to_start_releases_what_it_made(qwen3_dir, monkeypatch):
    before = _our_threads()

    def no_weights(*args, **kwargs):
        raise ValueError("injected: the checkpoint lacks a weight")

    monkeypatch.setattr(model_runner, "build_model", no_weights)  # after the host tier has started
    with pytest.raises(ValueError, match="injected"):
        _two_tier_engine(qwen3_dir)
    gc.collect()
    assert _our_threads() == before
    monkeypatch.undo()
    with _two_tier_engine(qwen3_dir) as llm:
        _check_generates(llm, qwen3_dir, seed=80)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="device memory is only measured on CUDA")
def test_engines_made_one_after_another_give_device_memory_back(qwen3_dir):
    """The first engine in a process leaves what torch keeps for the whole process (cuBLAS workspaces of the
    engine's streams, engine/runner/cuda_streams.py); every later one gives back all it took."""
    with _two_tier_engine(qwen3_dir) as llm:
        _check_generates(llm, qwen3_dir, seed=81)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    for seed in (82, 83):
        llm = _two_tier_engine(qwen3_dir)
        _check_generates(llm, qwen3_dir, seed=seed)
        assert torch.cuda.memory_reserved() > baseline
        llm.close()
        assert torch.cuda.memory_reserved() <= baseline



def test_the_start_up_heap_is_frozen_while_the_engine_is_open_and_collectable_after(qwen3_dir):
    """A full collection over start-up's heap held the engine's thread ~0.3 s mid-run (engine/gc_heap.py): that heap
    is frozen while the engine is open, while what the steps leave behind is still collected; after close() the
    engine's own cycles are collectable again, so nothing it held outlives it."""
    from offload_engine.engine import gc_heap

    opened_before = gc_heap._open
    llm = _two_tier_engine(qwen3_dir)
    assert gc.get_freeze_count() > 0 and gc_heap._open == opened_before + 1

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after start-up is not frozen: the collector still frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
    _check_generates(llm, qwen3_dir, seed=73)
    engine = weakref.ref(llm.engine)
    llm.close()
    del llm
    assert gc_heap._open == opened_before
    if opened_before == 0:
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert engine() is None  # the engine, frozen with the start-up heap, is collected once unfrozen


LEFT_OPEN_THEN_NEXT_ENGINE = """
import gc
import sys
from offload_engine import LLM
make = lambda: LLM(sys.argv[1], device=sys.argv[2], kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=16,
                   cpu_block_size=16)

class Holder:
    pass

llm = make()
left_open = Holder()  # a cycle made after start-up (so not frozen with its heap): only a collection frees it
left_open.self, left_open.llm = left_open, llm
del llm
gc.disable()  # as for old garbage, left to a full collection: no automatic one frees it first
del left_open
make().close()  # its start-up collects the cycle: the first engine's finalizer closes it there
print("started")
"""


def test_an_engine_left_open_and_collected_while_the_next_one_starts_does_not_hang_it(qwen3_dir):
    """An engine dropped unclosed inside garbage (as a failed call's traceback holds it) is closed by its finalizer
    when a collection frees it; start-up's own collection (engine/gc_heap.py) did so while holding the heap lock that
    close() takes, and the process hung (found when a test's fixture failed and the next test started an engine).
    In a subprocess, so that a hang fails this test instead of the suite."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN_THEN_NEXT_ENGINE, qwen3_dir, TEST_DEVICE], env=env,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip().endswith("started"), done.stderr[-2000:]
