"""Every bad input raises a clear ValueError/OSError before any work, and the engine stays usable."""
import dataclasses
import json
import math
import os
import shutil
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from offload_engine import LLM, SamplingParams
from offload_engine.config import EngineConfig
from offload_engine.demo import run_demo
from offload_engine.layers.attention_backends import flash_attn_version
from offload_engine.tokenizer import load_tokenizer
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
    ([[1, True]], "outside"),
    ([[1, np.int64(256)]], "outside"),
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
    with pytest.raises(ValueError, match="num_gpu_blocks.*use kv_placement='auto'"):
        LLM(llm.model_dir, device=TEST_DEVICE, kv_placement="gpu", num_gpu_blocks=2).generate(
            [[1] * 20], SamplingParams(max_tokens=30), use_tqdm=False)
    # Under 'auto' already, the advice is the pools and max_tokens only.
    with pytest.raises(ValueError, match="num_gpu_blocks") as raised:
        LLM(llm.model_dir, device=TEST_DEVICE, kv_placement="auto", num_gpu_blocks=2, num_cpu_blocks=2,
            cpu_block_size=16).generate([[1] * 20], SamplingParams(max_tokens=60), use_tqdm=False)
    assert "use kv_placement" not in str(raised.value)


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


@pytest.mark.skipif(flash_attn_version(torch.device(TEST_DEVICE)) is not None, reason="flash-attn runs here")
def test_forcing_an_unavailable_backend_is_a_clear_error(qwen3_dir):
    with pytest.raises(ValueError, match="flash"):
        LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="flash-attn")


def test_the_backend_variable_is_the_default_and_an_argument_wins(qwen3_dir, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_ATTENTION_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="OFFLOAD_ENGINE_ATTENTION_BACKEND='nonsense' names no attention backend"):
        LLM(qwen3_dir, device=TEST_DEVICE)
    with LLM(qwen3_dir, device=TEST_DEVICE, attention_backend="auto") as llm:
        assert llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].token_ids == \
            hf_greedy(qwen3_dir, GOOD, 3)[0]


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


# ---- Bad input found by users: each is a ValueError or OSError that names the argument or file and what to change,
# raised before any work starts. A row: (what is wrong, a call given a fresh copy of the tiny model's directory that
# must raise, the exception type, a substring of its message).

def _load(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_placement="gpu", num_gpu_blocks=8)


def _edit_config(model_dir: Path, edit) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return model_dir


def _without_config_key(key: str):
    return lambda model_dir: _edit_config(model_dir, lambda config: config.pop(key))


def _write(name: str, text: str):
    def write(model_dir: Path) -> Path:
        (model_dir / name).write_text(text)
        return model_dir
    return write


def _truncated_weights(model_dir: Path) -> Path:
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return model_dir


def _with_value_in(tensor_name: str, value: float):
    def corrupt(model_dir: Path) -> Path:
        path = str(model_dir / "model.safetensors")
        tensors = load_file(path)
        tensors[tensor_name].view(-1)[7] = value
        save_file(tensors, path, metadata={"format": "pt"})
        return model_dir
    return corrupt


