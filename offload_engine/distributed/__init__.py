"""Tensor parallelism: one process per rank, rank 0's engine driving the other ranks' runners call for call.

- parallel_state.py: which slice of the model a process holds (Partition), and one process group per engine lane.
- wire.py: the snapshot of a sequence that crosses to the workers.
- workers.py: the worker processes (ranks 1..N-1): start, the lanes' channels, failures, shutdown.
- tp_runner.py: rank 0's runner, ModelRunner's interface to the engine, mirroring every call to the workers.

The layers split themselves by the Partition they are built with (layers/linear.py, layers/embedding.py), and the
loader reads only a rank's slices (loader.py).
"""


def make_runner(model_dir: str, model_cfg, cfg, dtype, max_model_len: int):
    """The engine's runner: a ModelRunner for one rank (exactly the single-process engine), else rank 0's
    TensorParallelRunner, which starts and drives the others."""
    if cfg.tensor_parallel_size == 1:
        from offload_engine.engine.runner.model_runner import ModelRunner

        return ModelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
    from offload_engine.distributed.tp_runner import TensorParallelRunner

    return TensorParallelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
