"""gather_host_blocks: a promotion's KV from the host tier's blocks into the device pool's token slots.

The host pool is head-major, `[L, 2, host_blocks, Hkv, host_block_size, D]`, and the device reads it in place
(a CUDA alias of the pinned memory, HostKVPool.device_stacked); the device pool is token-major,
`[L, 2, slots, Hkv, D]` (its blocks flattened). Token t of the move sits in host block
`sources[rows[t] // host_block_size]` at offset `rows[t] % host_block_size`, and goes to slot `slots[t]`, in every
layer, K and V.

Why a kernel of its own, on few programs: the reads cross PCIe, so each takes microseconds, and a gather that
asks for every SM (torch's index_select) holds them all for the whole transfer. The device lane's step beside it
then waits as long as the copy: a 632 MB promotion (8B, 4,352 tokens) lengthened a stand-in 5.4 ms step to 22.4 ms,
as the engine's step traces showed (~17 ms a promotion). On 16 programs the same copy read 50.9 GB/s against
index_select's 37.4 and the step beside it took 5.7-6.1 ms (H100 host, 2026-11-24,
benchmarks/probe_promotion_overlap.py); 8 programs read 38 GB/s, 32 and more took SMs from the step again.

Contract: sources, rows and slots are int64 on the pools' device; writes only the named slots; no host sync.
"""
import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, interpreted, next_power_of_2, on_device

READ_PROGRAMS = 16  # see the module docstring: enough reads in flight for PCIe, few SMs taken from the step
TOKENS_PER_UNIT = 4  # a program's load: 4 tokens x Hkv x D (32 KiB at 8 x 128 bf16)


# Token and unit counts change with every move: specialized on them (Triton keys on ==1 and %16), the kernel
# compiled up to four times in the middle of a run, on the engine's thread (decode-heavy 8B at 3,296 blocks read
# 0.99x gpu on its first process with the kernel, 1.04x with it compiled at start-up; H100 host, 2026-11-24).
@triton.jit(do_not_specialize=["num_tokens", "num_units"])
def _gather_kernel(src, dst, sources, rows, slots, num_tokens, num_units,
                   src_lk_stride, src_block_stride, dst_lk_stride,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HOST_BLOCK: tl.constexpr,
                   BLOCK_HD: tl.constexpr, TOKENS: tl.constexpr):
    chunks = tl.cdiv(num_tokens, TOKENS)
    cols = tl.arange(0, BLOCK_HD)
    in_row = cols < NUM_HEADS * HEAD_DIM
    # Column c is (head c // D, dim c % D): head-major in a host block, token-major in a slot.
    host_cols = (cols // HEAD_DIM) * (HOST_BLOCK * HEAD_DIM) + cols % HEAD_DIM
    for unit in range(tl.program_id(0), num_units, tl.num_programs(0)):
        lk, chunk = unit // chunks, unit % chunks  # lk: layer * 2 + (0 for K, 1 for V)
        t = chunk * TOKENS + tl.arange(0, TOKENS)
        valid = t < num_tokens
        row = tl.load(rows + t, mask=valid, other=0)
        block = tl.load(sources + row // HOST_BLOCK, mask=valid, other=0)
        slot = tl.load(slots + t, mask=valid, other=0)
        mask = valid[:, None] & in_row[None, :]
        source = src + lk.to(tl.int64) * src_lk_stride + block[:, None] * src_block_stride \
            + (row % HOST_BLOCK)[:, None] * HEAD_DIM + host_cols[None, :]
        values = tl.load(source, mask=mask)
        target = dst + lk.to(tl.int64) * dst_lk_stride + slot[:, None] * (NUM_HEADS * HEAD_DIM) + cols[None, :]
        tl.store(target, values, mask=mask)


def compile_gather_host_blocks(host_stacked: torch.Tensor, token_slots: torch.Tensor) -> None:
    """Compiles the kernel for these pools now, launching nothing (the engine's start-up: not in a run's first
    promotion). A no-op under Triton's interpreter."""
    if interpreted(token_slots.device):
        return
    index = torch.zeros(1, dtype=torch.int64, device=token_slots.device)
    layers, two, _, num_kv_heads, host_block, head_dim = host_stacked.shape
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    with on_device(token_slots):
        _gather_kernel.warmup(host_stacked, token_slots, index, index, index, 1, 1, host_stacked.stride(1),
                              host_stacked.stride(2), token_slots.stride(1), NUM_HEADS=num_kv_heads,
                              HEAD_DIM=head_dim, HOST_BLOCK=host_block, BLOCK_HD=block_hd, TOKENS=TOKENS_PER_UNIT,
                              num_warps=_warps(block_hd), grid=(1,))


def _warps(block_hd: int) -> int:
    return 8 if block_hd >= 1024 else 4


def gather_host_blocks(host_stacked: torch.Tensor, token_slots: torch.Tensor, sources: torch.Tensor,
                       rows: torch.Tensor, slots: torch.Tensor, programs: int = READ_PROGRAMS) -> None:
    """token_slots[:, :, slots[t]] = host token t (see the module docstring), in place, on the current stream."""
    layers, two, _, num_kv_heads, host_block, head_dim = host_stacked.shape
    if (token_slots.dim() != 5 or tuple(token_slots.shape[:2]) != (layers, two)
            or tuple(token_slots.shape[3:]) != (num_kv_heads, head_dim)):
        raise ValueError(f"token_slots must be [{layers}, {two}, slots, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(token_slots.shape)}")
    if token_slots.dtype != host_stacked.dtype or not (host_stacked.is_contiguous() and token_slots.is_contiguous()):
        raise ValueError("both pools must be contiguous and of one dtype")
    num_tokens = rows.shape[0]
    check_int_tensor("rows", rows, (num_tokens,), (torch.int64,))
    check_int_tensor("slots", slots, (num_tokens,), (torch.int64,))
    check_int_tensor("sources", sources, (sources.shape[0],), (torch.int64,))
    if num_tokens == 0:
        return
    units = layers * two * -(-num_tokens // TOKENS_PER_UNIT)
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    with on_device(token_slots):
        _gather_kernel[(min(programs, units),)](
            host_stacked, token_slots, sources, rows, slots, num_tokens, units,
            host_stacked.stride(1), host_stacked.stride(2), token_slots.stride(1),
            NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, HOST_BLOCK=host_block, BLOCK_HD=block_hd,
            TOKENS=TOKENS_PER_UNIT, num_warps=_warps(block_hd))
