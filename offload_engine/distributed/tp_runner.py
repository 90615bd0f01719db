"""Rank 0's runner under tensor parallelism: each call that changes a rank's state goes to every worker on its lane's
channel, then runs on rank 0's ModelRunner; rank 0's result is everyone's. After any failure every later call raises
(docs/design.md, "More than one GPU", with its limits)."""
import torch.distributed as dist

from offload_engine.distributed import parallel_state
from offload_engine.distributed.launch import launched_rank
from offload_engine.distributed.parallel_state import Partition
from offload_engine.distributed.wire import Call, SequenceSender
from offload_engine.distributed.workers import STOP_TIMEOUT, WorkerError, WorkerGroup
from offload_engine.engine.runner.model_runner import ModelRunner


class TensorParallelRunner:
    # Rank 0's event says nothing of the other ranks' copies: each rank's demotion stays in front of its next step.
    demotes_beside_device_lane = False

    def __init__(self, model_dir: str, model_cfg, cfg, dtype, max_model_len: int):
        if dist.is_available() and dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs torch.distributed to itself, but this process already "
                             "has a process group (another tensor-parallel LLM still open, or your own): "
                             "close it first")
        size = cfg.tensor_parallel_size
        self.runner = self.workers = None
        self.broken: BaseException | None = None  # set by the first failure: the ranks may be out of step
        self.closed = False
        self.finished = {lane: 0 for lane in parallel_state.LANES}  # calls rank 0 has finished, per lane
        self.sender = SequenceSender()  # what each worker's mirror holds of every sequence
        try:
            self.workers = WorkerGroup(size, dict(model_dir=model_dir, cfg=cfg, dtype=dtype,
                                                  max_model_len=max_model_len), launched_rank(size))
            self.workers.wait_joining()
            parallel_state.init(0, size, cfg.torch_device, self.workers.rendezvous, dtype)
            with parallel_state.lane("device"):  # its start-up collectives pair with the workers' (worker.py)
                self.runner = ModelRunner(model_dir, model_cfg, cfg, dtype, max_model_len, tp=Partition(0, size))
        except BaseException as error:
            self.broken = error
            blamed = self.workers.blame(error) if self.workers is not None else error
            self.close()
            if blamed is error:
                raise
            raise blamed from error

    def __getattr__(self, name: str):
        """Read-only state and questions about it (num_gpu_blocks, host_writes_pending, ...): rank 0's own."""
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def prefill(self, seqs):
        return self._step("prefill", "device", seqs)

    def decode_host(self, seqs, streamed: list[int] | None = None):
        """streamed: per row, the leading host blocks its step streams (every rank streams its heads' share)."""
        extra = () if streamed is None else (list(streamed),)
        return self._mirror("host", self._call("decode_host", "host", self.sender.pack_seqs(seqs), *extra),
                            lambda: self.runner.decode_host(seqs, streamed))

    def launch_device_decode(self, seqs):
        return self._step("launch_device_decode", "device", seqs)

    def forget_device_step(self) -> None:
        """LLMEngine.abort: the device lane's step in flight is dropped on every rank (after a failure, rank 0's)."""
        if self.broken is not None:
            return self.runner.forget_device_step()
        self._mirror("device", self._call("forget_device_step", "device"), self.runner.forget_device_step)

    def _step(self, method: str, lane: str, seqs):
        return self._mirror(lane, self._call(method, lane, self.sender.pack_seqs(seqs)),
                            lambda: getattr(self.runner, method)(seqs))

    def promote(self, moves):
        return self._mirror("device", self._call("promote", "device", self.sender.pack_moves(moves)),
                            lambda: self.runner.promote(moves))

    def demote(self, moves) -> None:
        return self._mirror("device", self._call("demote", "device", self.sender.pack_moves(moves)),
                            lambda: self.runner.demote(moves))

    def check_host_writes(self, wait: bool = False) -> None:
        """With wait (the end of a generate call): also every worker's writes, and every worker is heard from."""
        self._mirror("device", self._call("check_host_writes", "device", wait, reply=wait),
                     lambda: self.runner.check_host_writes(wait))

    def drain_host_work(self) -> None:
        """LLMEngine.abort: every rank's host work is let finish. After a failure, rank 0's alone."""
        if self.broken is not None:
            return self.runner.drain_host_work()
        self._mirror("device", self._call("drain_host_work", "device", reply=True),
                     self.runner.drain_host_work)

    def _call(self, method: str, lane: str, *args, reply: bool = False) -> Call:
        """The call for the workers, with the seq_ids rank 0 has dropped. Those are taken before `after` is read: a
        sequence is collected only once every call that carried it has finished here, so `after` counts them."""
        gone = self.sender.take_gone()
        return Call(method, args, self.finished[_other(lane)], reply, gone)

    def _mirror(self, lane: str, call: Call, local):
        if self.broken is not None:
            first = (str(self.broken).splitlines() or [""])[0]
            raise WorkerError(f"this tensor-parallel engine stopped after an error ({type(self.broken).__name__}: "
                              f"{first}): close this LLM and make a new one")
        try:
            self.workers.check()
            self.workers.send(lane, call)
            with parallel_state.lane(lane):
                result = local()
            if call.reply:
                self.workers.wait_replies(lane)
            self.workers.check()  # a worker that failed in a call without a collective
        except WorkerError as error:
            self.broken = error
            raise
        except BaseException as error:
            self.broken = error
            blamed = self.workers.blame(error)
            if blamed is error:
                raise
            raise blamed from error
        self.finished[lane] += 1
        return result

    def close(self) -> None:
        """Stops the workers, releases rank 0's runner, leaves the process groups. Idempotent; after a failure too.
        The engine has stopped its host lane first."""
        if self.closed:
            return
        self.closed = True
        clean = self.broken is None
        if self.workers is not None:
            self.workers.stop(clean)
        if self.runner is not None:
            self.runner.close()
        parallel_state.destroy()
        if self.workers is not None:
            # After a failure a worker may be stuck in a collective with a rank that has gone: not waited for long.
            self.workers.join(patience=STOP_TIMEOUT if clean else 5.0)


def _other(lane: str) -> str:
    return "host" if lane == "device" else "device"
