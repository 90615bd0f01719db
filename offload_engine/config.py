"""Engine settings and the model's shape, both checked before any work starts."""
import json
import os
from dataclasses import dataclass

import torch

KV_PLACEMENTS = ("gpu", "cpu", "auto")
ATTENTION_BACKENDS = ("auto", "flash-attn", "triton", "torch")
# Host blocks of 64 tokens: at D=128 bf16 one (block, head) run is 16 KiB, long enough for a host thread to
# stream at full speed, short enough to keep prefix-cache granularity useful (see bench_cpu_attention.py).
DEFAULT_CPU_BLOCK_SIZE = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONFIG_DTYPES = {**DTYPES, "float": torch.float32, "bf16": torch.bfloat16, "half": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face config.json that the decoder models need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise OSError(f"{model_dir!r} has no config.json: point `model` at a Hugging Face model directory")
        with open(path) as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        from offload_engine.models.registry import resolve_architecture

        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported: set use_sliding_window to false")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            architecture=resolve_architecture(raw),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_rope_parameters(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            dtype=_CONFIG_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
            eos_token_ids=eos,
        )

    def check_tensor_parallel(self, ranks: int) -> None:
        """Every rank must hold whole heads and an equal share of the MLP."""
        for name, count in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("intermediate_size", self.intermediate_size)):
            if count % ranks:
                raise ValueError(f"tensor_parallel_size={ranks} does not divide the model's {name}={count}: "
                                 f"use a tensor_parallel_size that divides it")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _rope_parameters(raw: dict) -> dict:
    """transformers 5 writes `rope_parameters`; older configs (and real checkpoints) write rope_theta + rope_scaling."""
    rope = dict(raw.get("rope_parameters") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    for key, value in (raw.get("rope_scaling") or {}).items():
        rope.setdefault(key, value)
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


@dataclass
class EngineConfig:
    """What `LLM(...)` takes besides the model directory (see there); `validate` raises ValueError on bad values."""

    device: str | None = None
    dtype: str = "auto"
    kv_placement: str = "auto"
    kv_promotion: bool = True
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    cpu_kv_cache_gb: float | None = None
    block_size: int = 16
    cpu_block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    prefill_segment_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    prefill_graph_tokens: int = 8192
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    prefill_device: str | None = None
    stream_host_kv: bool = True
    stream_staging_gb: float = 1.0

    def validate(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check_device("device", self.device)
        if self.torch_device.type == "cuda":
            # Named by index from here on: a bare "cuda" would follow whichever device is current.
            self.device = f"cuda:{_index(self.torch_device)}"
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        if self.prefill_device is not None:
            _check_device("prefill_device", self.prefill_device)
            if torch.device(self.prefill_device).type == "cuda":
                self.prefill_device = f"cuda:{_index(torch.device(self.prefill_device))}"
            self._check_prefill_device()
        self._check_ranks()
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_placement not in KV_PLACEMENTS:
            raise ValueError(f"kv_placement must be one of {KV_PLACEMENTS}, got {self.kv_placement!r}")
        for name in ("kv_promotion", "async_scheduling", "enforce_eager", "enable_prefix_caching", "stream_host_kv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cpu_block_size is None:
            self.cpu_block_size = DEFAULT_CPU_BLOCK_SIZE
        for name in ("block_size", "cpu_block_size"):
            value = getattr(self, name)
            if value is not None and not _is_power_of_two(value):
                raise ValueError(f"{name} must be a positive power of two (16, 32, 64, ...), got {value!r}")
        for name in ("num_gpu_blocks", "num_cpu_blocks", "max_model_len", "prefill_segment_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.cpu_kv_cache_gb is not None and not self.cpu_kv_cache_gb > 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not _is_int(self.prefill_graph_tokens) or self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be an int >= 0 (0: eager prefill), got "
                             f"{self.prefill_graph_tokens!r}")
        if isinstance(self.stream_staging_gb, bool) or not isinstance(self.stream_staging_gb, (int, float)) \
                or not self.stream_staging_gb >= 0:
            raise ValueError(f"stream_staging_gb must be a number >= 0 (0: no streaming), got {self.stream_staging_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def _check_prefill_device(self) -> None:
        if self.tensor_parallel_size > 1:
            raise ValueError("prefill_device cannot be combined with tensor_parallel_size > 1: use one or the other")
        prefill, decode = torch.device(self.prefill_device), self.torch_device
        if prefill.type != decode.type:
            raise ValueError(f"prefill_device={self.prefill_device!r} and device={self.device!r} must both be GPUs "
                             "(or both 'cpu', for testing)")
        if prefill.type == "cuda" and _index(prefill) == _index(decode):
            raise ValueError(f"prefill_device={self.prefill_device!r} is the decode device too: name another GPU, "
                             "e.g. device='cuda:1', prefill_device='cuda:0', or leave prefill_device=None")

    def _check_ranks(self) -> None:
        device, ranks = self.torch_device, self.tensor_parallel_size
        if device.type == "cuda" and _index(device) + ranks > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={ranks} from {self.device!r} needs GPUs {_index(device)}.."
                             f"{_index(device) + ranks - 1}, but torch sees {torch.cuda.device_count()}: "
                             "lower tensor_parallel_size")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def _check_device(name: str, value) -> None:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must name a device such as 'cuda', 'cuda:1' or 'cpu', got {value!r}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be 'cuda', 'cuda:<index>' or 'cpu', got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r} was asked for but torch sees no CUDA GPU: use 'cpu'")
    if device.type == "cuda" and _index(device) >= torch.cuda.device_count():
        raise ValueError(f"{name}={value!r}, but torch sees {torch.cuda.device_count()} GPU(s): "
                         f"use an index below {torch.cuda.device_count()}")


def _index(device: torch.device) -> int:
    return device.index or 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_power_of_two(value) -> bool:
    return _is_int(value) and value > 0 and value & (value - 1) == 0
