"""Where and when a runner's moves between the tiers run: which stream each copy queues on, and what waits for it.

How the KV crosses is kv_promotion.py's and kv_demotion.py's to say; this is the runner's side of it (ModelRunner
promote, demote and demotes_beside_device_lane call here), kept apart from the runner's steps.
"""
import os

import torch

from offload_engine.engine.tiers.kv_demotion import copy_to_host, write_mapped
from offload_engine.engine.tiers.kv_promotion import copy_to_device, read_mapped
from offload_engine.engine.sequence import Sequence


def promote(runner, moves: list[tuple[Sequence, list[int]]]):
    """Copies promoted sequences' KV from their old host blocks into their new device blocks.

    Where the device reads the pinned pool directly (kv_promotion.read_mapped), the reads only get queued, on
    the "moves" stream beside the device lane's steps, and the CUDA event that marks them done is returned:
    the sequences must not decode before it (LLMEngine holds them out), and whatever writes host blocks or
    reads device blocks by prefix reuse waits for it (run, demote), since the old host blocks may be handed
    out again at once and the new device blocks are registered for reuse already. On the device lane's own
    stream the reads held up every step behind them: 13.5 ms of a 600 MB promotion, ~0.3-0.4 s of device
    time in a 10-37 s run at 8B (H100 host, 2026-11-22, benchmarks/NOTES.md). Otherwise the copy is done
    when this returns, and it returns None."""
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
    """Whether promote's copy runs beside the device lane and lands after it returns (it returns the copy's event):
    where the device reads the pinned pool directly."""
    return runner.host_pool is not None and runner.host_pool.device_stacked() is not None


def demotes_beside_device_lane(runner) -> bool:
    """Whether demote runs its copy beside the device lane's next steps (it takes first_blocks): where the
    device writes the pinned pool directly. OFFLOAD_ENGINE_DEMOTE_BESIDE=0 queues it in front of the next step
    instead, as before (for side-by-side measurement)."""
    return (runner.moves_stream is not None and runner.host_pool is not None
            and runner.host_pool.device_stacked() is not None
            and os.environ.get("OFFLOAD_ENGINE_DEMOTE_BESIDE", "1") != "0")


def demote(runner, moves: list[tuple[Sequence, list[int]]], first_blocks: list[int] | None = None):
    """Copies demoted sequences' KV from their old device blocks into their new host blocks. Returns once the
    device has the copies queued: where the device writes the pinned pool directly, everything that reads
    host blocks on the host waits for them first (HostPoolAccesses.wait_writes); otherwise the host writes finish
    on the executor, in front of every such reader (engine/tiers/kv_demotion.py).

    With first_blocks (demotes_beside_device_lane): the copy runs on the moves stream beside the device lane's
    next steps. The tokens in first_blocks, the old device blocks those steps may write, cross first and the
    device lane's stream waits for them alone; the CUDA event that marks the whole copy done is returned, and
    the other old blocks stay out of use until it has completed (BlockPool.hold_until). Otherwise the copy is
    queued on the device lane's stream, in front of the next step, and this returns None."""
    mapped = runner.host_pool.device_stacked()
    if first_blocks is not None and demotes_beside_device_lane(runner):
        device_lane, moves_stream = runner.streams["device"], runner.moves_stream

        def first_blocks_crossed():
            crossed = torch.cuda.Event()
            crossed.record(moves_stream)
            device_lane.wait_event(crossed)

        with torch.inference_mode(), torch.cuda.stream(moves_stream):
            # The steps queued so far write these rows' last tokens; promotions' reads of host blocks are
            # queued on this stream already.
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
        write_mapped(moves, runner.device_stacked, mapped, runner.cfg.block_size, runner.upload)  # one kernel
        runner.accesses.record("demotion_writes")
        return None
