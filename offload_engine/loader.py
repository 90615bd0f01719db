"""Builds a model from a Hugging Face directory, from safetensors only (never unpickled). Under tensor parallelism
each rank reads only its own slice of each tensor (safetensors' get_slice)."""
import glob
import json
import os

import torch
from safetensors import safe_open

from offload_engine.config import ModelConfig
from offload_engine.distributed.parallel_state import Partition
from offload_engine.models.registry import model_class

_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def weight_files(model_dir: str) -> list[str]:
    """The directory's safetensors files (a single file, a sharded index, or every *.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = [p for pattern in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pattern))]
    if pickles:
        raise OSError(
            f"{model_dir!r} holds only pickled weights ({os.path.basename(pickles[0])}); offload-engine loads "
            "safetensors only, because unpickling a checkpoint can run arbitrary code. Convert it once with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise OSError(f"{model_dir!r} has no *.safetensors weights")


def build_model(cfg: ModelConfig, model_dir: str, dtype: torch.dtype, device: torch.device, max_position: int,
                tp: Partition = Partition()):
    """cfg: the whole model's shape; tp: the slice of it this process holds and loads."""
    files = weight_files(model_dir)  # fail on missing or pickled weights before allocating anything
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, max_position, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, files)
    return model.eval()


def load_weights(model: torch.nn.Module, files: list[str]) -> None:
    params = dict(model.named_parameters())  # a tied lm_head shares embed_tokens' entry
    missing = set(params)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None or target[0] not in params:
                    continue
                param_name, shard = target
                module = model.get_submodule(param_name.rsplit(".", 1)[0])
                try:
                    if hasattr(module, "load_weight"):  # it takes its rank's rows or columns (or fused part)
                        module.load_weight(params[param_name], _LazySlice(f.get_slice(name)), shard)
                    else:  # replicated (norms): whole on every rank
                        _copy_whole(params[param_name], f.get_tensor(name))
                except ValueError as error:
                    raise ValueError(f"weight {name!r} {error}: is config.json from this checkpoint?") from None
                missing.discard(param_name)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs, e.g. {sorted(missing)[:3]}")


def _copy_whole(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}")
    param.data.copy_(tensor)


class _LazySlice:
    """A checkpoint tensor not read yet: `.shape`, and `.narrow(dim, start, length)` reads only that part."""

    def __init__(self, safe_slice):
        self.slice = safe_slice
        self.shape = tuple(safe_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.slice[index]


def _target(model, checkpoint_name: str):
    """Maps a checkpoint tensor name to (our parameter name, fused shard or None)."""
    for source, (fused, shard) in model.packed_modules.items():
        if f".{source}." in checkpoint_name:
            return checkpoint_name.replace(f".{source}.", f".{fused}."), shard
    return checkpoint_name, None
