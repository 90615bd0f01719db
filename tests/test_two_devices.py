"""Two engines on two devices in one process (docs/design.md, "More than one GPU"): each owns its model, RoPE caches,
pools and streams on the device it was given, whatever device is current, and their outputs are transformers'.

On a host with two GPUs the engines take cuda:0 and cuda:1 and the current device is set to the *other* one
while they start and step, so anything that follows the current device lands on the wrong GPU and fails. On CPU
CI (and a one-GPU host) both take TEST_DEVICE: the same paths run, and ownership (nothing shared between the two
engines, everything on the engine's device) is still checked.
"""
import contextlib

import pytest
import torch

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

TWO_GPUS = TEST_DEVICE == "cuda" and torch.cuda.device_count() >= 2
DEVICES = ("cuda:0", "cuda:1") if TWO_GPUS else (TEST_DEVICE, TEST_DEVICE)
LENGTHS = (5, 16, 17, 40)
NEW_TOKENS = 8


def _current_device_elsewhere(device: str):
    """The other GPU made current, so that code relying on the current device goes wrong visibly."""
    if not TWO_GPUS:
        return contextlib.nullcontext()
    return torch.cuda.device(1 - torch.device(device).index)


def _engine_tensors(llm: LLM):
    runner = llm.engine.runner
    yield from runner.model.parameters()
    yield from runner.model.buffers()
    yield runner.device_stacked


@pytest.mark.parametrize("placement", ["gpu", "auto"])
def test_two_engines_on_two_devices_in_one_process(tiny_models, placement):
    archs = ("qwen3", "llama")  # different models, so that a shared cache or buffer shows in the tokens
    # Explicit pools: two CUDA engines on one GPU must not each size theirs from free memory.
    pools = (dict(num_gpu_blocks=6, num_cpu_blocks=32, cpu_block_size=16) if placement == "auto"
             else dict(num_gpu_blocks=32))
    engines = []
    for arch, device in zip(archs, DEVICES):
        with _current_device_elsewhere(device):
            engines.append(LLM(tiny_models[arch], device=device, kv_placement=placement, **pools))
    for llm, device in zip(engines, DEVICES):
        expected = torch.device(device)
        for t in _engine_tensors(llm):
            assert t.device.type == expected.type and (t.device.index or 0) == (expected.index or 0)
    rope = [llm.engine.runner.model.model.layers[0].self_attn.rotary.cos for llm in engines]
    assert rope[0].data_ptr() != rope[1].data_ptr(), "the two models share a RoPE cache"

    prompts = random_prompts(LENGTHS, 256, seed=130)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for _ in range(2):  # interleaved: each engine's second call runs after the other engine has stepped
        for arch, llm, device in zip(archs, engines, DEVICES):
            with _current_device_elsewhere(device):
                outputs = llm.generate(prompts, params, use_tqdm=False)
            for output, ref, n in zip(outputs, hf_greedy(tiny_models[arch], prompts, NEW_TOKENS), LENGTHS):
                assert output.token_ids == ref, f"{arch} on {device}, prompt of {n} tokens"
    for llm in engines:
        llm.close()
