"""Turns a prefill or host-lane batch into the step's tensors: token ids, positions and the dual-map
AttentionMetadata (docs/design.md, "The dual maps"). One builder per lane; device tensors cross from its own
PinnedRing, so no step pins memory; host-tier fields stay on the host.
"""
from dataclasses import dataclass

import numpy as np
import torch

from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.engine.tiers.pinned_ring import PinnedRing
from offload_engine.engine.tiers.slots import slots_for
from offload_engine.layers.attention_metadata import AttentionMetadata, PrefixStaging, StreamedKV
from offload_engine.layers.host_block_writes import HostBlockWrites, plan_host_block_writes
from offload_engine.layers.logits_processing import logits_processing
from offload_engine.layers.sampler import SamplingBatch, sampling_keys

STAGING_BYTES = 16 << 20  # a prefill's inputs at max_num_batched_tokens=16k are ~0.5 MB; larger ones pin once


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    sample_rows: torch.Tensor  # [B] int64, device: the token of each sequence whose logits are sampled
    meta: AttentionMetadata


@dataclass
class _RowMaps:
    """One row's share of the dual maps: its tokens' slots and its context and block table, on each tier."""

    slots: dict  # tier -> int64 [tokens], -1 where the token is written on the other tier
    context: dict  # tier -> tokens of KV the tier's kernel attends over for this row
    table: dict
    staged: bool = False  # prefill: attends through the staging cache (Attention._stage_prefix)


