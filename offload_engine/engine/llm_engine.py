"""The step loop: schedule -> run the model -> postprocess, until every request has finished."""
import time
from dataclasses import dataclass

from offload_engine.config import EngineConfig, ModelConfig
from offload_engine.engine.block_manager import BlockManager
from offload_engine.engine.model_runner import ModelRunner
from offload_engine.engine.placement import can_ever_fit
from offload_engine.engine.scheduler import Scheduler
from offload_engine.engine.sequence import Sequence


@dataclass
class StepStats:
    is_prefill: bool
    num_tokens: int  # prompt tokens computed (prefill) or tokens generated (decode)
    seconds: float
    finished: list[Sequence]


class LLMEngine:
    def __init__(self, model_dir: str, model_cfg: ModelConfig, cfg: EngineConfig, dtype, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
        self.blocks = BlockManager(self.runner.num_gpu_blocks, cfg.block_size, self.runner.num_cpu_blocks,
                                   cfg.cpu_block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.kv_placement, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   max_model_len, eos_token_ids)

    def make_sequence(self, token_ids: list[int], params) -> Sequence:
        """A sequence for the request, or ValueError if no pool it may use could ever hold it."""
        budget = min(len(token_ids) + params.max_tokens, self.max_model_len)
        seq = Sequence(token_ids, params, budget)
        if not can_ever_fit(seq, self.cfg.kv_placement, self.blocks):
            raise ValueError(
                f"a request of {len(token_ids)} prompt + {params.max_tokens} new tokens needs more KV blocks than "
                f"kv_placement={self.cfg.kv_placement!r} has (device pool: {self.runner.num_gpu_blocks} blocks of "
                f"{self.cfg.block_size}, host pool: {self.runner.num_cpu_blocks} blocks of {self.cfg.cpu_block_size}): "
                "raise num_gpu_blocks / num_cpu_blocks, use kv_placement='auto', or lower max_tokens")
        return seq

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepStats:
        start = time.perf_counter()
        batch, is_prefill = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler found no runnable work although requests are pending")
        token_ids = self.runner.run(batch, is_prefill)
        num_tokens = sum(s.num_scheduled_tokens for s in batch) if is_prefill else len(batch)
        finished = self.scheduler.postprocess(batch, token_ids)
        return StepStats(is_prefill, num_tokens, time.perf_counter() - start, finished)

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)

    def close(self) -> None:
        self.runner.close()
