"""Rank 0's handle on the worker processes (docs/decisions/multi-gpu.md): per worker a pipe per lane (its calls in
order, the answers to those that ask) and a report pipe a watcher thread reads. Every wait has a timeout. Workers are
spawned (a script that makes a TP LLM must guard its top level with `if __name__ == "__main__":`), or started by a
launcher beside rank 0 (launch.py), when their pipes are connections over TCP."""
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch.distributed as dist

from offload_engine.distributed import parallel_state
from offload_engine.distributed.wire import Call, encode_call
from offload_engine.distributed.worker import WorkerSpec, worker_main

START_TIMEOUT = 600.0  # seconds for a worker to import torch and reach the rendezvous (a busy host is slow)
REPLY_TIMEOUT = 600.0  # for an answer: a drain may wait for host kernels of long sequences
STOP_TIMEOUT = 60.0  # for a worker to release its pools and threads and exit
BLAME_GRACE = 5.0  # a collective of rank 0 failed: this long for the failed worker's own report to arrive
# NVLink multicast (NVLS) stays off on the GPU hosts (KINDS.md); set in rank 0's environment, which workers inherit.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(RuntimeError):
    """A worker rank failed or died: the tensor-parallel engine cannot go on; close it and make a new LLM."""


class _Health:
    """What the watcher has heard: workers joining, stopped or ended, and failures (time, rank, text). Once rank 0
    is stopping the workers, their failures no longer count."""

    def __init__(self):
        self.changed = threading.Condition()
        self.joining, self.stopped, self.ended, self.failures = set(), set(), set(), []
        self.stopping = False

    def note(self, kind: str, rank: int, text: str, when: float) -> None:
        with self.changed:
            if kind in ("joining", "stopped", "ended"):
                getattr(self, kind).add(rank)
            elif not self.stopping:
                self.failures.append((when, rank, text))
                parallel_state.abort()
            self.changed.notify_all()

    def error(self) -> "WorkerError | None":
        """The first failure, as the exception rank 0 raises; None while every worker is well."""
        if not self.failures:
            return None
        _, rank, text = min(self.failures)
        return WorkerError(f"tensor-parallel rank {rank} failed {text.strip()}\nThe engine cannot go on: close this "
                           "LLM and make a new one")

    def wait_for(self, done, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: done() or self.failures, timeout)


