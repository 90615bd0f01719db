"""Moves of KV between the host tier's blocks and the device pool's token slots, run by the device.

Layout: the host pool is head-major `[L, 2, host_blocks, Hkv, host_block_size, D]`, addressed by the device in place
(a CUDA alias of the pinned memory, HostKVPool.device_stacked); the device pool is token-major `[L, 2, slots, Hkv, D]`
(its blocks flattened). Token t of a move sits in host block `blocks[rows[t] // host_block_size]` at offset
`rows[t] % host_block_size`, and in device slot `slots[t]`, in every layer, K and V.
- gather_host_blocks: host -> device, a promotion's KV into its new slots;
- scatter_host_blocks: device -> host, a demotion's KV into its new host blocks (rows past a sequence's last token
  are left as they are: nothing reads a host block past its sequence's length, and the host lane writes the next
  tokens there);
- write_host_blocks_whole: one layer's K and V of a prefill step -> whole host blocks of that layer (a host-tier
  prompt's KV, layers/host_block_writes.py), padding rows zeroed; one launch a layer.

Contract: blocks, rows and slots are int64 on the pools' device; writes only the named slots or host rows; no
host sync. Every access crosses PCIe and waits microseconds, so the kernels run on few programs: enough accesses
in flight to fill PCIe, few SMs taken from the device lane's step beside them (a copy on every SM, as torch's
index_select and index_copy_, stalls that step for the whole transfer). Why these counts:
docs/decisions/device-kernels.md, "Host-block copies on few programs".
"""
import torch
import triton
import triton.language as tl

from ._common import check_int_tensor, next_power_of_2, on_device

# See the module docstring: enough accesses in flight for PCIe, few SMs taken from the step beside.
READ_PROGRAMS = 16
WRITE_PROGRAMS = 8
TOKENS_PER_UNIT = 4  # a program's load: 4 tokens x Hkv x D (32 KiB at 8 x 128 bf16)


# Token and unit counts change with every move: specialized on them (Triton keys on == 1 and % 16), the kernel
# would compile mid-run on the engine's thread (docs/decisions/device-kernels.md, "Host-block copies compiled at
# start-up").
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
    """Compiles both directions for these pools and launches each once over no tokens (it reads and writes
    nothing), at the engine's start-up, so that a run's first move neither compiles the kernel nor loads it:
    Triton loads a compiled kernel and builds its launcher at the first launch, which `warmup` does not make.
    Why: docs/decisions/device-kernels.md, "Host-block copies compiled at start-up"."""
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


# Strides unspecialized too: start-up compiles it on stand-ins (layers/attention.py, Attention.compile_staged_prefill).
@triton.jit(do_not_specialize=["num_units", "k_token_stride", "v_token_stride"])
def _write_blocks_kernel(k, v, k_pool, v_pool, token_rows, targets, num_units, k_token_stride, v_token_stride,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HOST_BLOCK: tl.constexpr,
                         BLOCK_HD: tl.constexpr, TOKENS: tl.constexpr):
    chunks = tl.cdiv(HOST_BLOCK, TOKENS)
    cols = tl.arange(0, BLOCK_HD)
    in_row = cols < NUM_HEADS * HEAD_DIM
    host_cols = (cols // HEAD_DIM) * (HOST_BLOCK * HEAD_DIM) + cols % HEAD_DIM
    for unit in range(tl.program_id(0), num_units, tl.num_programs(0)):
        j, chunk = unit // chunks, unit % chunks  # whole block j of the step, rows [chunk * TOKENS, ...)
        r = chunk * TOKENS + tl.arange(0, TOKENS)
        valid = r < HOST_BLOCK
        token = tl.load(token_rows + j * HOST_BLOCK + r, mask=valid, other=-1)
        block = tl.load(targets + j)
        mask = valid[:, None] & in_row[None, :]
        loaded = mask & (token >= 0)[:, None]  # a padding row (-1) is written as zeros
        offset = block * (NUM_HEADS * HOST_BLOCK * HEAD_DIM) + (r * HEAD_DIM)[:, None] + host_cols[None, :]
        source = tl.maximum(token, 0)[:, None]
        tl.store(k_pool + offset, tl.load(k + source * k_token_stride + cols[None, :], mask=loaded, other=0), mask=mask)
        tl.store(v_pool + offset, tl.load(v + source * v_token_stride + cols[None, :], mask=loaded, other=0), mask=mask)


def write_host_blocks_whole(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            token_rows: torch.Tensor, targets: torch.Tensor, programs: int = WRITE_PROGRAMS) -> None:
    """k_pool[targets[j], :, r] = k[token_rows[j * B + r]] (zeros where that is -1), and the same for v, for every
    row r < B of every whole block j, on the current stream. k, v: [T, Hkv, D], heads and dims contiguous (a token
    stride of their own: views of a fused projection are fine); pools: one layer's [blocks, Hkv, B, D], contiguous."""
    num_blocks, num_kv_heads, host_block, head_dim = targets.shape[0], *k_pool.shape[1:]
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim) or t.stride(2) != 1 \
                or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be [tokens, {num_kv_heads}, {head_dim}] with heads and dims contiguous, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous()) \
            or len({k.dtype, v.dtype, k_pool.dtype, v_pool.dtype}) != 1:
        raise ValueError("k_pool and v_pool must be contiguous, of one shape, and of k's and v's dtype")
    check_int_tensor("targets", targets, (num_blocks,), (torch.int64,))
    check_int_tensor("token_rows", token_rows, (num_blocks * host_block,), (torch.int64,))
    if num_blocks == 0:
        return
    tokens = min(TOKENS_PER_UNIT, next_power_of_2(host_block))
    units = num_blocks * -(-host_block // tokens)
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    with on_device(k):
        _write_blocks_kernel[(max(1, min(programs, units)),)](
            k, v, k_pool, v_pool, token_rows, targets, units, k.stride(0), v.stride(0),
            NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, HOST_BLOCK=host_block, BLOCK_HD=block_hd, TOKENS=tokens,
            num_warps=_warps(block_hd))
