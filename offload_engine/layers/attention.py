"""The split attention layer (docs/design.md, "The split attention layer"; docs/decisions/host-prefill.md): each
token's K/V goes to its own tier; decode runs the host half beside the device half and merges them by log-sum-exp;
prefill always computes on the device, over a token-major staging cache for host-tier rows."""
import functools
import time

import torch
from torch import nn

from offload_engine.layers.attention_metadata import AttentionMetadata, PrefixStaging, StreamedKV
from offload_engine.layers.host_block_writes import write_host_blocks


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by ModelRunner.bind_kv_caches.
        self.k_cache = self.v_cache = None  # device tier, token-major [blocks, block_size, Hkv, D]
        self.k_cache_cpu = self.v_cache_cpu = None  # host tier, head-major [blocks, Hkv, cpu_block_size, D]
        self.backend = None
        self.executor = None  # cpu_attention.CpuAttentionExecutor: the host tier's one worker thread
        self.ring = None  # CUDA: a PinnedRing for host-tier prefill traffic, whose K/V cross on copy_stream
        self.copy_stream = None
        self.k_cache_mapped = self.v_cache_mapped = None  # the host pool as the device addresses it, or None
        self.host_kv_mapped = None  # this layer's K and V of it, [2, blocks, Hkv, cpu_block_size, D] (CUDA only)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. kv_stored: a decode step's device rows' K/V are in the
        device pool already (written by the rotation's kernel, layers.fused.stores_kv_ahead)."""
        if meta.is_prefill:
            return self._prefill(q, k, v, meta)
        return self._decode(q, k, v, meta, kv_stored)

    def _decode(self, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        host_job = self._submit_host_decode(q, k, v, meta) if meta.has_cpu_rows else None
        partial = None  # the device's partial: split rows' device parts, then the streamed share
        if meta.has_gpu_rows:
            if not kv_stored:
                self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            partial = self.backend.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale)
            if host_job is None:
                return partial[0]
        if meta.streamed is not None:
            partial = self._merged(partial, self.attend_streamed(q, self.stream_in(meta.streamed), meta.streamed))
        host_out, host_lse = (t.to(q.device, non_blocking=True) for t in host_job.result())
        if partial is None:
            return host_out
        return self.backend.merge_attn_states(*partial, host_out, host_lse)[0]

    def _merged(self, partial, other):
        return other if partial is None else self.backend.merge_attn_states(*partial, *other)

    def stream_in(self, streamed: StreamedKV, staging: torch.Tensor | None = None) -> torch.Tensor:
        """The streamed share's host blocks of this layer, [2, S, Hkv, block, D] on the device (into `staging`, if
        given). Through the device's own reads where it addresses the pool, else gathered on the host."""
        if self.host_kv_mapped is not None:
            from gpu_kernels.host_kv_stream import stream_host_blocks

            if staging is None:
                staging = torch.empty((2, streamed.num_blocks, *self.host_kv_mapped.shape[2:]),
                                      dtype=self.host_kv_mapped.dtype, device=self.host_kv_mapped.device)
            stream_host_blocks(self.host_kv_mapped, streamed.source_blocks, streamed.count, staging)
            return staging
        blocks = streamed.source_blocks.cpu()
        gathered = torch.stack([self.k_cache_cpu.index_select(0, blocks), self.v_cache_cpu.index_select(0, blocks)])
        return gathered.to(streamed.source_blocks.device, non_blocking=True)

    def attend_streamed(self, q, staging: torch.Tensor, streamed: StreamedKV):
        """q's attention over the staged share: (out, lse), rows with none streamed empty. The staging is head-major;
        the device kernel reads it through a token-major view."""
        k_view, v_view = staging[0].transpose(1, 2), staging[1].transpose(1, 2)
        return self.backend.strided_decode_attention(q, k_view, v_view, streamed.block_tables,
                                                     streamed.context_lens, self.scale)

    def _submit_host_decode(self, q, k, v, meta: AttentionMetadata):
        q_host, k_host, v_host = _to_host(q), _to_host(k), _to_host(v)
        arrived = _record_event(q)
        from cpu_attention import paged_decode_attention, store_kvcache

        def run():
            if arrived is not None:
                arrived.synchronize()
            began = time.perf_counter()
            # The new token's K/V must be in the pool before the kernel reads its row.
            store_kvcache(k_host, v_host, self.k_cache_cpu, self.v_cache_cpu, meta.slot_mapping_cpu)
            out = paged_decode_attention(
                q_host, self.k_cache_cpu, self.v_cache_cpu, meta.block_tables_cpu, meta.context_lens_cpu, self.scale)
            meta.host_kernel_seconds.append(time.perf_counter() - began)
            return out

        return self.executor.submit(run)

    def _prefill(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        partials = []
        if meta.has_cpu_rows:
            self._write_host_tier(k, v, meta.staging.block_writes, meta.staging.host_token_indices,
                                  meta.staging.host_token_slots, meta.pending_host_writes)
        if meta.has_gpu_rows:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            # A prefill graph's step runs the tiles of its map, on Triton's kernel whatever serves eager prefill.
            attend, tiled = ((self.backend.paged_prefill_attention, {}) if meta.prefill_tiles is None else
                             (self.backend.tiled_prefill_attention, {"tiles": meta.prefill_tiles}))
            partials.append(attend(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.context_lens, self.scale, meta.max_seqlen_q, **tiled))
        if meta.has_cpu_rows:
            k_staged, v_staged = self._stage_prefix(meta.staging, q.device)
            self.backend.store_kvcache(k, v, k_staged, v_staged, meta.staging.slot_mapping)
            partials.append(self.backend.paged_prefill_attention(
                q, k_staged, v_staged, meta.staging.block_tables, meta.cu_seqlens_q, meta.staging.context_lens,
                self.scale, meta.max_seqlen_q))
        if len(partials) == 1:
            return partials[0][0]
        # Each token has one non-empty partial here; the merge puts both tiers back into batch order.
        return self.backend.merge_attn_states(*partials[0], *partials[1])[0]

    def _write_host_tier(self, k, v, block_writes, token_indices: torch.Tensor | None, token_slots: torch.Tensor,
                         pending_writes: list) -> None:
        """Host-tier K/V to the host pool: whole blocks by the device, the rest by the executor (to pending_writes)."""
        if block_writes is not None:
            write_host_blocks(k, v, block_writes, self.k_cache_mapped, self.v_cache_mapped, self.copy_stream)
        if token_slots.numel():
            pending_writes.append(self._submit_host_write(k, v, token_indices, token_slots))

    def _submit_host_write(self, k, v, token_indices: torch.Tensor | None, token_slots: torch.Tensor):
        if token_indices is not None:
            k, v = k[token_indices], v[token_indices]
        (k_host, v_host), region, arrived = self._copies_to_ring(k, v)
        from cpu_attention import store_kvcache

        def run():
            if arrived is not None:
                arrived.synchronize()
            store_kvcache(k_host, v_host, self.k_cache_cpu, self.v_cache_cpu, token_slots)

        write = self.executor.submit(run)
        if self.ring is not None:
            self.ring.busy_until(region, write)
        return write

    def _copies_to_ring(self, *tensors):
        """Host copies of same-shaped device tensors in one pinned-ring region, that region, and the event after
        which they have landed (None off CUDA). They copy on copy_stream, beside the layer's compute; record_stream
        keeps the allocator from giving the tensors' memory to later layers before the copies have read it."""
        if self.ring is None:
            return [_to_host(t) for t in tensors], None, _record_event(tensors[0])
        staged, region = self.ring.take((len(tensors), *tensors[0].shape), tensors[0].dtype)
        self.copy_stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
        with torch.cuda.stream(self.copy_stream):
            for t, host in zip(tensors, staged):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)
            return list(staged), region, _record_event(tensors[0])

    def _pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype):
        if self.ring is None:
            return torch.empty(shape, dtype=dtype), None
        return self.ring.take(shape, dtype)

    def _stage_prefix(self, staging: PrefixStaging, device: torch.device):
        """The host-tier prefix blocks, then split rows' device parts, in a token-major device cache."""
        num_prefix = staging.source_blocks.numel()
        staged = []
        for host_pool, device_pool in ((self.k_cache_cpu, self.k_cache), (self.v_cache_cpu, self.v_cache)):
            cache = self._staging_cache(staging.num_blocks, device)
            self._gather_host_blocks(host_pool, staging.source_blocks, cache[:num_prefix])
            self._gather_device_parts(device_pool, staging.device_source_blocks, cache[num_prefix:])
            staged.append(cache)
        return staged

    def stage_segment(self, segment) -> list[torch.Tensor]:
        """A layer's staging cache for a layer-major prefill segment, in token order (block j: tokens from
        j * cpu_block_size). A split row's device part and the host prefix are staged once; chunks add their K/V."""
        staged = []
        device = self.k_cache.device
        num_device = segment.num_device_part_blocks
        num_prefix = segment.host_source_blocks.numel()
        for host_pool, device_pool in ((self.k_cache_cpu, self.k_cache), (self.v_cache_cpu, self.v_cache)):
            cache = self._staging_cache(segment.num_staging_blocks, device)
            self._gather_device_parts(device_pool, segment.device_source_blocks, cache[:num_device])
            self._gather_host_blocks(host_pool, segment.host_source_blocks, cache[num_device:num_device + num_prefix])
            staged.append(cache)
        return staged

    def attend_segment_chunk(self, q, k, v, staged: list[torch.Tensor], chunk, pending_writes: list):
        """One chunk of a segment: its K/V go to their tier and the staging cache, where its queries attend."""
        if chunk.has_device_tokens:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, chunk.device_slots)
        self._write_host_tier(k, v, chunk.block_writes, chunk.host_token_indices, chunk.host_token_slots,
                              pending_writes)
        self.backend.store_kvcache(k, v, *staged, chunk.staging_slots)
        # The staging cache's table is the identity: Triton's kernel then reads no table.
        contiguous = {"contiguous": True} if self.backend.prefill_takes_contiguous else {}
        out, _ = self.backend.paged_prefill_attention(q, *staged, chunk.block_table, chunk.cu_seqlens_q,
                                                      chunk.context_lens, self.scale, chunk.num_tokens, **contiguous)
        return out

    def _staging_cache(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """Token-major; zeroed for flash-attn, which may read a partial last block whole (flash_attn_backend.py)."""
        _, num_kv_heads, block_size, head_dim = self.k_cache_cpu.shape
        make = torch.zeros if self.backend.flash_attn_prefill is not None else torch.empty
        return make((num_blocks, block_size, num_kv_heads, head_dim), dtype=self.k_cache_cpu.dtype, device=device)

    def _gather_host_blocks(self, host_pool: torch.Tensor, source_blocks: torch.Tensor, into: torch.Tensor) -> None:
        """into[i] = host_pool[source_blocks[i]], token-major (transposed on the device)."""
        if not source_blocks.numel():
            return
        from cpu_attention.gather import gather_blocks

        gathered, region = self._pinned_empty((source_blocks.numel(), *host_pool.shape[1:]), host_pool.dtype)
        # On the executor: the gather must follow this step's queued host writes, and numba's pool (not a torch
        # CPU op) keeps a second OpenMP team off the host's cores (cpu_attention/gather.py).
        self.executor.submit(gather_blocks, host_pool, source_blocks, gathered).result()
        into.copy_(gathered.to(into.device, non_blocking=True).transpose(1, 2))
        if self.ring is not None:
            self.ring.busy_until(region, _record_event(into))

    @staticmethod
    def _gather_device_parts(device_pool: torch.Tensor, device_source: torch.Tensor, into: torch.Tensor) -> None:
        """Split rows' device parts into staging blocks, a host block's worth of consecutive tokens each."""
        if not device_source.numel():
            return
        parts = device_pool.index_select(0, device_source)
        block_size = into.shape[1]
        into[: parts.shape[0] * parts.shape[1] // block_size].copy_(parts.view(-1, *into.shape[1:]))

    def compile_prefill(self, staged: bool) -> None:
        """At start-up, the prefill kernels compiled per cache shape, so that none compiles in a first prefill:
        Triton's eager variants and flash-attn 4's for the device pool's block size; with `staged` (a host tier),
        the staging cache's."""
        flash_attn = self.backend.flash_attn_prefill
        self._compile_triton_prefill(self.k_cache.shape[1], contiguous=(False,))
        if flash_attn is not None:
            self._prefill_once(self.k_cache.shape[1], flash_attn)
        if staged:
            self.compile_staged_prefill()
            self._compile_triton_prefill(self.k_cache_cpu.shape[2], contiguous=(False, True))
            if flash_attn is not None:
                self._prefill_once(self.k_cache_cpu.shape[2], flash_attn)

    def _compile_triton_prefill(self, block_size: int, contiguous: tuple[bool, ...]) -> None:
        """Each variant of Triton's eager prefill that a step on a cache of `block_size` may launch (its query tile,
        the table read or not), run once on two tokens. Eager steps are the ones no prefill graph holds, such as
        those with host rows: without this, the first of them compiled its variant inside the step."""
        if not (self.k_cache.is_cuda and self.backend.prefill_takes_contiguous):
            return
        from gpu_kernels.paged_prefill import launch_configs, paged_prefill_attention

        for config in launch_configs(self.k_cache.device, self.k_cache.dtype, self.k_cache.shape[-1]):
            for flag in contiguous:
                self._prefill_once(block_size, functools.partial(paged_prefill_attention, config=config,
                                                                 contiguous=flag))

    def compile_staged_prefill(self) -> None:
        """Runs a host-tier prefill's device kernels once on two tokens (the staging cache's variants: the host block
        size is a Triton constexpr; the whole-block host writes), so they compile at start-up, not in the first one."""
        _, num_kv_heads, block_size, head_dim = self.k_cache_cpu.shape
        k, v, out, lse = self._prefill_once(block_size)
        self.backend.merge_attn_states(out, lse, out, lse)
        if self.k_cache_mapped is not None and k.is_cuda:
            from gpu_kernels.host_block_copies import write_host_blocks_whole

            device, dtype = k.device, k.dtype
            pools = [torch.empty(1, num_kv_heads, block_size, head_dim, device=device, dtype=dtype) for _ in range(2)]
            rows = torch.tensor([0, 1] + [-1] * (block_size - 2), device=device)
            write_host_blocks_whole(k, v, *pools, rows, torch.zeros(1, dtype=torch.int64, device=device))

    def _prefill_once(self, block_size: int, attend=None):
        """Two tokens' K/V stored in a two-block cache of `block_size`, then attended causally by `attend` (the
        backend's prefill if None): (k, v, out, lse)."""
        attend = attend or self.backend.paged_prefill_attention
        _, _, num_kv_heads, head_dim = self.k_cache.shape
        device, dtype, tokens = self.k_cache.device, self.k_cache.dtype, 2
        q = torch.randn(tokens, self.num_heads, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        caches = [torch.zeros(2, block_size, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)]
        self.backend.store_kvcache(k, v, *caches, torch.arange(tokens, device=device))
        as_int32 = lambda rows: torch.tensor(rows, device=device, dtype=torch.int32)
        out, lse = attend(q, *caches, as_int32([[0, 1]]), as_int32([0, tokens]), as_int32([tokens]), self.scale, tokens)
        return k, v, out, lse


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (pinned, asynchronous from CUDA; the tensor itself on the CPU)."""
    if t.device.type == "cpu":
        return t.contiguous()
    return t.contiguous().to("cpu", non_blocking=True)


def _record_event(t: torch.Tensor):
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event

