"""Tensor parallelism: one process per rank, rank 0's engine driving the other ranks' runners call for call
(docs/design.md, "More than one GPU"; docs/decisions/multi-gpu.md). The layers split by their Partition."""


def make_runner(model_dir: str, model_cfg, cfg, dtype, max_model_len: int):
    """A ModelRunner for one rank, else rank 0's TensorParallelRunner, which starts and drives the others."""
    if cfg.tensor_parallel_size == 1:
        from offload_engine.engine.runner.model_runner import ModelRunner

        return ModelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
    from offload_engine.distributed.tp_runner import TensorParallelRunner

    return TensorParallelRunner(model_dir, model_cfg, cfg, dtype, max_model_len)
