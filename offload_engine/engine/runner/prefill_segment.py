"""Layer-major prefill of a long staged prompt (docs/design.md, "Host-tier prefill"): many chunks of one sequence in
one step, layer by layer, so each layer stages the prefix once, not once per chunk. Between layers each token's
attention output and residual wait on the device (docs/decisions/memory.md, "Prefill segments' memory share").
"""
from dataclasses import dataclass

import numpy as np
import torch

from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.layers.host_block_writes import HostBlockWrites

SEGMENT_MEMORY_SHARE = 0.5  # of the device memory free after start-up that segments may hold
SEGMENT_MEMORY_MARGIN = 1 << 30  # left free besides one layer's staging cache at max_model_len


@dataclass
class SegmentChunk:
    """One chunk of a segment: tokens [begin, end) of the segment, and its maps for one layer's attention."""

    begin: int
    end: int
    device_slots: torch.Tensor  # device int64: device-pool slot of each token, -1 for host-part tokens
    has_device_tokens: bool
    host_token_indices: torch.Tensor | None  # device int64: the tokens written on the host (None: all)
    host_token_slots: torch.Tensor  # host int64: their host-pool slots
    block_writes: HostBlockWrites | None  # the host blocks the device writes whole
    staging_slots: torch.Tensor  # device int64: token t of the sequence is staging slot t
    block_table: torch.Tensor  # device int32 [1, staging blocks]: the identity, staging block i is block i
    cu_seqlens_q: torch.Tensor  # device int32 [2]
    context_lens: torch.Tensor  # device int32 [1]: the sequence's tokens up to this chunk's last

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass
class SegmentInputs:
    token_ids: torch.Tensor  # device int64 [S]
    positions: torch.Tensor  # device int64 [S]
    host_source_blocks: torch.Tensor  # host int64: host blocks of the host prefix before the segment
    device_source_blocks: torch.Tensor  # device int64: a split sequence's device blocks, in token order
    num_device_part_blocks: int  # staging blocks its device part fills (whole host blocks)
    num_staging_blocks: int
    chunks: list[SegmentChunk]


def segment_inputs(builder, seq: Sequence, chunk_tokens: int) -> SegmentInputs:
    """The maps of seq's scheduled tokens as one segment, in chunks of at most chunk_tokens."""
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
    block_size = builder.block_sizes[BlockLocation.CPU]
    row = builder.prefill_row(seq, start, end)
    device_slots, host_slots = row.slots[BlockLocation.GPU], row.slots[BlockLocation.CPU]
    num_host_prefix = -(-max(0, start - seq.num_device_tokens) // block_size)
    num_staging_blocks = -(-end // block_size)
    table = builder.to_device(np.arange(num_staging_blocks)[None], torch.int32)
    chunks = []
    for begin in range(0, end - start, chunk_tokens):
        stop = min(begin + chunk_tokens, end - start)
        host = host_slots[begin:stop]
        block_writes, on_host = builder.host_writes(host)
        chunks.append(SegmentChunk(
            begin=begin, end=stop,
            device_slots=builder.to_device(device_slots[begin:stop], torch.int64),
            has_device_tokens=bool((device_slots[begin:stop] >= 0).any()),
            host_token_indices=None if on_host.size == stop - begin else builder.to_device(on_host, torch.int64),
            host_token_slots=torch.from_numpy(host[on_host]),
            block_writes=block_writes,
            staging_slots=builder.to_device(np.arange(start + begin, start + stop), torch.int64),
            block_table=table,
            cu_seqlens_q=builder.to_device([0, stop - begin], torch.int32),
            context_lens=builder.to_device([start + stop], torch.int32)))
    return SegmentInputs(
        token_ids=builder.to_device(seq.token_ids[start:end], torch.int64),
        positions=builder.to_device(np.arange(start, end), torch.int64),
        host_source_blocks=torch.tensor(seq.block_table[:num_host_prefix], dtype=torch.int64),
        device_source_blocks=builder.to_device(seq.device_prefix, torch.int64),
        num_device_part_blocks=seq.num_device_tokens // block_size,
        num_staging_blocks=num_staging_blocks,
        chunks=chunks)


def run_segment(model, segment: SegmentInputs, pending_writes: list) -> torch.Tensor:
    """The segment through every layer, layer by layer -> the last token's final hidden state [1, hidden]. The
    host-pool writes it queues are appended to pending_writes."""
    decoder = model.model
    attn_out = residual = None
    for layer, attn in enumerate(model.attention_layers()):
        staged = attn.stage_segment(segment)
        for chunk in segment.chunks:
            rows = slice(chunk.begin, chunk.end)
            positions = segment.positions[rows]
            if layer == 0:
                q, k, v, res = decoder.begin(segment.token_ids[rows], positions)
            else:
                q, k, v, res = decoder.between(layer, positions, attn_out[rows], residual[rows])
            out = attn.attend_segment_chunk(q, k, v, staged, chunk, pending_writes)
            if attn_out is None:
                num_tokens = segment.token_ids.shape[0]
                attn_out = out.new_empty((num_tokens, *out.shape[1:]))
                residual = res.new_empty((num_tokens, *res.shape[1:]))
            attn_out[rows], residual[rows] = out, res
        del staged  # the next layer's staging reuses its memory
    return decoder.end(attn_out[-1:], residual[-1:])


def segment_capacity(model_cfg, dtype: torch.dtype, device: torch.device, chunk_tokens: int,
                     max_model_len: int) -> int:
    """Tokens a segment may hold: SEGMENT_MEMORY_SHARE of the memory free now, less one layer's staging cache at
    max_model_len and a margin, over what a segment keeps per token. At least one chunk, at most max_model_len."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = itemsize * (model_cfg.num_heads * model_cfg.head_dim + model_cfg.hidden_size)
    staging = 2 * max_model_len * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    room = SEGMENT_MEMORY_SHARE * (free - staging - SEGMENT_MEMORY_MARGIN)
    return int(min(max_model_len, max(chunk_tokens, room // per_token)))
