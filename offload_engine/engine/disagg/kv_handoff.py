"""Copies KV blocks between the prefill device's mirror pool and the decode device's pool, on a "handoff" stream of
each device so decode steps never queue behind them; ordered by events, never by the current device. Sends run in
order on one stream pair: a sequence whose final send has landed has all its earlier ones too.
Why: docs/decisions/multi-gpu.md, "PD: a mirror pool, one block id on both devices".
"""
import contextlib

import numpy as np
import torch

from offload_engine.engine.runner.cuda_streams import engine_stream
from offload_engine.engine.tiers.move_staging import GROUP_BYTES


class KVHandoff:
    def __init__(self, prefill_runner, decode_runner):
        self.mirror, self.pool = prefill_runner.device_stacked, decode_runner.device_stacked
        self.cuda = self.pool.is_cuda
        self.prefill_device, self.decode_device = self.mirror.device, self.pool.device
        # Where the lane's chunks run: fills land there, in front of the chunk that reads them.
        self.compute = prefill_runner.streams.get("device")
        self.decode_lanes = [decode_runner.streams["device"], decode_runner.moves_stream] if self.cuda else []
        self.out = engine_stream(self.prefill_device, "handoff") if self.cuda else None
        self.into = engine_stream(self.decode_device, "handoff") if self.cuda else None
        self.latest = None  # CUDA event: every send queued so far has landed
        self.mirrored: dict[int, int] = {}  # block id -> hash of the registration whose KV the mirror holds
        self.num_sent_blocks = self.num_filled_blocks = 0

    def on_prefill_device(self):
        """The prefill device as the current one (the lane's thread): nothing there may follow another device."""
        return torch.cuda.device(self.prefill_device) if self.cuda else contextlib.nullcontext()

    def decode_marks(self) -> list:
        """Events at the end of what the decode device has queued so far (device-lane steps, demotions, promotions):
        taken when a prefill batch is scheduled, before which its blocks' earlier users were queued."""
        return [stream.record_event() for stream in self.decode_lanes]

    def send(self, block_ids: list[int], after: list) -> "torch.cuda.Event | None":
        """Queues the copy of these mirror blocks into the decode pool, behind the chunk that wrote them and the
        decode-device work in `after` (decode_marks: a step in flight may still write a freed row's blocks, a demotion
        read them). Returns the event of their landing, or None where the copy is done already."""
        with torch.inference_mode(), self._streams(self.out, self.into):
            if self.cuda:
                self.out.wait_stream(self.compute)
                for event in after:
                    self.into.wait_event(event)
            _copy_blocks(self.mirror, self.pool, block_ids)
            self.num_sent_blocks += len(block_ids)
            if not self.cuda:
                return None
            landed = torch.cuda.Event()
            landed.record(self.into)
        self.latest = landed
        return landed

    def fill(self, block_ids: list[int], pool, after: list) -> None:
        """Brings prefix-cache hits of the decode pool (`pool` its BlockPool) to the mirror where it does not hold
        their KV, in front of the lane's next chunk. `after` as for send: only blocks registered from a decode-device
        write (a promotion's, say) land here, so their KV is there once `after` has run."""
        missing = [b for b in block_ids if self.mirrored.get(b) != pool.blocks[b].hash]
        if not missing:
            return
        with torch.inference_mode(), self._streams(self.into, self.compute):
            for event in after:
                self.into.wait_event(event)
            _copy_blocks(self.pool, self.mirror, missing)
        self.remember(missing, pool)
        self.num_filled_blocks += len(missing)

    def forget(self, block_ids: list[int]) -> None:
        """These mirror blocks are about to be written by a chunk: whatever registration they held is gone."""
        for block_id in block_ids:
            self.mirrored.pop(block_id, None)

    def remember(self, block_ids: list[int], pool) -> None:
        """The mirror holds these blocks' KV: records the registration of each that is registered."""
        for block_id in block_ids:
            if pool.blocks[block_id].hash is not None:
                self.mirrored[block_id] = pool.blocks[block_id].hash

    @staticmethod
    def landed(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            event.synchronize()

    def order_decode_prefill(self) -> None:
        """Makes the decode device's own prefill (its device lane's stream) wait on the device for every send queued
        so far: a split row's device part may hit blocks whose KV is still crossing."""
        if self.latest is not None:
            self.decode_lanes[0].wait_event(self.latest)

    def drain(self) -> None:
        """Waits until every copy queued so far has run, fills included (abort, close)."""
        if self.cuda:
            self.wait(self.latest)
            self.compute.synchronize()
            self.into.synchronize()
        self.latest = None

    def close(self) -> None:
        self.drain()
        self.mirror = self.pool = None  # the pools' memory goes with their runners
        self.mirrored.clear()

    @contextlib.contextmanager
    def _streams(self, source, target):
        """source's stream current on its device, target's on its own (CUDA): each op runs on the stream of the
        device its tensors live on, and a copy between them synchronizes both (torch's cross-device copy_)."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(source), torch.cuda.stream(target):
            yield


def _copy_blocks(source: torch.Tensor, target: torch.Tensor, block_ids: list[int]) -> None:
    """target[:, :, ids] = source[:, :, ids] for two pools of allocate_device_pool's layout, a group of layers of
    at most GROUP_BYTES at a time, on the current streams of both devices."""
    ids = torch.from_numpy(np.asarray(block_ids, dtype=np.int64))
    source_ids = ids.to(source.device, non_blocking=True)
    target_ids = ids.to(target.device, non_blocking=True)
    layer_bytes = len(block_ids) * source[0].numel() // source.shape[2] * source.element_size()
    group = max(1, GROUP_BYTES // max(1, layer_bytes))
    for first in range(0, source.shape[0], group):
        layers = slice(first, first + group)
        gathered = source[layers].index_select(2, source_ids)
        target[layers].index_copy_(2, target_ids, gathered.to(target.device, non_blocking=True))
