"""Where and when a runner's moves between the tiers run: which stream each copy queues on, and what waits for it
(docs/design.md, "Moves between the tiers"). How the KV crosses is kv_promotion.py's and kv_demotion.py's to say.
"""
import os

import torch

from offload_engine.engine.sequence import Sequence
from offload_engine.engine.tiers.kv_demotion import copy_to_host, write_mapped
from offload_engine.engine.tiers.kv_promotion import copy_to_device, read_mapped


def promote(runner, moves: list[tuple[Sequence, list[int]]]):
    """Copies promoted sequences' KV from their old host blocks into their new device blocks: on the moves stream
    where the device reads the pinned pool, returning the reads' event, before which nothing may decode the rows or
    write their old or new blocks; else done on return (None). A move with no computed token to carry (a split
    row whose device part holds all of its KV, promoted) copies nothing."""
    moves = [(seq, blocks) for seq, blocks in moves if seq.num_computed_tokens and blocks]
    if not moves:
        return None
    mapped = runner.host_pool.device_stacked()
    if mapped is None:
        with torch.inference_mode(), runner.lane_stream("device"):
            copy_to_device(moves, runner.host_pool.layers, runner.device_stacked, runner.executor,
                           runner.cfg.block_size, runner.move_staging)
        return None
    # Host-pool writes on the executor into these blocks have finished. Demotions' direct writes need no wait
    # on this thread: they are on this stream or the device lane's, which the reads below wait for.
    runner.executor_writes.settle()
    with torch.inference_mode(), torch.cuda.stream(runner.moves_stream):
        # The new device blocks were freed by rows that steps queued on the device lane may still read.
        runner.moves_stream.wait_stream(runner.streams["device"])
        runner.accesses.after_prefill_writes()  # a host-tier prompt's KV may still be crossing to its host blocks
        read_mapped(moves, mapped, runner.device_stacked, runner.cfg.block_size, runner.upload)
        return runner.accesses.record("promotion_reads")


def promotes_beside_device_lane(runner) -> bool:
    """Whether promote's copy lands after it returns (it returns the copy's event): where the device reads the pool."""
    return runner.host_pool is not None and runner.host_pool.device_stacked() is not None


def demotes_beside_device_lane(runner) -> bool:
    """Whether demote's copy runs beside the device lane's next steps: where the device writes the pinned pool.
    OFFLOAD_ENGINE_DEMOTE_BESIDE=0 queues it in front of the next step instead (for A/B measurement)."""
    return (runner.moves_stream is not None and runner.host_pool is not None
            and runner.host_pool.device_stacked() is not None
            and os.environ.get("OFFLOAD_ENGINE_DEMOTE_BESIDE", "1") != "0")


def demote(runner, moves: list[tuple[Sequence, list[int]]], first_blocks: list[int] | None = None):
    """Copies demoted sequences' KV from their old device blocks into their new host blocks; returns once queued. With
    first_blocks, on the moves stream, those first, returning the copy's event; else before the next step (None)."""
    mapped = runner.host_pool.device_stacked()
    if first_blocks is not None and demotes_beside_device_lane(runner):
        device_lane, moves_stream = runner.streams["device"], runner.moves_stream

        def first_blocks_crossed():
            crossed = torch.cuda.Event()
            crossed.record(moves_stream)
            device_lane.wait_event(crossed)

        with torch.inference_mode(), torch.cuda.stream(moves_stream):
            # The steps queued so far write these rows' last tokens (promotions' reads are on this stream already).
            moves_stream.wait_stream(device_lane)
            runner.accesses.after_prefill_writes()  # the host blocks may be ones an aborted prefill still writes
            write_mapped(moves, runner.device_stacked, mapped, runner.cfg.block_size, runner.upload, first_blocks,
                         between=first_blocks_crossed)
            return runner.accesses.record("demotion_writes")
    with torch.inference_mode(), runner.lane_stream("device"):
        runner.accesses.after_promotion_reads()  # the host blocks written here may be ones a promotion still reads
        runner.accesses.after_prefill_writes()  # or ones an aborted prefill still writes
        if mapped is None:
            runner.executor_writes.add(copy_to_host(moves, runner.device_stacked, runner.host_pool.layers,
                                                    runner.executor, runner.cfg.block_size, runner.move_staging))
            return None
        write_mapped(moves, runner.device_stacked, mapped, runner.cfg.block_size, runner.upload)
        runner.accesses.record("demotion_writes")
        return None
