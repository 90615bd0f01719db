"""Tensor parallelism: one process per rank, rank 0's engine driving the other ranks' runners call for call
(docs/decisions/multi-gpu.md). parallel_state.py: a process's slice of the model (Partition) and one process group per
engine lane; wire.py: the sequences that cross to the workers; workers.py and worker.py: the worker processes;
tp_runner.py: rank 0's runner, mirroring every call. The layers split themselves by their Partition
(layers/linear.py, layers/embedding.py); the loader reads only a rank's slices (loader.py).
"""


def make_runner(model_dir: str, model_cfg, cfg, dtype, max_model_len: int):
    """The engine's runner: a ModelRunner for one rank (exactly the single-process engine), else rank 0's
    TensorParallelRunner, which starts and drives the others."""
    if cfg.tensor_parallel_size == 1:
        from offload_engine.engine.runner.model_runner import ModelRunner

        return ModelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
    from offload_engine.distributed.tp_runner import TensorParallelRunner

    return TensorParallelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
