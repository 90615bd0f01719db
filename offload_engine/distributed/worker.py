"""A worker process: rank r (1..N-1), a ModelRunner mirroring rank 0's calls, one thread per lane so that a long host
step never holds up the device lane; a call starts once the other lane has finished `after` calls. A failed call is
reported to rank 0 and the process exits at once, which frees the other ranks' collectives; a worker whose parent
(or, launched, whose rank 0) has gone exits too (docs/decisions/multi-gpu.md). Spawned by rank 0 (worker_main) or
started by a launcher beside it (launched_worker_main)."""
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from offload_engine.config import DTYPES, EngineConfig, ModelConfig
from offload_engine.distributed import parallel_state
from offload_engine.distributed.parallel_state import Partition
from offload_engine.distributed.step_times import StepTimes
from offload_engine.distributed.wire import SequenceMirror, decode_call

STOP = None  # sent on a lane's channel: no more calls on this lane


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Rank 0's runner arguments and the rendezvous, as JSON; the worker reads the model's config from model_dir."""

    model_dir: str
    cfg: EngineConfig  # device = rank 0's
    dtype: torch.dtype
    max_model_len: int
    store_path: str | None = None  # the file rendezvous of spawned ranks; launched ranks meet at the launcher's

    def device(self, rank: int) -> torch.device:
        """Rank r runs on cuda:<first + r> from device cuda:<first>, or on the CPU with every other rank."""
        first = self.cfg.torch_device
        return first if first.type == "cpu" else torch.device("cuda", (first.index or 0) + rank)

    def to_json(self) -> str:
        return json.dumps({"model_dir": self.model_dir, "cfg": dataclasses.asdict(self.cfg),
                           "dtype": str(self.dtype).removeprefix("torch."), "max_model_len": self.max_model_len,
                           "store_path": self.store_path})

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        fields = json.loads(text)
        return cls(fields["model_dir"], EngineConfig(**fields["cfg"]), DTYPES[fields["dtype"]],
                   fields["max_model_len"], fields.get("store_path"))


class _Reporter:
    """The worker's pipe to rank 0's watcher, written from each lane's thread and the main one."""

    def __init__(self, conn: Connection, rank: int):
        self.conn, self.rank, self.lock = conn, rank, threading.Lock()

    def send(self, kind: str, text: str = "") -> None:
        with self.lock:
            try:
                self.conn.send_bytes(json.dumps([kind, self.rank, text, time.time()]).encode())
            except OSError:
                pass  # rank 0 is gone: nobody to tell

    def fail(self, where: str) -> None:
        self.send("error", f"in {where}:\n{traceback.format_exc()}")
        os._exit(1)


class _Mirror:
    def __init__(self, runner, rank: int):
        self.runner = runner
        self.step_times = StepTimes.from_env(runner, rank)  # None outside benchmarks
        self.received = 0.0  # when the call being run reached this rank (perf_counter)
        self.seqs = SequenceMirror()
        self.finished = {lane: 0 for lane in parallel_state.LANES}
        self.changed = threading.Condition()
        self.promoting: list[tuple[object, set[int]]] = []  # CUDA: (event, seq_ids) of promotions still copying

    def serve(self, lane: str, conn: Connection, reporter: _Reporter) -> None:
        other = "host" if lane == "device" else "device"
        doing = f"waiting for a {lane}-lane call"
        try:
            with parallel_state.lane(lane):
                while (call := decode_call(conn.recv_bytes())) is not STOP:
                    doing, received = f"a {lane}-lane call ({call.method})", time.perf_counter()
                    with self.changed:
                        self.changed.wait_for(lambda: self.finished[other] >= call.after)
                    self.seqs.forget(call.gone)  # once `after` is met: no call still to run here carries them
                    if lane == "device":
                        self.received = received
                    getattr(self, call.method)(*call.args)
                    with self.changed:
                        self.finished[lane] += 1
                        self.changed.notify_all()
                    if call.reply:
                        conn.send_bytes(b"done")
        except EOFError:
            os._exit(1)  # rank 0 is gone
        except BaseException:  # noqa: BLE001 - whatever it is, rank 0 must hear of it
            reporter.fail(doing)

    def prefill(self, seqs) -> None:
        self.runner.prefill(self.seqs.unpack_seqs(seqs))

    def decode_host(self, seqs, streamed=None) -> None:
        self.runner.decode_host(self.seqs.unpack_seqs(seqs), streamed)

    def launch_device_decode(self, seqs) -> None:
        replays = self.step_times.replays() if self.step_times else 0
        seqs = self.seqs.unpack_seqs(seqs)
        self._after_own_promotions(seqs)
        self.runner.launch_device_decode(seqs)
        if self.step_times:
            self.step_times.note(len(seqs), self.received, replays)

    def promote(self, moves) -> None:
        moves = self.seqs.unpack_moves(moves)
        landed = self.runner.promote(moves)
        if landed is not None:
            self.promoting.append((landed, {getattr(item, "seq", item).seq_id for item, _ in moves}))

    def demote(self, moves) -> None:
        self.runner.demote(self.seqs.unpack_moves(moves))

    def check_host_writes(self, wait: bool) -> None:
        self.runner.check_host_writes(wait)

    def drain_host_work(self) -> None:
        self.runner.drain_host_work()

    def forget_device_step(self) -> None:
        self.runner.forget_device_step()

    def _after_own_promotions(self, seqs) -> None:
        """Rank 0 keeps promoted rows out of steps until *its* copy has landed; this rank's may not have. The device
        lane's stream waits for it, on the device, before the first step with one of those rows."""
        rows = {seq.seq_id for seq in seqs}
        pending = []
        for landed, moved in self.promoting:
            if moved & rows:
                self.runner.streams["device"].wait_event(landed)
            elif not landed.query():
                pending.append((landed, moved))
        self.promoting = pending


