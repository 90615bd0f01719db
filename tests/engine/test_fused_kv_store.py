"""The decode step's device-tier K/V store inside the k rotation's kernel (layers/fused.py "kv_store", on by
default since it was measured on the device): greedy output as transformers', and one store launch fewer per
layer and decode step.

On CUDA the switch is simply flipped (fused.DISABLED); on the CPU the two kernels it needs run through Triton's
interpreter (the layers use the fused kernels only on CUDA tensors otherwise)."""
import os

import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.layers import fused, rotary
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(TEST_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on the CPU needs the interpreter (TRITON_INTERPRET=1)")


def _store_calls(llm) -> list:
    """Counts the attention layers' own K/V stores (the backend's store_kvcache) from now on."""
    calls, backend = [], llm.engine.runner.backend
    store = backend.store_kvcache

    def counted(key, *args):
        calls.append(key.shape[0])
        return store(key, *args)

    backend.store_kvcache = counted  # (a namespace every attention layer shares)
    return calls


# "auto" runs the host lane's layers on a thread of its own, and Triton's interpreter cannot run two kernels at
# once (it patches triton.language while one runs): on the CPU only the one-lane placement is checked.
PLACEMENTS = ["gpu", "auto"] if TEST_DEVICE == "cuda" else ["gpu"]


@pytest.mark.parametrize("kv_placement", PLACEMENTS)
def test_storing_kv_in_the_rotation_keeps_greedy_output_and_drops_the_layer_store(qwen3_dir, monkeypatch,
                                                                                  kv_placement):
    if TEST_DEVICE == "cpu":  # the rotation's kernel on CPU tensors; every other layer stays unfused
        on = lambda x, kernel: kernel == "norm_rope" or (kernel == "kv_store" and kernel not in fused.DISABLED)
        monkeypatch.setattr(fused, "use_fused", on)
        monkeypatch.setattr(rotary, "use_fused", on)
    prompts = random_prompts((16, 17, 30), 256, seed=71)  # a block boundary, the next block, a longer one
    # auto: a device pool of 6 blocks holds two of these, so host rows decode beside device rows.
    pools = {"num_gpu_blocks": 6, "num_cpu_blocks": 16, "cpu_block_size": 16} if kv_placement == "auto" else {}
    counts = {}
    for stored_ahead in (False, True):
        monkeypatch.setattr(fused, "DISABLED", set() if stored_ahead else {"kv_store"})
        llm = LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="triton", kv_placement=kv_placement,
                  enforce_eager=True, **pools)
        calls = _store_calls(llm)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 5)):
            assert output.token_ids == ref
        counts[stored_ahead] = len(calls)
        llm.close()
    layers = 2  # PARITY_SHAPE's
    assert counts[True] < counts[False] and (counts[False] - counts[True]) % layers == 0, counts
