"""Every bad input raises a clear ValueError/OSError before any work, and the engine stays usable."""
import os
import shutil

import pytest
import torch

from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

GOOD = random_prompts((9,), 256, seed=20)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", max_model_len=64, num_gpu_blocks=64)
    yield llm
    llm.close()


@pytest.mark.parametrize("prompts, match", [
    ([[]], "empty"),
    ([[1] * 64], "max_model_len"),
    ([[1] * 80], "max_model_len"),
    ([[1, 256]], "outside"),
    ([[1, -1]], "outside"),
    ([[1, 2.5]], "outside"),
    ([1, 2, 3], "token-id lists"),
    (["text"], "tokenizer"),
])
def test_bad_prompt_rejects_whole_batch_and_engine_stays_usable(llm, qwen3_dir, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(GOOD + prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_work()  # nothing half-run, nothing left queued
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].token_ids == hf_greedy(qwen3_dir, GOOD, 4)[0]


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
    dict(top_k=1.5), dict(max_tokens=0), dict(max_tokens=2.0), dict(stop_token_ids=[-3]), dict(seed="x"),
])
def test_bad_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(GOOD * 2, [SamplingParams()] * 3, use_tqdm=False)


def test_request_larger_than_any_allowed_pool(llm):
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        LLM(llm.model_dir, device=TEST_DEVICE, kv_placement="gpu", num_gpu_blocks=2).generate(
            [[1] * 20], SamplingParams(max_tokens=30), use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_placement="disk"), "kv_placement"),
    (dict(block_size=24), "power of two"),
    (dict(block_size=0), "power of two"),
    (dict(cpu_block_size=3), "power of two"),
    (dict(dtype="int8"), "dtype"),
    (dict(attention_backend="cuda-magic"), "attention_backend"),
    (dict(max_model_len=10**6), "max_position_embeddings"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    # 4 heads, 2 KV heads; on a CUDA host with fewer than 3 GPUs the GPU count is checked first
    (dict(tensor_parallel_size=3), "divide|torch sees"),
    (dict(device="tpu"), "device"),
    (dict(prefill_device="mps"), "prefill_device"),
    (dict(tensor_parallel_size=2, prefill_device="cpu"), "one or the other"),
    (dict(prefill_graph_tokens=-1), "prefill_graph_tokens"),
    (dict(prefill_graph_tokens=1.5), "prefill_graph_tokens"),
])
def test_bad_engine_arguments(qwen3_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_dir, **{"device": TEST_DEVICE, **kwargs})


def test_missing_model_directory(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), device=TEST_DEVICE)


def test_unsupported_architecture_names_the_supported_ones(qwen3_dir, tmp_path):
    model_dir = tmp_path / "gpt2"
    shutil.copytree(qwen3_dir, model_dir)
    config = (model_dir / "config.json").read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel")
    (model_dir / "config.json").write_text(config.replace('"qwen3"', '"gpt2"'))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(model_dir), device=TEST_DEVICE)


def test_loader_refuses_pickled_weights(qwen3_dir, tmp_path):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    shutil.copy(os.path.join(qwen3_dir, "config.json"), model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(OSError, match="safetensors"):
        LLM(str(model_dir), device=TEST_DEVICE)


def test_host_pool_larger_than_the_host_can_spare(qwen3_dir):
    with pytest.raises(ValueError, match="can spare"):
        LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="cpu", cpu_kv_cache_gb=10**6)


def test_forcing_an_unavailable_backend_is_a_clear_error(qwen3_dir):
    with pytest.raises(ValueError, match="flash"):
        LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="flash-attn")


def test_model_keyword_as_in_vllm(qwen3_dir):
    llm = LLM(model=qwen3_dir, device=TEST_DEVICE)
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].token_ids == hf_greedy(qwen3_dir, GOOD, 3)[0]


def test_more_ranks_or_devices_than_the_host_has(qwen3_dir):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(qwen3_dir, device="cuda:1")
        return
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match="index below"):
        LLM(qwen3_dir, device=f"cuda:{count}")
    with pytest.raises(ValueError, match="lower tensor_parallel_size"):
        LLM(qwen3_dir, device="cuda", tensor_parallel_size=2 * count)