def _index_naming(shard: str):
    """A model.safetensors.index.json that puts model.norm.weight in `shard`."""
    def corrupt(model_dir: Path) -> Path:
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
        weight_map["model.norm.weight"] = shard
        (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return model_dir
    return corrupt


def _wrong_type_rows() -> list:
    """For every EngineConfig field, values of a type it must refuse, by the field's annotation."""
    wrong = {int: ["4", 2.0, True], float: ["0.5", True], bool: [1, "yes"], str: [5]}
    rows = []
    for field in dataclasses.fields(EngineConfig):
        kind = next(t for t in (bool, int, float, str) if field.type is t or t in typing.get_args(field.type))
        rows += [(f"EngineConfig {field.name}={value!r}",
                  lambda model_dir, kwargs={field.name: value}: EngineConfig(**kwargs).validate(),
                  ValueError, f"{field.name} must be") for value in wrong[kind]]
    return rows


BAD_INPUT = [
    ("config.json without vocab_size", lambda d: _load(_without_config_key("vocab_size")(d)), OSError,
     "config.json lacks the required key 'vocab_size'"),
    ("config.json without num_hidden_layers", lambda d: _load(_without_config_key("num_hidden_layers")(d)), OSError,
     "config.json lacks the required key 'num_hidden_layers'"),
    ("config.json with a string hidden_size", lambda d: _load(_edit_config(d, lambda c: c.update(hidden_size="64"))),
     OSError, "config.json has hidden_size='64', not a positive int"),
    ("config.json that is not JSON", lambda d: _load(_write("config.json", '{"vocab_size": 256,')(d)), OSError,
     "config.json is not valid JSON (line 1"),
    ("config.json holding a list", lambda d: _load(_write("config.json", "[1, 2]")(d)), OSError,
     "config.json holds a JSON list"),
    ("truncated model.safetensors", lambda d: _load(_truncated_weights(d)), OSError,
     "model.safetensors is not a readable safetensors file"),
    ("garbled model.safetensors", lambda d: _load(_write("model.safetensors", "garbage" * 100)(d)), OSError,
     "corrupt or truncated, re-download it"),
    ("NaN in a sliced weight", lambda d: _load(_with_value_in("model.layers.0.mlp.down_proj.weight", math.nan)(d)),
     OSError, "tensor 'model.layers.0.mlp.down_proj.weight' in"),
    ("infinity in a whole weight", lambda d: _load(_with_value_in("model.norm.weight", math.inf)(d)), OSError,
     "model.safetensors holds NaN or infinite values"),
    ("index naming a missing shard", lambda d: _load(_index_naming("model-00002.safetensors")(d)), OSError,
     "names the shard 'model-00002.safetensors'"),
    ("index that is not JSON", lambda d: _load(_write("model.safetensors.index.json", "{")(d)), OSError,
     "model.safetensors.index.json is not valid JSON"),
    ("garbled tokenizer.json", lambda d: load_tokenizer(str(_write("tokenizer.json", "{}")(d))), OSError,
     "tokenizer.json is not a readable tokenizer.json"),
    ("LLM cpu_kv_cache_gb as a string", lambda d: LLM(str(d), device="cpu", cpu_kv_cache_gb="4"), ValueError,
     "cpu_kv_cache_gb must be a number > 0 or None (an int or float), got '4' (type str)"),
    ("LLM gpu_memory_utilization as a string", lambda d: LLM(str(d), device="cpu", gpu_memory_utilization="0.5"),
     ValueError, "gpu_memory_utilization must be a number in (0, 1] (an int or float), got '0.5'"),
    *_wrong_type_rows(),
    *[(f"SamplingParams {name}=True", lambda d, name=name: SamplingParams(**{name: True}), ValueError,
       f"{name} must be") for name in ("temperature", "top_p", "top_k", "max_tokens", "seed")],
    ("SamplingParams stop_token_ids as one int", lambda d: SamplingParams(stop_token_ids=5), ValueError,
     "pass a list"),
    ("SamplingParams stop_token_ids holding a bool", lambda d: SamplingParams(stop_token_ids=[1, True]), ValueError,
     "stop_token_ids must hold non-negative ints"),
    ("SamplingParams n=0", lambda d: SamplingParams(n=0), ValueError, "n must be an int >= 1"),
    ("SamplingParams stop holding an empty string", lambda d: SamplingParams(stop=["a", ""]), ValueError,
     "stop must be a string or a list of non-empty strings"),
    ("SamplingParams stop as a number", lambda d: SamplingParams(stop=5), ValueError, "stop must be a string"),
    ("SamplingParams stop strings without detokenizing", lambda d: SamplingParams(stop="x", detokenize=False),
     ValueError, "leave detokenize=True"),
    *[(f"SamplingParams {name}=1", lambda d, name=name: SamplingParams(**{name: 1}), ValueError,
       f"{name} must be True or False") for name in ("include_stop_str_in_output", "skip_special_tokens",
                                                      "detokenize")],
    ("stop strings on a model without a tokenizer", lambda d: LLM(str(d), device="cpu").generate(
        [[1, 2]], SamplingParams(stop="x")), ValueError, "no tokenizer to match stop strings on"),
    ("demo prompt longer than the model", lambda d: run_demo(prompt_len=5000, device="cpu", model_dir=str(d)),
     ValueError, "use --prompt-len 511 or less"),
]


@pytest.mark.parametrize("what, call, error, message", BAD_INPUT, ids=[row[0] for row in BAD_INPUT])
def test_bad_input_is_a_clear_error_before_any_work(qwen3_dir, tmp_path, what, call, error, message):
    model_dir = Path(shutil.copytree(qwen3_dir, tmp_path / "model"))
    with pytest.raises(error) as raised:
        call(model_dir)
    assert message in str(raised.value)


def test_numpy_integers_count_as_ints():
    params = SamplingParams(top_k=np.int64(5), max_tokens=np.int32(3), seed=np.int64(7),
                            stop_token_ids=np.array([1, 2]))
    assert (params.top_k, params.max_tokens, params.seed, params.stop_token_ids) == (5, 3, 7, (1, 2))
    assert all(type(v) is int for v in (params.top_k, params.max_tokens, params.seed, *params.stop_token_ids))
    config = EngineConfig(device="cpu", num_gpu_blocks=np.int64(8), cpu_kv_cache_gb=np.float32(0.5))
    config.validate()
    assert type(config.num_gpu_blocks) is int and type(config.cpu_kv_cache_gb) is float


def test_prompts_of_numpy_integers_or_tuples_read_as_lists_of_ints(llm):
    """The whole-prompt fast check (every id a Python int) and the per-token one agree on what a prompt says."""
    ids = [3, 17, 42, 5, 9]
    forms = [ids, tuple(ids), [np.int64(t) for t in ids], np.array(ids, dtype=np.int32)]
    outs = [llm.generate([form], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0] for form in forms]
    assert all(o.prompt_token_ids == ids and type(o.prompt_token_ids[1]) is int for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1