class StepInputBuilder:
    def __init__(self, device: torch.device, block_size: int, cpu_block_size: int, seed: int = 0):
        self.device = device
        self.rng = np.random.default_rng(seed)  # the keys of unseeded sampled rows (layers/sampler.py)
        self.block_sizes = {BlockLocation.GPU: block_size, BlockLocation.CPU: cpu_block_size}
        self.ring = PinnedRing(STAGING_BYTES) if device.type == "cuda" else None
        # Whether the device writes host-tier prefill K/V into the host pool itself (ModelRunner.bind_kv_caches).
        self.direct_host_writes = False

    def to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        host = torch.as_tensor(np.asarray(data), dtype=dtype)
        if self.ring is None:
            return host
        staged, region = self.ring.take(tuple(host.shape), dtype)
        staged.copy_(host)
        moved = staged.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.ring.busy_until(region, copied)
        return moved

    def sampling_settings(self, seqs: list[Sequence], vocab: int, pending: dict[int, int] | None = None
                          ) -> tuple | None:
        """Per-row (temperatures, keys, top-ks, top-ps) as host arrays, the last two None where no row filters, and
        the rows' LogitsProcessing on the device (None where no row has any); None where every row is greedy and
        unprocessed. pending: ids of newest tokens the host holds only places for (logits_processing)."""
        params = [s.params for s in seqs]
        processing = logits_processing(seqs, self.to_device, pending)
        if all(p.greedy for p in params) and processing is None:
            return None
        temperatures = np.array([p.temperature for p in params], dtype=np.float32)
        # A row's key goes with the position its token takes (len(seq)): a seeded request draws the same
        # noise there whatever the batch, the chunking of its prompt or the lane.
        keys = sampling_keys([p.seed for p in params], np.array([len(s) for s in seqs]), self.rng)
        if not any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
            return temperatures, keys, None, None, processing
        # Greedy rows keep every logit: their argmax must not depend on how a filter breaks ties.
        top_ks = np.array([p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params], np.int64)
        top_ps = np.array([1.0 if p.greedy else p.top_p for p in params], dtype=np.float32)
        return temperatures, keys, top_ks, top_ps, processing

    def sampling(self, seqs: list[Sequence], vocab: int) -> SamplingBatch:
        settings = self.sampling_settings(seqs, vocab)
        if settings is None:  # argmax only: no per-row settings cross to the device
            return SamplingBatch(None, None)
        temperatures, keys, top_ks, top_ps, processing = settings
        filtered = top_ks is not None
        return SamplingBatch(
            temperatures=self.to_device(temperatures, torch.float32), keys=self.to_device(keys, torch.int64),
            top_ks=self.to_device(top_ks, torch.int64) if filtered else None,
            top_ps=self.to_device(top_ps, torch.float32) if filtered else None, needs_filter=filtered,
            processing=processing)

    def release(self) -> None:
        if self.ring is not None:
            self.ring.drain()
            self.ring = None

    def prefill_row(self, seq: Sequence, start: int, end: int) -> _RowMaps:
        """The maps of a prefill chunk, tokens [start, end) of seq. A split row is a staged, host-tier row unless
        the chunk lies wholly in its device part."""
        gpu, cpu = BlockLocation.GPU, BlockLocation.CPU
        none = np.full(end - start, -1, dtype=np.int64)
        if not seq.is_split:
            tier, other = seq.location, gpu if seq.location == cpu else cpu
            own = slots_for(seq.block_table, self.block_sizes[tier], start, end)
            return _RowMaps({tier: own, other: none}, {tier: end, other: 0}, {tier: seq.block_table, other: []},
                            staged=tier == cpu)
        split = seq.num_device_tokens
        device, host = none.copy(), none.copy()
        on_device = min(max(split - start, 0), end - start)
        device[:on_device] = slots_for(seq.device_prefix, self.block_sizes[gpu], start, start + on_device)
        host[on_device:] = slots_for(seq.block_table, self.block_sizes[cpu], start + on_device, end, first=split)
        tables = {gpu: seq.device_prefix, cpu: seq.block_table}
        if end <= split:
            return _RowMaps({gpu: device, cpu: host}, {gpu: end, cpu: 0}, tables)
        return _RowMaps({gpu: device, cpu: host}, {gpu: 0, cpu: end}, tables, staged=True)

    def prefill(self, seqs: list[Sequence]) -> StepInputs:
        token_ids, positions, cu_seqlens, rows = [], [], [0], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            rows.append(self.prefill_row(seq, start, end))
        meta = self._prefill_maps(rows)
        meta.cu_seqlens_q = self.to_device(cu_seqlens, torch.int32)
        meta.max_seqlen_q = max(s.num_scheduled_tokens for s in seqs)
        if meta.has_cpu_rows:
            host_slots = np.concatenate([r.slots[BlockLocation.CPU] for r in rows])
            meta.staging = self._staging(seqs, rows, host_slots, cu_seqlens, meta.has_gpu_rows)
        return StepInputs(self.to_device(token_ids, torch.int64), self.to_device(positions, torch.int64),
                          self.to_device(cu_seqlens[1:], torch.int64) - 1, meta)

    def decode(self, seqs: list[Sequence], streamed: list[int] | None = None) -> StepInputs:
        """A host-lane step's maps, in one pass without per-row arrays: it runs before every step. streamed: per
        row, how many leading host blocks are streamed to the device (StreamedKV) instead of read by the CPU kernel."""
        gpu = BlockLocation.GPU
        streamed = streamed if streamed is not None and any(streamed) else None
        num_rows = len(seqs)
        slots = {t: np.full(num_rows, -1, dtype=np.int64) for t in BlockLocation}
        ctx = {t: [0] * num_rows for t in BlockLocation}
        tables = {t: [[]] * num_rows for t in BlockLocation}
        for row, seq in enumerate(seqs):
            tier, newest = seq.location, len(seq) - 1
            if seq.is_split:  # the newest token is in the host part; the device part is attended as well
                ctx[gpu][row], tables[gpu][row] = seq.num_device_tokens, seq.device_prefix
                newest -= seq.num_device_tokens
            size = self.block_sizes[tier]
            slots[tier][row] = seq.block_table[newest // size] * size + newest % size
            skip = streamed[row] if streamed is not None else 0
            ctx[tier][row], tables[tier][row] = newest + 1 - skip * size, seq.block_table[skip:]
        meta = self._maps(slots, ctx, tables, is_prefill=False)
        if streamed is not None:
            meta.streamed = self._streamed(seqs, streamed)
        return StepInputs(self.to_device([s.token_ids[-1] for s in seqs], torch.int64),
                          self.to_device([len(s) - 1 for s in seqs], torch.int64),
                          self.to_device(np.arange(num_rows), torch.int64), meta)

    def _streamed(self, seqs: list[Sequence], streamed: list[int]) -> StreamedKV:
        """The streamed share's maps: row b's first streamed[b] host blocks, staged one after another."""
        size = self.block_sizes[BlockLocation.CPU]
        source, tables, first = [], [], 0
        for seq, n in zip(seqs, streamed):
            source += seq.block_table[:n]
            tables.append(list(range(first, first + n)))
            first += n
        return StreamedKV(source_blocks=self.to_device(source, torch.int64), count=self.to_device([first], torch.int64),
                          block_tables=self.to_device(_block_tables(tables), torch.int32),
                          context_lens=self.to_device([n * size for n in streamed], torch.int32), num_blocks=first)

    def _prefill_maps(self, rows: list[_RowMaps]) -> AttentionMetadata:
        meta = self._maps({t: np.concatenate([r.slots[t] for r in rows]) for t in BlockLocation},
                          {t: [r.context[t] for r in rows] for t in BlockLocation},
                          {t: [r.table[t] if r.context[t] else [] for r in rows] for t in BlockLocation}, True)
        meta.has_cpu_rows = any(r.staged for r in rows)  # they attend on the device, through the staging cache
        return meta

    def _maps(self, slots: dict, ctx: dict, tables: dict, is_prefill: bool) -> AttentionMetadata:
        gpu, cpu = BlockLocation.GPU, BlockLocation.CPU
        # A tier takes part in the step where some row attends over its KV or some token is written into it.
        busy = {t: any(ctx[t]) or bool((slots[t] >= 0).any()) for t in BlockLocation}
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=self.to_device(slots[gpu], torch.int64),
            context_lens=self.to_device(ctx[gpu], torch.int32),
            block_tables=self.to_device(_block_tables(tables[gpu]), torch.int32),
            slot_mapping_cpu=torch.from_numpy(slots[cpu]),
            context_lens_cpu=torch.tensor(ctx[cpu], dtype=torch.int32),
            block_tables_cpu=torch.from_numpy(_block_tables(tables[cpu])),
            has_gpu_rows=busy[gpu],
            has_cpu_rows=busy[cpu],
        )

    def _staging(self, seqs, rows: list[_RowMaps], host_slots, cu_seqlens, mixed: bool) -> PrefixStaging:
        """Staging-cache tables for the staged rows (host-tier prefill rows). The staging cache holds, in this
        order: the host prefix blocks of every staged row, the device parts of the split ones (gathered from the
        device pool, a host block's worth of device blocks each), then every staged row's chunk blocks. A row's
        table lists its own in token order: device part, host prefix, chunk."""
        block_size = self.block_sizes[BlockLocation.CPU]
        staged = [(seq, row) for seq, row in zip(seqs, rows) if row.staged]
        host_prefix = [-(-max(0, s.num_computed_tokens - s.num_device_tokens) // block_size) for s, _ in staged]
        device_parts = [s.num_device_tokens // block_size for s, _ in staged]
        source = [b for (s, _), n in zip(staged, host_prefix) for b in s.block_table[:n]]
        device_source = [b for s, _ in staged for b in s.device_prefix]
        next_prefix, next_device = 0, len(source)
        next_chunk = next_device + sum(device_parts)
        tables = {}
        for (seq, _), num_prefix, num_device in zip(staged, host_prefix, device_parts):
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            num_chunk = -(-end // block_size) - num_device - num_prefix
            tables[seq.seq_id] = (list(range(next_device, next_device + num_device))
                                  + list(range(next_prefix, next_prefix + num_prefix))
                                  + list(range(next_chunk, next_chunk + num_chunk)))
            next_prefix, next_device, next_chunk = (next_prefix + num_prefix, next_device + num_device,
                                                    next_chunk + num_chunk)
        slots = np.full(cu_seqlens[-1], -1, dtype=np.int64)
        for b, seq in enumerate(seqs):
            if seq.seq_id in tables:
                start = seq.num_computed_tokens
                slots[cu_seqlens[b] : cu_seqlens[b + 1]] = slots_for(tables[seq.seq_id], block_size, start,
                                                                     start + seq.num_scheduled_tokens)
        block_writes, host_tokens = self.host_writes(host_slots)
        return PrefixStaging(
            source_blocks=torch.tensor(source, dtype=torch.int64),
            device_source_blocks=self.to_device(device_source, torch.int64),
            num_blocks=next_chunk,
            block_tables=self.to_device(_block_tables([tables.get(s.seq_id, []) for s in seqs]), torch.int32),
            slot_mapping=self.to_device(slots, torch.int64),
            context_lens=self.to_device([s.num_computed_tokens + s.num_scheduled_tokens if s.seq_id in tables else 0
                                         for s in seqs], torch.int32),
            host_token_indices=(self.to_device(host_tokens, torch.int64) if mixed or host_tokens.size < len(host_slots)
                                else None),
            host_token_slots=torch.from_numpy(host_slots[host_tokens]),
            block_writes=block_writes,
        )

    def host_writes(self, host_slots: np.ndarray) -> tuple[HostBlockWrites | None, np.ndarray]:
        """How a prefill's host-tier tokens (host_slots, -1 for others) reach the host pool: the blocks the device
        writes whole (with direct_host_writes), and the indices of the tokens left for the executor."""
        if not self.direct_host_writes:
            return None, np.flatnonzero(host_slots >= 0)
        plan, rest = plan_host_block_writes(host_slots, self.block_sizes[BlockLocation.CPU])
        if plan is None:
            return None, rest
        return HostBlockWrites(*(self.to_device(a, torch.int64) for a in plan)), rest


def _block_tables(rows: list[list[int]]) -> np.ndarray:
    """Rows padded with -1 to the longest (at least one column, so kernels always see a 2-D table)."""
    table = np.full((len(rows), max(1, max(map(len, rows), default=0))), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table
