"""Builds a model from a Hugging Face directory, from safetensors only (never unpickled). Under tensor parallelism
each rank reads only its own slice of each tensor (safetensors' get_slice).

A damaged checkpoint is an OSError naming the file (and the tensor, where one is to blame) and saying to re-download
it: a file safetensors cannot parse (truncated, garbled header), a shard the index names that is not there, or a
floating tensor holding NaN or infinity, which would otherwise surface only as garbage text."""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open

from offload_engine.config import ModelConfig, read_json_object
from offload_engine.distributed.parallel_state import Partition
from offload_engine.models.registry import model_class

_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def weight_files(model_dir: str) -> list[str]:
    """The directory's safetensors files (a single file, a sharded index, or every *.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        return [_shard(model_dir, index, name) for name in _shard_names(index)]
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


def _shard_names(index: str) -> list[str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise OSError(f"{index} has no \"weight_map\" of tensor names to files: re-download it")
    return sorted(set(weight_map.values()))


def _shard(model_dir: str, index: str, name: str) -> str:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        raise OSError(f"{index} names the shard {name!r}, which is not in {model_dir!r}: download the missing shard")
    return path


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
    """Copies every checkpoint tensor the model has a parameter for into it, then checks the parameters for NaN and
    infinity where they live: one read of the weights, on a GPU milliseconds at 8B (docs/results.md)."""
    params = dict(model.named_parameters())  # a tied lm_head shares embed_tokens' entry
    sources: dict[str, list[tuple[str, str]]] = {}  # parameter -> the (checkpoint tensor, file) pairs it holds
    for path in files:
        try:
            for param_name, source in _load_file(model, params, path):
                sources.setdefault(param_name, []).append(source)
        except SafetensorError as error:
            raise OSError(f"{path} is not a readable safetensors file ({error}): it is corrupt or truncated, "
                          "re-download it") from None
    missing = set(params) - set(sources)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs, e.g. {sorted(missing)[:3]}")
    check_finite(params, sources)


def _load_file(model: torch.nn.Module, params: dict, path: str) -> list[tuple[str, tuple[str, str]]]:
    """Loads one safetensors file's tensors; returns (parameter, (tensor, file)) for each it copied (a fused
    parameter, q/k/v say, once per tensor)."""
    loaded = []
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
            loaded.append((param_name, (name, path)))
    return loaded


FINITE_CHUNK = 1 << 26  # elements a finiteness check reads at once: its bool temporary stays small


def check_finite(params: dict, sources: dict[str, list[tuple[str, str]]]) -> None:
    """OSError naming the checkpoint tensors and file behind the first parameter with NaN or infinity. One flag per
    parameter is queued on the model's device and read back once (a single sync)."""
    names = [n for n, p in params.items() if p.is_floating_point()]
    if not names:
        return
    flags = [torch.stack([chunk.isfinite().all() for chunk in params[n].detach().reshape(-1).split(FINITE_CHUNK)])
             .all() for n in names]
    bad = next((n for n, ok in zip(names, torch.stack(flags).tolist()) if not ok), None)
    if bad is not None:
        tensors = " or ".join(repr(name) for name, _ in sources[bad])
        raise OSError(f"tensor {tensors} in {sources[bad][0][1]} holds NaN or infinite values: the file is corrupt, "
                      "re-download it")


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
