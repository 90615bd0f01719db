"""Tiny random Hugging Face models, built with transformers: the embedded default and the tests' oracle. Nothing is
downloaded: seeded random weights and a byte-level BPE trained on a few sentences, loading like a real checkpoint.
"""
import os

TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
_CORPUS = [
    "offload-engine keeps the KV cache of long sequences in pinned host memory and attends on the CPU.",
    "Sequences whose KV lives on the GPU attend there; the partial outputs are merged back on the GPU.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" @ # $ % ^ & _ ~",
]
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "offload_engine")


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_tiny_model(path: str, architecture: str = "qwen3", seed: int = 0, with_tokenizer: bool = True,
                     dtype: str = "float32", **shape) -> str:
    """Saves a random model of `architecture` ("qwen3", "llama" or "qwen2") to `path` and returns `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config}[architecture]
    tokenizer = build_tokenizer(shape.pop("vocab_size", 512)) if with_tokenizer else None
    vocab = len(tokenizer) if tokenizer else shape.pop("vocab_size", 512)
    eos = tokenizer.eos_token_id if tokenizer else vocab - 1
    tied = shape.pop("tie_word_embeddings", False)
    config = config_class(**{**TINY_SHAPE, **shape}, vocab_size=vocab, eos_token_id=eos, bos_token_id=None,
                          tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        tokenizer.save_pretrained(path)
    return path


def default_model_dir() -> str:
    """The embedded default: a tiny random Qwen3, built once and cached under ~/.cache/offload_engine."""
    path = os.path.join(DEFAULT_CACHE, "tiny-qwen3")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_model(path + ".partial", "qwen3")
        os.replace(path + ".partial", path)
    return path
