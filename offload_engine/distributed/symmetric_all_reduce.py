"""All-reduce of small tensors over symmetric memory (torch.distributed._symmetric_memory), for GPUs joined by
NVLink: each rank copies its tensor into a buffer that every rank of the group can read, and one kernel sums the
peers' buffers ("one shot", with barriers before and after, so the buffer is free again when it ends). A decode
step's all-reduces are this small (rows x hidden), and each pays NCCL's fixed latency, many times a step.
Contract: the sum, in a new tensor, the same bits on every rank; only tensors of the buffer's dtype and at most
its size; the buffer is made at start-up (its rendezvous is collective and cannot be captured), one per lane's
group, and the kernel is captured into CUDA graphs like any other. Why: docs/decisions/multi-gpu.md."""
import os
import warnings

import torch

ENV = "OFFLOAD_ENGINE_ALL_REDUCE"  # "auto": small tensors over symmetric memory; "nccl": every all-reduce by NCCL
DEFAULT = "nccl"  # until a GPU run shows the one-shot pays (docs/decisions/multi-gpu.md)
ONE_SHOT_MAX_BYTES = 1 << 20  # larger tensors (prefill's) go through NCCL, whose rings use the links better


def wanted() -> bool:
    """Whether the environment lets the engine use symmetric memory (OFFLOAD_ENGINE_ALL_REDUCE, "auto" or "nccl")."""
    choice = os.environ.get(ENV, DEFAULT)
    if choice not in ("auto", "nccl"):
        raise ValueError(f"{ENV}={choice!r}: use 'auto' (symmetric memory for small tensors where the GPUs have it) "
                         "or 'nccl'")
    return choice == "auto"


class SymmetricAllReduce:
    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():  # older torch needs it; newer does it by itself and warns
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group.group_name)  # collective over `group`: every rank, same order
        self.group_name, self.dtype = group.group_name, dtype

    def takes(self, tensor: torch.Tensor) -> bool:
        return (tensor.dtype == self.dtype and tensor.is_contiguous() and tensor.numel() <= self.buffer.numel()
                and tensor.numel() * tensor.element_size() % 16 == 0)  # the kernel's vectors

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1)
        total = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: flat.numel()], flat, "sum",
                                                            self.group_name)
        return total.view(tensor.shape)


def try_make(group, device: torch.device, dtype: torch.dtype) -> "SymmetricAllReduce | None":
    """The lane's symmetric all-reduce, or None where NCCL serves alone: off CUDA, switched off, or where the GPUs
    cannot map each other's memory (the caller agrees on the outcome across ranks)."""
    if device.type != "cuda" or not wanted():
        return None
    try:
        return SymmetricAllReduce(group, device, dtype)
    except (RuntimeError, ImportError, AttributeError) as error:
        warnings.warn(f"all-reduce through NCCL only: symmetric memory is unavailable here ({error})")
        return None
