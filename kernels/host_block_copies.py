"""Moves of KV between the host tier's blocks and the device pool's token slots, run by the device.

The host pool is head-major, `[L, 2, host_blocks, Hkv, host_block_size, D]`, and the device addresses it in place
(a CUDA alias of the pinned memory, HostKVPool.device_stacked); the device pool is token-major,
`[L, 2, slots, Hkv, D]` (its blocks flattened). Token t of a move sits in host block
`blocks[rows[t] // host_block_size]` at offset `rows[t] % host_block_size`, and in device slot `slots[t]`, in
every layer, K and V.
- gather_host_blocks: host -> device, a promotion's KV into its new slots;
- scatter_host_blocks: device -> host, a demotion's KV into its new host blocks (rows past a sequence's last token
  are left as they are: nothing reads a host block past its sequence's length, and the host lane writes the next
  tokens there).

Why a kernel of its own, on few programs: the accesses cross PCIe, so each takes microseconds, and a copy that
asks for every SM (torch's index_select, index_copy_) holds them all for the whole transfer. The device lane's
step beside it then waits as long as the copy: a 632 MB promotion (8B, 4,352 tokens) lengthened a stand-in 5.4 ms
step to 22.4 ms, as the engine's step traces showed (~17 ms a promotion). Measured with
benchmarks/probe_promotion_overlap.py (H100 host, 2026-11-24):
- reads: on 16 programs the same copy read 50.9 GB/s against index_select's 37.4 and the step beside it took
  5.7-6.1 ms; 8 programs read 38 GB/s, 32 and more took SMs from the step again;
- writes need fewer programs in flight (a write does not wait for its answer): 4 and 8 programs wrote 49-51 GB/s
  with the step beside them at 5.5 ms, its time alone, where 16 programs wrote as fast but stretched the step to
  10.7 ms and index_copy_ (40.8 GB/s) to 20.5 ms.

Contract: blocks, rows and slots are int64 on the pools' device; writes only the named slots or host rows; no
host sync.
"""
import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, next_power_of_2, on_device

# See the module docstring: enough accesses in flight for PCIe, few SMs taken from the step beside.
READ_PROGRAMS = 16
WRITE_PROGRAMS = 8
TOKENS_PER_UNIT = 4  # a program's load: 4 tokens x Hkv x D (32 KiB at 8 x 128 bf16)


# Token and unit counts change with every move: specialized on them (Triton keys on ==1 and %16), the kernel
# compiled up to four times in the middle of a run, on the engine's thread (decode-heavy 8B at 3,296 blocks read
# 0.99x gpu on its first process with the kernel, 1.04x with it compiled at start-up; H100 host, 2026-11-24).
@triton.jit(do_not_specialize=["num_tokens", "num_units"])
def _copy_kernel(host, token_slots, blocks, rows, slots, num_tokens, num_units,
                 host_lk_stride, host_block_stride, slots_lk_stride,
                 NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HOST_BLOCK: tl.constexpr,
                 BLOCK_HD: tl.constexpr, TOKENS: tl.constexpr, TO_HOST: tl.constexpr):
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
        block = tl.load(blocks + row // HOST_BLOCK, mask=valid, other=0)
        slot = tl.load(slots + t, mask=valid, other=0)
        mask = valid[:, None] & in_row[None, :]
        in_host = host + lk.to(tl.int64) * host_lk_stride + block[:, None] * host_block_stride \
            + (row % HOST_BLOCK)[:, None] * HEAD_DIM + host_cols[None, :]
        in_slots = token_slots + lk.to(tl.int64) * slots_lk_stride + slot[:, None] * (NUM_HEADS * HEAD_DIM) \
            + cols[None, :]
        if TO_HOST:
            tl.store(in_host, tl.load(in_slots, mask=mask), mask=mask)
        else:
            tl.store(in_slots, tl.load(in_host, mask=mask), mask=mask)


def compile_host_block_copies(host_stacked: torch.Tensor, token_slots: torch.Tensor) -> None:
    """Compiles both directions for these pools now and launches each once over no tokens (the engine's start-up),
    so a run's first move neither compiles the kernel nor loads it: Triton loads a compiled kernel and builds its
    launcher at the first launch, which `warmup` does not make. Compiled but not launched, the first demotion of a
    machine's first run held the engine's thread 0.27-0.41 s (0.6B shape, 64 x (2048 + 256) at 2,304 blocks: 0.91x
    gpu against 1.01x in the next process; H100 host, 2026-11-24, benchmarks/NOTES.md), though nothing compiled in
    the run. A launch over no tokens reads and writes nothing."""
    index = torch.zeros(1, dtype=torch.int64, device=token_slots.device)
    for to_host in (False, True):
        _copy(host_stacked, token_slots, index, index[:0], index[:0], programs=1, to_host=to_host, launch_empty=True)


def _warps(block_hd: int) -> int:
    return 8 if block_hd >= 1024 else 4


def gather_host_blocks(host_stacked: torch.Tensor, token_slots: torch.Tensor, blocks: torch.Tensor,
                       rows: torch.Tensor, slots: torch.Tensor, programs: int = READ_PROGRAMS) -> None:
    """token_slots[:, :, slots[t]] = host token t (see the module docstring), in place, on the current stream."""
    _copy(host_stacked, token_slots, blocks, rows, slots, programs, to_host=False)


def scatter_host_blocks(host_stacked: torch.Tensor, token_slots: torch.Tensor, blocks: torch.Tensor,
                        rows: torch.Tensor, slots: torch.Tensor, programs: int = WRITE_PROGRAMS) -> None:
    """Host token t (see the module docstring) = token_slots[:, :, slots[t]], in place, on the current stream."""
    _copy(host_stacked, token_slots, blocks, rows, slots, programs, to_host=True)


def _copy(host_stacked, token_slots, blocks, rows, slots, programs: int, to_host: bool,
          launch_empty: bool = False) -> None:
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
    check_int_tensor("blocks", blocks, (blocks.shape[0],), (torch.int64,))
    if num_tokens == 0 and not launch_empty:
        return
    units = layers * two * -(-num_tokens // TOKENS_PER_UNIT)
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    with on_device(token_slots):
        _copy_kernel[(max(1, min(programs, units)),)](
            host_stacked, token_slots, blocks, rows, slots, num_tokens, units,
            host_stacked.stride(1), host_stacked.stride(2), token_slots.stride(1),
            NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, HOST_BLOCK=host_block, BLOCK_HD=block_hd,
            TOKENS=TOKENS_PER_UNIT, TO_HOST=to_host, num_warps=_warps(block_hd))
