"""Shared test setup.

OFFLOAD_ENGINE_TEST_DEVICE picks where the suite runs: "cpu" (the default, what CI runs) or "cuda"
(`make test-gpu`). Tests import it as `from tests.conftest import TEST_DEVICE`: engines are made on it,
and the Triton kernels get their inputs on it (fresh random data is still made on the CPU, and results come
back to the CPU for the float64 references). The host KV tier and its numba kernels run on the CPU either way.

On the CPU the Triton kernels run through Triton's interpreter. Triton reads TRITON_INTERPRET when a kernel
is decorated, so it has to be set before anything imports `gpu_kernels`; on CUDA they must run natively.
"""
import gc
import os
import weakref

import torch

TEST_DEVICE = os.environ.get("OFFLOAD_ENGINE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"OFFLOAD_ENGINE_TEST_DEVICE must be 'cpu' or 'cuda', got {TEST_DEVICE!r}")
if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("OFFLOAD_ENGINE_TEST_DEVICE=cuda but torch sees no CUDA GPU "
                       f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}): run `make test` instead")
if TEST_DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise RuntimeError("OFFLOAD_ENGINE_TEST_DEVICE=cuda runs the Triton kernels natively: unset TRITON_INTERPRET")
if TEST_DEVICE == "cpu":  # also on a GPU host: `make test` there runs what CI runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from offload_engine import LLM  # noqa: E402
from offload_engine.tiny_model import build_tiny_model  # noqa: E402

requires_cuda = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA only: OFFLOAD_ENGINE_TEST_DEVICE=cuda")

# Small enough that transformers' generate and our engine both run in well under a second per prompt.
PARITY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def pytest_configure(config):
    config.addinivalue_line("markers", "real_cost_check: run the engine with its measured cost check, not pinned")


def pytest_report_header(config):
    if TEST_DEVICE != "cuda":
        return f"offload-engine test device: cpu (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"
    import triton

    props = torch.cuda.get_device_properties(0)
    return (f"offload-engine test device: cuda, {props.name} ({props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs), torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"triton {triton.__version__}, {os.cpu_count()} CPU cores")


@pytest.fixture(autouse=True)
def _close_engines(monkeypatch):
    """Every engine a test made that is still alive when the test ends (a failed test's traceback holds its
    engine, say) is closed then, so the next test starts with its threads gone, its host pool unpinned and, on
    CUDA, its device memory free for the next engine's pool sizing. Weak references: a dropped engine must
    still be collectable (tests/test_lifecycle.py). Module-scoped engines are made before this and live on."""
    made = []
    init = LLM.__init__

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(LLM, "__init__", tracked_init)
    yield
    for ref in made:
        if ref() is not None:
            ref().close()
    if TEST_DEVICE == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _host_lane_always_pays(request, monkeypatch):
    """The engine's cost checks (placement.host_lane_pays, host_step_pays) decide from step times it measures, so
    on a busy CI machine whether a test's sequences reach the host tier would depend on timing. Engine tests pin it to
    "pays" to exercise the paths they are about; tests marked `real_cost_check`, and tests/engine/
    test_lane_costs.py (which calls the function itself), check the rule."""
    if "real_cost_check" not in request.keywords:
        from offload_engine.engine.sched import placement

        monkeypatch.setattr(placement, "host_lane_pays", lambda *args, **kwargs: True)
        monkeypatch.setattr(placement, "host_step_pays", lambda host_rows, *args: bool(host_rows))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random Qwen3, Llama (with Llama-3 rope scaling) and Qwen2 directories, saved by transformers."""
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen3": build_tiny_model(str(root / "qwen3"), "qwen3", seed=1, with_tokenizer=False, **PARITY_SHAPE),
        "llama": build_tiny_model(str(root / "llama"), "llama", seed=2, with_tokenizer=False,
                                  rope_parameters=LLAMA3_ROPE, **PARITY_SHAPE),
        "qwen2": build_tiny_model(str(root / "qwen2"), "qwen2", seed=3, with_tokenizer=False, **PARITY_SHAPE),
    }


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A tiny Qwen3 with a tokenizer, for string prompts."""
    return build_tiny_model(str(tmp_path_factory.mktemp("text") / "qwen3"), "qwen3", seed=4, with_tokenizer=True,
                            **{k: v for k, v in PARITY_SHAPE.items() if k != "vocab_size"})


def with_tokenizer_config(model_dir: str, into, **changes) -> str:
    """A copy of model_dir at `into` whose tokenizer_config.json has `changes` set."""
    import json
    import shutil

    shutil.copytree(model_dir, into)
    config_path = into / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    return str(into)
