"""The model runner's per-step contract with every attention layer: one set of maps per KV tier. Rows and tokens of
the other tier are masked (slot -1, context length 0, block-table row of -1), so each tier's kernel runs over the whole
batch and returns the other tier's rows empty (out 0, lse -inf), which `merge_attn_states` passes through. In decode
a split row is in both tiers' maps, and its two partials merge.
"""
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from offload_engine.layers.host_block_writes import HostBlockWrites


@dataclass
class PrefixStaging:
    """Host-tier prefill rows' KV on the device for one step: a token-major staging cache of their prefix blocks, then
    split rows' device parts (a host block's worth per staging block), then the chunk's K/V."""

    source_blocks: torch.Tensor  # host int64 [P]: host-pool blocks holding the prefix tokens
    device_source_blocks: torch.Tensor  # device int64 [S]: device-pool blocks of split rows' device parts
    num_blocks: int  # staging blocks in all (prefix + chunk)
    block_tables: torch.Tensor  # device int32 [B, max_blocks]: staging block ids, -1 for GPU-tier rows
    slot_mapping: torch.Tensor  # device int64 [T]: staging slot of each CPU-tier token, -1 otherwise
    context_lens: torch.Tensor  # device int32 [B]: KV length of CPU-tier rows (prefix + chunk), 0 otherwise
    # Host-tier tokens written through the executor (with block_writes, only those of blocks an earlier step began):
    # their indices into the step (device; None: every token) and host slots.
    host_token_indices: torch.Tensor | None
    host_token_slots: torch.Tensor | None
    block_writes: HostBlockWrites | None = None  # the host blocks the device writes whole


@dataclass
class StreamedKV:
    """A host-lane decode step's streamed share: leading host blocks of its rows, copied layer by layer into a device
    staging buffer (head-major, as in the host pool) and attended there; the CPU kernel's maps leave them out."""

    source_blocks: torch.Tensor  # device int64 [S]: host-pool blocks in staging order (row by row, in token order)
    count: torch.Tensor  # device int64 [1]: S
    block_tables: torch.Tensor  # device int32 [B, max_blocks]: staging block ids of each row, -1 padded
    context_lens: torch.Tensor  # device int32 [B]: each row's streamed tokens (whole blocks), 0 if none
    num_blocks: int  # S, a host fact


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # device [T] int64, -1 for CPU-tier tokens
    context_lens: torch.Tensor  # device [B] int32, 0 for CPU-tier rows
    block_tables: torch.Tensor  # device [B, max_blocks] int32, -1 rows for CPU-tier rows
    slot_mapping_cpu: torch.Tensor  # host (never copied to the device) [T] int64, -1 for GPU-tier tokens
    context_lens_cpu: torch.Tensor  # host [B] int32, 0 for GPU-tier rows
    block_tables_cpu: torch.Tensor  # host [B, max_blocks_cpu] int32, -1 rows for GPU-tier rows
    # Host facts, so no layer syncs. In a prefill, has_cpu_rows: some row attends through the staging cache.
    has_gpu_rows: bool
    has_cpu_rows: bool
    # Prefill only: packed query layout (device) and its longest row.
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    staging: PrefixStaging | None = None
    # Prefill graphs: query tiles fixing the kernel's grid (gpu_kernels.paged_prefill.prefill_tiles); None: max_seqlen_q.
    prefill_tiles: torch.Tensor | None = None
    # Host-pool writes still running on the executor (ModelRunner.check_host_writes).
    pending_host_writes: list[Future] = field(default_factory=list)
    # Host-lane decode: the rows' streamed share, or None.
    streamed: StreamedKV | None = None
    # Decode: seconds each layer's host kernels took on the executor (engine/sched/lane_stats.py).
    host_kernel_seconds: list[float] = field(default_factory=list)