class WorkerGroup:
    def __init__(self, size: int, spec_args: dict, launch=None):
        """launch: this process's launch.Launch where a launcher started the ranks; None spawns them."""
        os.environ.update(MULTICAST_OFF)
        self.size = size
        self.store_dir = tempfile.mkdtemp(prefix="offload-engine-tp-")
        self.spec = WorkerSpec(**spec_args, store_path=os.path.join(self.store_dir, "rendezvous"))
        self.rendezvous = self.spec.store_path  # where rank 0 meets the workers' process group (parallel_state.init)
        self.health = _Health()
        context = multiprocessing.get_context("spawn")
        self.lanes = {lane: [] for lane in parallel_state.LANES}
        self.reports, self.processes = [], []
        self._wake_read, self._wake = context.Pipe(duplex=False)  # ends the watcher
        # Dropped unclosed (or half made), or at interpreter exit: the workers and the watcher still go.
        self._finalizer = weakref.finalize(self, _release, self.processes, self.store_dir, self._wake, 0.0)
        if launch is None:
            self._spawn(context)
        else:
            self._attach(launch)
        self._watcher = threading.Thread(target=_watch, name="tp-watcher", daemon=True,
                                         args=(self.health, dict(enumerate(self.reports, 1)),
                                               dict(enumerate(self.processes, 1)), self._wake_read))
        self._watcher.start()

    def _spawn(self, context) -> None:
        size = self.size
        for rank in range(1, size):
            ends = {lane: context.Pipe() for lane in parallel_state.LANES}
            report_read, report_write = context.Pipe(duplex=False)
            process = context.Process(target=worker_main, name=f"offload-engine-tp{rank}", daemon=True,
                                      args=(rank, size, self.spec.to_json(), {lane: pair[1] for lane, pair in ends.items()},
                                            report_write))
            process.start()
            for lane, (ours, theirs) in ends.items():
                theirs.close()
                self.lanes[lane].append(ours)
            report_write.close()
            self.reports.append(report_read)
            self.processes.append(process)

    def _attach(self, launch) -> None:
        """The launched workers connect (launch.py); each gets the spec first on its device lane."""
        from offload_engine.distributed.launch import ControlServer, rendezvous_store

        store = rendezvous_store(launch, START_TIMEOUT)
        self.rendezvous = dist.PrefixStore(parallel_state.STORE_PREFIX, store)
        server = ControlServer(launch, store)
        try:
            found = server.accept(START_TIMEOUT)
        except TimeoutError as error:
            raise WorkerError(str(error)) from None
        finally:
            server.close()
        spec = self.spec.to_json().encode()
        for rank in range(1, self.size):
            found[rank]["device"].send_bytes(spec)
            for lane in parallel_state.LANES:
                self.lanes[lane].append(found[rank][lane])
            self.reports.append(found[rank]["report"])

    def wait_joining(self) -> None:
        """Waits until every worker is about to meet at the rendezvous (they import torch first)."""
        if not self.health.wait_for(lambda: len(self.health.joining) == self.size - 1, START_TIMEOUT):
            raise WorkerError(f"the tensor-parallel workers did not start within {START_TIMEOUT:.0f} s")
        self.check()

    def check(self) -> None:
        error = self.health.error()
        if error is not None:
            raise error

    def blame(self, error: BaseException) -> BaseException:
        """Rank 0's own call failed: where talking to the other ranks (a collective, a pipe), a worker's failure if
        one comes to light within BLAME_GRACE (its report may be on its way); otherwise the error itself."""
        if not isinstance(error, (RuntimeError, ConnectionError, EOFError)):
            return error
        self.health.wait_for(lambda: False, BLAME_GRACE)
        return self.health.error() or error

    def send(self, lane: str, call: Call | None) -> None:
        data = encode_call(call)
        for conn in self.lanes[lane]:
            conn.send_bytes(data)

    def wait_replies(self, lane: str) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        for rank, conn in enumerate(self.lanes[lane], 1):
            while not conn.poll(0.5):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerError(f"tensor-parallel rank {rank} did not answer within {REPLY_TIMEOUT:.0f} s")
            conn.recv_bytes()

    def stop(self, clean: bool) -> None:
        """Tells the workers to stop, and (clean: when all is well) waits until each has said it stopped, so that
        rank 0 may leave the process groups next."""
        with self.health.changed:
            self.health.stopping = True
        for lane in parallel_state.LANES:
            try:
                self.send(lane, None)  # STOP
            except OSError:
                clean = False  # a worker is gone already
        if clean:
            health = self.health
            health.wait_for(lambda: len(health.stopped | health.ended) == self.size - 1, STOP_TIMEOUT)

    def join(self, patience: float = STOP_TIMEOUT) -> None:
        """Joins the processes (terminating any that have not ended within `patience` s), then stops the watcher."""
        self._finalizer.detach()
        _release(self.processes, self.store_dir, self._wake, patience)
        self._watcher.join()
        for conn in (*self.reports, *self.lanes["device"], *self.lanes["host"], self._wake, self._wake_read):
            conn.close()


def _watch(health: _Health, reports: dict, processes: dict, wake) -> None:
    """The watcher thread: reports as they come, and processes that end without having stopped."""
    readers = {conn: rank for rank, conn in reports.items()}
    sentinels = {process.sentinel: rank for rank, process in processes.items()}
    while True:
        for ready in wait([*readers, *sentinels, wake]):
            if ready is wake:
                return
            if ready in readers:
                try:
                    health.note(*json.loads(ready.recv_bytes()))
                except (EOFError, OSError):
                    rank = readers.pop(ready)  # its process has gone: its sentinel says how, if it has one
                    if rank not in processes:  # launched: the closed connection is all rank 0 hears
                        if rank not in health.stopped:
                            health.note("error", rank, "(its connection to rank 0 closed: its process ended)",
                                        time.time())
                        health.note("ended", rank, "", time.time())
            elif ready in sentinels:
                rank = sentinels.pop(ready)
                # Its last report may still be unread: take it first, so the error names the real cause.
                conn = next((c for c, r in readers.items() if r == rank), None)
                while conn is not None and conn.poll():
                    try:
                        health.note(*json.loads(conn.recv_bytes()))
                    except (EOFError, OSError):
                        break
                if rank not in health.stopped:
                    health.note("error", rank, _how_it_ended(processes[rank]), time.time())
                health.note("ended", rank, "", time.time())


def _how_it_ended(process) -> str:
    process.join(1.0)  # its sentinel is ready: it has ended, and is reaped here for its exit code
    code = process.exitcode
    if code is not None and code < 0:
        return f"(its process was killed by {signal.Signals(-code).name})"
    return f"(its process exited with code {code})"


def _release(processes: list, store_dir: str, wake, patience: float) -> None:
    """Gives the processes `patience` s in all to end, then ends them; removes the rendezvous; ends the watcher."""
    deadline = time.monotonic() + patience
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    shutil.rmtree(store_dir, ignore_errors=True)
    try:
        wake.send(None)
    except OSError:
        pass  # closed already
