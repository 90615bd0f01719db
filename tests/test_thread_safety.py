"""LLM.generate from several threads at once: each caller gets exactly what it gets alone, in both KV tiers."""
import threading

import pytest

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import random_prompts


def _requests(count: int):
    """Per caller: its prompts and params (greedy, and sampling with a seed), different from every other caller's."""
    jobs = []
    for caller in range(count):
        prompts = random_prompts((30 + caller, 41, 17 + 2 * caller), 256, seed=100 + caller)
        params = [SamplingParams(temperature=0, max_tokens=7),
                  SamplingParams(temperature=0.8, top_k=20, max_tokens=9, seed=caller),
                  SamplingParams(temperature=0, max_tokens=5 + caller % 3)]
        jobs.append((prompts, params))
    return jobs


@pytest.mark.parametrize("threads", (2, 8))
def test_concurrent_callers_each_get_their_single_threaded_results(qwen3_dir, threads):
    # A device pool of 6 blocks and a host pool: requests of both tiers in every caller's batch.
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=6, num_cpu_blocks=32,
              cpu_block_size=16)
    jobs = _requests(threads)
    alone = [[o.token_ids for o in llm.generate(p, s, use_tqdm=False)] for p, s in jobs]
    together: list = [None] * threads
    errors: list = []
    start = threading.Barrier(threads)

    def call(i: int) -> None:
        try:
            start.wait()
            together[i] = [o.token_ids for o in llm.generate(*jobs[i], use_tqdm=False)]
        except BaseException as error:  # reported below, with the caller
            errors.append((i, error))

    workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not errors, errors
    assert together == alone
    llm.close()