def worker_main(rank: int, size: int, spec_json: str, lanes: dict[str, Connection], report: Connection) -> None:
    """A spawned worker (rank 0's child): its pipes are handed to it; it exits once its parent has gone."""
    spec = WorkerSpec.from_json(spec_json)
    threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    _serve(rank, size, spec, spec.device(rank), lanes, _Reporter(report, rank), spec.store_path)


def launched_worker_main(launch) -> None:
    """A launched worker (launch.Launch, rank >= 1): connects to rank 0, takes its spec, serves; never returns. Its
    GPU is cuda:LOCAL_RANK (the CPU where rank 0's device is the CPU)."""
    from offload_engine.distributed.launch import connect, rendezvous_store
    from offload_engine.distributed.workers import START_TIMEOUT

    store = rendezvous_store(launch, START_TIMEOUT)
    conns = connect(launch, store, START_TIMEOUT)
    spec = WorkerSpec.from_json(conns["device"].recv_bytes().decode())  # rank 0's first message on the lane
    device = spec.cfg.torch_device
    device = device if device.type == "cpu" else torch.device("cuda", launch.local_rank)
    _serve(launch.rank, launch.size, spec, device, {lane: conns[lane] for lane in parallel_state.LANES},
           _Reporter(conns["report"], launch.rank), dist.PrefixStore(parallel_state.STORE_PREFIX, store))


def _serve(rank: int, size: int, spec: WorkerSpec, device: torch.device, lanes: dict[str, Connection],
           reporter: "_Reporter", store) -> None:
    """Joins the ranks, builds this rank's runner, serves both lanes until rank 0 stops them, and ends the process."""
    try:
        from offload_engine.engine.runner.model_runner import ModelRunner

        if device.type == "cuda":
            torch.cuda.set_device(device)  # this process's only GPU: NCCL and the allocator default to it
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel_state.ranks_on_this_host(size)))
        reporter.send("joining")
        parallel_state.init(rank, size, device, store, spec.dtype)
        with parallel_state.lane("device"):
            model_cfg = ModelConfig.from_model_dir(spec.model_dir)
            runner = ModelRunner(spec.model_dir, model_cfg, dataclasses.replace(spec.cfg, device=str(device)),
                                 spec.dtype, spec.max_model_len, tp=Partition(rank, size))
    except BaseException:  # noqa: BLE001
        reporter.fail("start-up")
    mirror = _Mirror(runner, rank)
    threads = [threading.Thread(target=mirror.serve, args=(lane, conn, reporter), name=f"tp{rank}-{lane}-lane")
               for lane, conn in lanes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if mirror.step_times:
            mirror.step_times.write()
        runner.close()
        reporter.send("stopped")  # every collective of this rank is done: rank 0 may leave the groups
        parallel_state.destroy()
    except BaseException:  # noqa: BLE001
        reporter.fail("shutdown")
    # Everything the process holds is released: it ends here rather than tear down its interpreter (torch's takes
    # most of a second, which rank 0's close would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """Ends the process once rank 0's process has gone, however it went (its finalizers may never have run)."""
    wait([parent_process().sentinel])
    os._exit(1)
