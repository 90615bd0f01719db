"""Turns a scheduled batch into the step's tensors: token ids, positions and the dual-map AttentionMetadata.

One pass over the sequences fills plain Python lists and numpy arrays; each device tensor then makes one
non-blocking copy from pinned memory. Host-tier fields are built on the host and stay there.
"""
from dataclasses import dataclass

import numpy as np
import torch

from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.layers.attention_metadata import AttentionMetadata, PrefixStaging


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    sample_rows: torch.Tensor  # [B] int64, device: the token of each sequence whose logits are sampled
    meta: AttentionMetadata


def slots_for(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of token positions [start, end): block_id * block_size + offset, in the tier's own pool."""
    positions = np.arange(start, end)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


class StepInputBuilder:
    def __init__(self, device: torch.device, block_size: int, cpu_block_size: int):
        self.device = device
        self.block_sizes = {BlockLocation.GPU: block_size, BlockLocation.CPU: cpu_block_size}
        self.pin = device.type == "cuda"

    def to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        host = torch.as_tensor(np.asarray(data), dtype=dtype)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def prefill(self, seqs: list[Sequence]) -> StepInputs:
        token_ids, positions, cu_seqlens = [], [], [0]
        slots = {tier: [] for tier in BlockLocation}
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            own = slots_for(seq.block_table, self.block_sizes[seq.location], start, end)
            for tier in BlockLocation:
                slots[tier].append(own if tier == seq.location else np.full(end - start, -1, dtype=np.int64))
        slots = {tier: np.concatenate(parts) for tier, parts in slots.items()}
        meta = self._metadata(seqs, is_prefill=True, slots=slots,
                              context_lens=[s.num_computed_tokens + s.num_scheduled_tokens for s in seqs])
        meta.cu_seqlens_q = self.to_device(cu_seqlens, torch.int32)
        meta.max_seqlen_q = max(s.num_scheduled_tokens for s in seqs)
        if meta.has_cpu_rows:
            meta.staging = self._staging(seqs, slots[BlockLocation.CPU], cu_seqlens, meta.has_gpu_rows)
        return StepInputs(self.to_device(token_ids, torch.int64), self.to_device(positions, torch.int64),
                          self.to_device(cu_seqlens[1:], torch.int64) - 1, meta)

    def decode(self, seqs: list[Sequence]) -> StepInputs:
        slots = {tier: np.full(len(seqs), -1, dtype=np.int64) for tier in BlockLocation}
        for row, seq in enumerate(seqs):
            slots[seq.location][row] = slots_for(seq.block_table, self.block_sizes[seq.location], len(seq) - 1, len(seq))[0]
        meta = self._metadata(seqs, is_prefill=False, slots=slots, context_lens=[len(s) for s in seqs])
        rows = np.arange(len(seqs))
        return StepInputs(self.to_device([s.token_ids[-1] for s in seqs], torch.int64),
                          self.to_device([len(s) - 1 for s in seqs], torch.int64), self.to_device(rows, torch.int64), meta)

    def _metadata(self, seqs, is_prefill, slots, context_lens) -> AttentionMetadata:
        tiers = [s.location for s in seqs]
        ctx = {t: [n if tier == t else 0 for n, tier in zip(context_lens, tiers)] for t in BlockLocation}
        tables = {t: _block_tables([s.block_table if s.location == t else [] for s in seqs]) for t in BlockLocation}
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=self.to_device(slots[BlockLocation.GPU], torch.int64),
            context_lens=self.to_device(ctx[BlockLocation.GPU], torch.int32),
            block_tables=self.to_device(tables[BlockLocation.GPU], torch.int32),
            slot_mapping_cpu=torch.from_numpy(slots[BlockLocation.CPU]),
            context_lens_cpu=torch.tensor(ctx[BlockLocation.CPU], dtype=torch.int32),
            block_tables_cpu=torch.from_numpy(tables[BlockLocation.CPU]),
            has_gpu_rows=BlockLocation.GPU in tiers,
            has_cpu_rows=BlockLocation.CPU in tiers,
        )

    def _staging(self, seqs, host_slots, cu_seqlens, mixed: bool) -> PrefixStaging:
        """Staging-cache tables for CPU-tier prefill rows: their prefix blocks first, then their chunk blocks."""
        block_size = self.block_sizes[BlockLocation.CPU]
        on_host = [s for s in seqs if s.location == BlockLocation.CPU]
        prefix_counts = [-(-s.num_computed_tokens // block_size) for s in on_host]
        source = [b for s, n in zip(on_host, prefix_counts) for b in s.block_table[:n]]
        next_prefix, next_chunk = 0, len(source)
        rows, slots = {}, np.full(cu_seqlens[-1], -1, dtype=np.int64)
        for seq, num_prefix in zip(on_host, prefix_counts):
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            num_chunk = -(-end // block_size) - num_prefix
            rows[seq.seq_id] = list(range(next_prefix, next_prefix + num_prefix)) + \
                list(range(next_chunk, next_chunk + num_chunk))
            next_prefix, next_chunk = next_prefix + num_prefix, next_chunk + num_chunk
        for b, seq in enumerate(seqs):
            if seq.seq_id in rows:
                slots[cu_seqlens[b] : cu_seqlens[b + 1]] = slots_for(
                    rows[seq.seq_id], block_size, seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens)
        host_tokens = np.flatnonzero(host_slots >= 0)
        return PrefixStaging(
            source_blocks=torch.tensor(source, dtype=torch.int64),
            num_blocks=next_chunk,
            block_tables=self.to_device(_block_tables([rows.get(s.seq_id, []) for s in seqs]), torch.int32),
            slot_mapping=self.to_device(slots, torch.int64),
            context_lens=self.to_device([s.num_computed_tokens + s.num_scheduled_tokens if s.seq_id in rows else 0
                                         for s in seqs], torch.int32),
            host_token_indices=self.to_device(host_tokens, torch.int64) if mixed else None,
            host_token_slots=torch.from_numpy(host_slots[host_tokens]) if mixed else torch.from_numpy(host_slots),
        )


def _block_tables(rows: list[list[int]]) -> np.ndarray:
    """Rows padded with -1 to the longest (at least one column, so kernels always see a 2-D table)."""
    table = np.full((len(rows), max(1, max(map(len, rows), default=0))), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table
