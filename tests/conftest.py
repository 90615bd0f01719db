"""Shared test setup.

Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it has to be set before anything imports `kernels`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from offload_engine.tiny_model import build_tiny_model  # noqa: E402

# Small enough that transformers' generate and our engine both run in well under a second per prompt.
PARITY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


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
