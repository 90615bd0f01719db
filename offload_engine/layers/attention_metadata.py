"""The model runner's per-step contract with every attention layer: one set of maps per KV tier.

Rows and tokens of the other tier are masked (slot -1, context length 0, block-table row of -1), so each tier's
kernel runs over the whole batch and the other tier's rows come back empty (out 0, lse -inf), which
`merge_attn_states` passes through. A split row (docs/design.md, "Sequences across both tiers") has both: in decode
its device part in the device maps and its host part in the host maps, and the merge combines two partials.
"""
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from offload_engine.layers.host_block_writes import HostBlockWrites


@dataclass
class PrefixStaging:
    """How host-tier prefill rows see their KV on the device for one step: a token-major staging cache holding
    their prefix blocks (the first `len(source_blocks)` staging blocks, in order), then split rows' device parts (a
    host block's worth of device blocks per staging block), then the chunk's fresh K/V; the device prefill kernel
    runs over it with these tables."""

    source_blocks: torch.Tensor  # host int64 [P]: host-pool blocks holding the prefix tokens
    device_source_blocks: torch.Tensor  # device int64 [S]: device-pool blocks of split rows' device parts
    num_blocks: int  # staging blocks in all (prefix + chunk)
    block_tables: torch.Tensor  # device int32 [B, max_blocks]: staging block ids, -1 for GPU-tier rows
    slot_mapping: torch.Tensor  # device int64 [T]: staging slot of each CPU-tier token, -1 otherwise
    context_lens: torch.Tensor  # device int32 [B]: KV length of CPU-tier rows (prefix + chunk), 0 otherwise
    # Host-tier tokens whose K/V reach the host pool through the executor: their indices (device; None: every
    # token) and host slots. Where the device writes whole host blocks, only those of blocks an earlier step began.
    host_token_indices: torch.Tensor | None
    host_token_slots: torch.Tensor | None
    block_writes: HostBlockWrites | None = None  # the host blocks the device writes whole


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # GPU tier: tensors on the compute device.
    slot_mapping: torch.Tensor  # [T] int64, -1 for CPU-tier tokens
    context_lens: torch.Tensor  # [B] int32, 0 for CPU-tier rows
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 rows for CPU-tier rows
    # CPU tier: host tensors, built on the host and never copied to the device.
    slot_mapping_cpu: torch.Tensor  # [T] int64, -1 for GPU-tier tokens
    context_lens_cpu: torch.Tensor  # [B] int32, 0 for GPU-tier rows
    block_tables_cpu: torch.Tensor  # [B, max_blocks_cpu] int32, -1 rows for GPU-tier rows
    # Which tiers take part in this step (in a prefill, has_cpu_rows: some row attends through the staging cache):
    # host facts, so no layer has to sync.
    has_gpu_rows: bool
    has_cpu_rows: bool
    # Prefill only: packed query layout (device) and its longest row.
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    staging: PrefixStaging | None = None
    # Prefill inside a CUDA graph (engine/graphs/prefill_graphs.py): query tiles that fix the kernel's grid
    # (kernels.paged_prefill.prefill_tiles); None: a grid over max_seqlen_q.
    prefill_tiles: torch.Tensor | None = None
    # Host-pool writes still running on the executor (ModelRunner.check_host_writes).
    pending_host_writes: list[Future] = field(default_factory=list)
    # Decode: seconds each layer's CPU kernels took on the executor, for the cost check (engine/sched/lane_stats.py).
    host_kernel_seconds: list[float] = field(default_factory=list)
