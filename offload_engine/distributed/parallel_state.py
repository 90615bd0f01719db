"""Which slice of the model this process holds (Partition), and the process groups its collectives go over: one per
engine lane, so that one lane's collectives pair up across ranks, never with the other lane's. One tensor-parallel
engine per process. Why: docs/decisions/multi-gpu.md, "One process group per lane, and the `after` count"."""
import dataclasses
import datetime
import faulthandler
import os
import threading
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

from offload_engine.distributed.symmetric_all_reduce import SymmetricAllReduce, try_make, wanted

LANES = ("device", "host")
STORE_PREFIX = "offload-engine/pg"  # launched ranks' process group keys, apart from the launcher's own
# Bounds a hang (a rank stuck in a bug); a rank that dies is noticed at once (workers.py's watcher).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
ABORT_PATIENCE = 30.0  # s that leaving the groups waits for an abort in progress
STACKS_ENV = "OFFLOAD_ENGINE_STACKS_AFTER_S"  # set: every rank prints its threads' stacks to stderr that long after
# joining (once), so that a run stopped by a time limit shows where each rank was


@dataclasses.dataclass(frozen=True)
class Partition:
    """This process's slice of a tensor-parallel model: rank `rank` of `size`. Partition() is the whole model."""

    rank: int = 0
    size: int = 1

    def share(self, count: int) -> int:
        """This rank's part of `count` heads, channels or rows (count is a multiple of size)."""
        return count // self.size

    def start(self, count: int) -> int:
        return self.rank * self.share(count)

    def local_shape(self, model_cfg):
        """The model as this rank sees it (pools, kernels and graphs are sized from it); the vocabulary stays whole."""
        if self.size == 1:
            return model_cfg
        return dataclasses.replace(model_cfg, num_heads=self.share(model_cfg.num_heads),
                                   num_kv_heads=self.share(model_cfg.num_kv_heads),
                                   intermediate_size=self.share(model_cfg.intermediate_size))


