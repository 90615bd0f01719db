"""One layer's host-tier KV blocks streamed over PCIe into a device staging buffer, and a device clock to time it.

Layout: host_layer is one layer of the head-major host pool, `[2, host_blocks, Hkv, B, D]` (K then V), contiguous,
addressed by the device in place (a CUDA alias of the pinned memory, HostKVPool.device_stacked); staging is
`[2, capacity, Hkv, B, D]`, contiguous, on the device. A block's Hkv * B * D elements are contiguous in both, so a
block moves as a straight copy; the device attends over the staging buffer through the strided view
`staging[0].transpose(1, 2)` ([capacity, B, Hkv, D]), with no transposition here.
- stream_host_blocks: staging[:, i] = host_layer[:, blocks[i]] for i < count[0]; nothing else is written;
- stamp: clock[index] = the device's nanosecond timer (%globaltimer), to time the copies inside a captured graph.

Contract: blocks int64 [capacity] and count int32/int64 [1] live on the device and are read there: no host sync,
and the grid comes from shapes and `programs` only, so a CUDA graph captures a launch and replays it with new
blocks and count. The loop runs over count[0] blocks, not the capacity: thousands of staging places with few used
would cost milliseconds a layer. Every read crosses PCIe and waits microseconds, so the copy runs on few programs,
each with a few KB in flight per load (as gpu_kernels/host_block_copies.py; docs/decisions/device-kernels.md,
"Host-block copies on few programs"). Offsets are int64: a host pool exceeds 2**31 elements.
"""
import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, interpreted, next_power_of_2, on_device

# Enough PCIe reads in flight, few SMs taken from the device lane's step beside the copy (READ_PROGRAMS there).
STREAM_PROGRAMS = 16
CHUNK_ELEMENTS = 4096  # a program's load: 8 KiB of bf16 (a unit is one chunk of one block's K or V)


# Nothing per call is an integer argument (count is read on the device); the strides are fixed for an engine.
@triton.jit
def _stream_kernel(host_layer, staging, blocks, count, host_kv_stride, staging_kv_stride,
                   BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, EVEN: tl.constexpr):
    n = tl.load(count)
    cols = tl.arange(0, CHUNK)
    for unit in range(tl.program_id(0), n * 2 * CHUNKS, tl.num_programs(0)):
        i, kv, chunk = unit // (2 * CHUNKS), (unit // CHUNKS) % 2, unit % CHUNKS  # block i's K or V, a chunk of it
        block = tl.load(blocks + i)
        offset = chunk * CHUNK + cols  # < BLOCK_ELEMS: int32 is enough inside a block
        # tl.cast, not .to: under the interpreter the loop's indices are Python ints.
        source = host_layer + tl.cast(kv, tl.int64) * host_kv_stride + block * BLOCK_ELEMS + offset
        target = staging + tl.cast(kv, tl.int64) * staging_kv_stride + tl.cast(i, tl.int64) * BLOCK_ELEMS + offset
        if EVEN:
            tl.store(target, tl.load(source))
        else:
            inside = offset < BLOCK_ELEMS
            tl.store(target, tl.load(source, mask=inside), mask=inside)


def stream_host_blocks(host_layer: torch.Tensor, blocks: torch.Tensor, count: torch.Tensor,
                       staging: torch.Tensor, programs: int = STREAM_PROGRAMS) -> None:
    """staging[:, i] = host_layer[:, blocks[i]] for i < count[0], K and V, in place, on the current stream; the
    rest of staging is left as it is (see the module docstring for the layouts and the contract)."""
    capacity, block_elems = _check(host_layer, blocks, count, staging)
    if capacity == 0 or block_elems == 0:
        return
    chunk = min(CHUNK_ELEMENTS, next_power_of_2(block_elems))
    chunks = -(-block_elems // chunk)
    with on_device(staging):
        _stream_kernel[(max(1, min(int(programs), 2 * capacity * chunks)),)](
            host_layer, staging, blocks, count, host_layer.stride(0), staging.stride(0), BLOCK_ELEMS=block_elems,
            CHUNK=chunk, CHUNKS=chunks, EVEN=block_elems % chunk == 0, num_warps=8 if chunk >= 2048 else 4)


def compile_host_kv_stream(host_layer: torch.Tensor, staging: torch.Tensor, blocks: torch.Tensor,
                           count: torch.Tensor) -> None:
    """Launches the copy once over no blocks (it reads and writes nothing) with these buffers, at start-up, so that
    neither the first streamed step nor a graph capture compiles or loads the kernel: Triton does both at the first
    launch. Leaves count[0] = 0. Why: docs/decisions/device-kernels.md, "Host-block copies compiled at start-up"."""
    _check(host_layer, blocks, count, staging)
    count.zero_()
    stream_host_blocks(host_layer, blocks, count, staging)


def _check(host_layer, blocks, count, staging) -> tuple[int, int]:
    """Validates the arguments and returns (capacity, elements of one block's K or V)."""
    if host_layer.dim() != 5 or host_layer.shape[0] != 2 or not host_layer.is_contiguous():
        raise ValueError(f"host_layer must be a contiguous [2, host_blocks, Hkv, block, D], got "
                         f"{tuple(host_layer.shape)} strides {host_layer.stride()}")
    num_kv_heads, block, head_dim = host_layer.shape[2:]
    if staging.dim() != 5 or staging.shape[0] != 2 or tuple(staging.shape[2:]) != (num_kv_heads, block, head_dim) \
            or not staging.is_contiguous():
        raise ValueError(f"staging must be a contiguous [2, capacity, {num_kv_heads}, {block}, {head_dim}], got "
                         f"{tuple(staging.shape)} strides {staging.stride()}")
    if staging.dtype != host_layer.dtype or staging.device != host_layer.device:
        raise ValueError(f"staging must have host_layer's dtype and device ({host_layer.dtype} on "
                         f"{host_layer.device}), got {staging.dtype} on {staging.device}")
    capacity = staging.shape[1]
    check_int_tensor("blocks", blocks, (capacity,), (torch.int64,))
    check_int_tensor("count", count, (1,), (torch.int32, torch.int64))
    for name, t in (("blocks", blocks), ("count", count)):
        if t.device != staging.device:
            raise ValueError(f"{name} must be on staging's device {staging.device}, got {t.device}")
    return capacity, num_kv_heads * block * head_dim


# The index changes with every stamp of a step: specialized on it (== 1, % 16), stamps would compile anew.
@triton.jit(do_not_specialize=["index"])
def _stamp_kernel(clock, index):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(clock + index, now)


def stamp(clock: torch.Tensor, index: int) -> None:
    """clock[index] = the device's global nanosecond timer (PTX %globaltimer), one program, on the current stream;
    no host sync (graph-safe). clock: int64 [n] on a CUDA device. Its first launch compiles the kernel: stamp once
    before capturing a graph."""
    if not clock.is_cuda:
        raise ValueError("stamp needs a CUDA tensor")
    if interpreted(clock.device):
        raise ValueError("stamp reads the device's timer in PTX: it needs native Triton (TRITON_INTERPRET unset)")
    if clock.dim() != 1 or clock.dtype != torch.int64 or not 0 <= int(index) < clock.shape[0]:
        raise ValueError(f"clock must be int64 [n] with 0 <= index < n, got {clock.dtype} {tuple(clock.shape)} "
                         f"and index {index}")
    with on_device(clock):
        _stamp_kernel[(1,)](clock, int(index), num_warps=1)
