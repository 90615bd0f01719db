"""Engine settings and the model's shape, both checked before any work starts."""
import json
import math
import numbers
import operator
import os
from dataclasses import dataclass

import torch

KV_PLACEMENTS = ("gpu", "cpu", "auto")
ATTENTION_BACKENDS = ("auto", "flash-attn", "flash_attn", "triton", "torch")
# Host blocks of 64 tokens: at D=128 bf16 one (block, head) run is 16 KiB, long enough for a host thread to
# stream at full speed, short enough to keep prefix-cache granularity useful (see bench_cpu_attention.py).
DEFAULT_CPU_BLOCK_SIZE = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONFIG_DTYPES = {**DTYPES, "float": torch.float32, "bf16": torch.bfloat16, "half": torch.float16, "fp16": torch.float16}
# EngineConfig's fields by kind, as validate() checks them: what a valid value is, in words and as a test.
_FLAGS = ("kv_promotion", "async_scheduling", "enforce_eager", "enable_prefix_caching", "stream_host_kv")
_CHOICES = {"dtype": ("auto", *DTYPES), "kv_placement": KV_PLACEMENTS, "attention_backend": ATTENTION_BACKENDS}
_COUNTS = {  # (wanted, least value, None allowed)
    "tensor_parallel_size": ("a positive int", 1, False),
    "num_gpu_blocks": ("a positive int or None", 1, True),
    "num_cpu_blocks": ("a positive int or None", 1, True),
    "max_model_len": ("a positive int or None", 1, True),
    "prefill_segment_tokens": ("a positive int or None", 1, True),
    "max_num_seqs": ("a positive int", 1, False),
    "max_num_batched_tokens": ("a positive int", 1, False),
    "prefill_graph_tokens": ("an int >= 0 (0: eager prefill)", 0, False),
    "seed": ("an int", -2**63, False),
}
_AMOUNTS = {  # (wanted, test, None allowed)
    "cpu_kv_cache_gb": ("a number > 0 or None", lambda gb: 0 < gb < math.inf, True),
    "gpu_memory_utilization": ("a number in (0, 1]", lambda share: 0 < share <= 1, False),
    "stream_staging_gb": ("a number >= 0 (0: no streaming)", lambda gb: 0 <= gb < math.inf, False),
}
# The config.json keys every supported architecture needs; the others have defaults.
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


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
        """Reads `model_dir`/config.json. A missing, unreadable or incomplete file is an OSError naming it."""
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise OSError(f"{model_dir!r} has no config.json: point `model` at a Hugging Face model directory")
        return cls.from_dict(read_json_object(path), source=path)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """`raw`: config.json's contents; `source` names the file in errors. A required key that is missing or is
        not a positive int is an OSError (the file is broken, not the caller's arguments)."""
        from offload_engine.models.registry import resolve_architecture

        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported: set use_sliding_window to false")
        required = {key: _required_count(raw, key, source) for key in REQUIRED_CONFIG_KEYS}
        heads = required["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            architecture=resolve_architecture(raw),
            vocab_size=required["vocab_size"],
            hidden_size=required["hidden_size"],
            intermediate_size=required["intermediate_size"],
            num_layers=required["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or required["hidden_size"] // heads,
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


def read_json_object(path: str) -> dict:
    """The JSON object in the file at `path`; OSError naming the file when it is not valid JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise OSError(f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}): "
                      "re-download it or fix the file") from None
    except UnicodeDecodeError:
        raise OSError(f"{path} is not valid JSON (not UTF-8 text): re-download it or fix the file") from None
    if not isinstance(value, dict):
        raise OSError(f"{path} holds a JSON {type(value).__name__}, not an object: re-download it or fix the file")
    return value


def _required_count(raw: dict, key: str, source: str) -> int:
    if key not in raw:
        raise OSError(f"{source} lacks the required key {key!r}: re-download the model's config.json")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OSError(f"{source} has {key}={value!r}, not a positive int: re-download the model's config.json")
    return value


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
        """Raises ValueError naming the first field of the wrong type or out of range, and what to pass instead;
        fills in what depends on the host (device, cpu_block_size). Bools are not numbers here; integral values
        (numpy's too) are stored as int, real ones as float, so later arithmetic and comparisons cannot fail."""
        for name in _FLAGS:
            _check_flag(name, getattr(self, name))
        for name, choices in _CHOICES.items():
            _check_choice(name, getattr(self, name), choices)
        for name, (wanted, least, optional) in _COUNTS.items():
            setattr(self, name, _count(name, getattr(self, name), wanted, least, optional))
        for name, (wanted, test, optional) in _AMOUNTS.items():
            setattr(self, name, _amount(name, getattr(self, name), wanted, test, optional))
        if self.cpu_block_size is None:
            self.cpu_block_size = DEFAULT_CPU_BLOCK_SIZE
        for name in ("block_size", "cpu_block_size"):
            setattr(self, name, _power_of_two(name, getattr(self, name)))
        self._check_devices()

    def _check_devices(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = _device_name("device", self.device)
        if self.prefill_device is not None:
            self.prefill_device = _device_name("prefill_device", self.prefill_device)
            self._check_prefill_device()
        self._check_ranks()

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
        if ranks > 1:
            from offload_engine.distributed.symmetric_all_reduce import wanted

            wanted()  # a bad OFFLOAD_ENGINE_ALL_REDUCE is named here, before any rank starts

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def _device_name(name: str, value) -> str:
    """The device `value` names, as a string; a GPU is named by index ("cuda:0"), since a bare "cuda" would follow
    whichever device is current."""
    if not isinstance(value, (str, torch.device)):
        raise ValueError(f"{name} must be a string such as 'cuda', 'cuda:1' or 'cpu', got {_shown(value)}")
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
    return f"cuda:{_index(device)}" if device.type == "cuda" else str(device)


def _index(device: torch.device) -> int:
    return device.index or 0


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {_shown(value)}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {_shown(value)}")


def _count(name: str, value, wanted: str, least: int, optional: bool) -> int | None:
    """`value` as an int >= least (None passes where optional); bools and floats, even whole ones, do not."""
    if value is None and optional:
        return None
    if _is_int(value) and value >= least:
        return operator.index(value)
    raise ValueError(f"{name} must be {wanted}, got {_shown(value)}")


def _amount(name: str, value, wanted: str, test, optional: bool) -> float | None:
    """`value` as a float that passes `test` (None passes where optional); bools and strings do not."""
    if value is None and optional:
        return None
    if not isinstance(value, bool) and isinstance(value, numbers.Real) and test(value):
        return float(value)
    raise ValueError(f"{name} must be {wanted} (an int or float), got {_shown(value)}")


def _power_of_two(name: str, value) -> int:
    if _is_int(value) and value > 0 and value & (value - 1) == 0:
        return operator.index(value)
    raise ValueError(f"{name} must be a positive power of two (16, 32, 64, ...), got {_shown(value)}")


def _is_int(value) -> bool:
    """An integral value, numpy's included; not a bool, which Python counts as an int."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value) -> str:
    """The value and its type, since a wrong type often prints like the right one ('4' and 4)."""
    return f"{value!r} (type {type(value).__name__})"