def ranks_on_this_host(size: int) -> int:
    """The engine's ranks that share this host's cores: all `size` when rank 0 spawned them, the launcher's
    LOCAL_WORLD_SIZE when it started them on several hosts."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", size))


class _Groups:
    def __init__(self, backend: str, device: torch.device, dtype: torch.dtype):
        self.backend, self.device = backend, device
        # new_group is collective: every rank makes the same groups in the same order. The device lane keeps WORLD,
        # so start-up (which runs as the device lane) and the device lane's steps share one order.
        self.lanes = {"device": dist.group.WORLD, "host": dist.new_group(backend=backend)}
        # NCCL makes a communicator's buffers at its first collective: now, before the device pool is sized.
        for group in self.lanes.values():
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        self.symmetric = {name: self._symmetric(group, dtype) for name, group in self.lanes.items()}

    def _symmetric(self, group, dtype: torch.dtype) -> "SymmetricAllReduce | None":
        """The lane's small-tensor all-reduce, where every rank could make it (else none uses it: they must agree).
        The ranks agree before the rendezvous too, which is collective: a rank that would not join it (another
        engine of its process made one for this group name) would leave the others waiting in it."""
        if not self._every_rank(_may_make_symmetric(self.device, group.group_name), group):
            return None
        made = try_make(group, self.device, dtype)
        _symmetric_names.add(group.group_name)
        return made if self._every_rank(made is not None, group) else None

    def _every_rank(self, flag: bool, group) -> bool:
        tensor = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        return tensor.item() == 1


_symmetric_names: set[str] = set()  # the process groups this process made symmetric memory for


def _may_make_symmetric(device: torch.device, group_name: str) -> bool:
    """Whether this rank can make symmetric memory for `group_name`. Torch registers a group name's store once per
    process and keeps it: after an engine closes, the next engine's groups take the same names, and a rendezvous
    there would go over the closed engine's store and never meet the new ranks. So one engine per process uses it;
    later ones go through NCCL, with a warning."""
    if device.type != "cuda" or not wanted():
        return False
    if group_name in _symmetric_names:
        warnings.warn("small all-reduces go through NCCL in this engine: symmetric memory serves the first "
                      "tensor-parallel engine of a process (torch keeps a process group name's first registration); "
                      "start each engine in a process of its own to give every one of them the one-shot")
        return False
    return True


_groups: _Groups | None = None
_thread = threading.local()  # .lane: the lane whose call this thread is running
_abort_thread: threading.Thread | None = None


def init(rank: int, size: int, device: torch.device, store: "str | dist.Store", dtype: torch.dtype) -> None:
    """Joins the engine's ranks: NCCL on GPUs, gloo on the CPU; they meet at `store` (a file's path for spawned
    ranks, the launcher's store under STORE_PREFIX for launched ones)."""
    global _groups
    if os.environ.get(STACKS_ENV):
        faulthandler.dump_traceback_later(float(os.environ[STACKS_ENV]), exit=False)
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process (another tensor-parallel engine, "
                         "or a process group of your own): close that LLM, or destroy the group, first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    store = dist.FileStore(store, size) if isinstance(store, str) else store
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    _groups = _Groups(backend, device, dtype)


def destroy() -> None:
    """Leaves the groups (every rank does, at close). Safe when not joined. After an abort, waits up to
    ABORT_PATIENCE s for it first: an abort of WORLD leaves the groups itself, and one still stuck past that is left
    as it is (a warning; this process can then start no other tensor-parallel engine) rather than waited on."""
    global _groups, _abort_thread
    _groups = None
    if _abort_thread is not None:
        _abort_thread.join(ABORT_PATIENCE)
        stuck, _abort_thread = _abort_thread.is_alive(), None
        if stuck:
            warnings.warn(f"NCCL's abort after a failed rank did not end within {ABORT_PATIENCE:.0f} s: the process "
                          "groups are left as they are")
            return
    if dist.is_initialized():
        dist.destroy_process_group()


def abort() -> None:
    """Makes the collectives a rank is stuck in fail, once another rank has died (workers.py's watcher): NCCL's
    communicators are aborted (its kernels would spin on); gloo's fail by themselves. The abort runs on a thread of
    its own, never waited for here: the caller holds the watcher's lock, which rank 0's main thread needs to hear
    of the failure, and an NCCL abort can block (destroy() waits for it, bounded)."""
    global _abort_thread
    groups = _groups
    if groups is None or groups.backend != "nccl" or _abort_thread is not None:
        return
    _abort_thread = threading.Thread(target=_abort_all, name="tp-abort", daemon=True)
    _abort_thread.start()


def _abort_all() -> None:
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort_group is not None:
            abort_group()  # WORLD: every group, the lanes' too, inside one NCCL group call
    except Exception:  # noqa: BLE001 - best effort on a failed engine; the caller raises the real error
        pass


@contextmanager
def lane(name: str):
    """The collectives this thread makes inside go over `name`'s group."""
    assert name in LANES, name
    previous = getattr(_thread, "lane", None)
    _thread.lane = name
    try:
        yield
    finally:
        _thread.lane = previous


def _group():
    name = getattr(_thread, "lane", None)
    assert _groups is not None and name is not None, "a tensor-parallel collective outside a lane's call"
    return _groups.lanes[name]


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over the ranks, the same bits on every rank: small tensors over symmetric memory where the
    GPUs have it (a new tensor), the rest by NCCL or gloo (in place). Use the result, not `tensor`."""
    symmetric = _groups.symmetric.get(getattr(_thread, "lane", None)) if _groups is not None else None
    if symmetric is not None and symmetric.takes(tensor):
        return symmetric(tensor)
    dist.all_reduce(tensor, group=_group())
    return tensor


def uses_symmetric_memory(lane_name: str) -> bool:
    """Whether `lane_name`'s small all-reduces go over symmetric memory in this engine."""
    return _groups is not None and _groups.symmetric.get(lane_name) is not None


def small_all_reduce_path(lane_name: str) -> "str | None":
    """How `lane_name`'s small all-reduces go in this process's engine: "symmetric", "nccl" or "gloo" (None: no
    tensor-parallel engine is open here)."""
    if _groups is None:
        return None
    return "symmetric" if uses_symmetric_memory(lane_name) else _groups.backend


def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' tensors concatenated along `dim`, rank 0's first (the list form works across torch versions)."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(_group()))]
    dist.all_gather(parts, tensor, group=_group())
    return torch.cat(parts, dim=dim)


def smallest(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values: pool sizes that each rank measures for itself, agreed so that rank 0's
    block manager never hands out a block another rank lacks."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_group())
    return int(tensor.item())


def all_agree(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on every rank: a choice that decides which collectives a rank runs next
    (a timing loop's exit, which graphs to capture) must come out the same everywhere, or the ranks deadlock."""
    return smallest(int(bool(flag)), device) == 1
