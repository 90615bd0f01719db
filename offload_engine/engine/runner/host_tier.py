"""A runner's host tier: the pinned host KV pool and the executor that runs the CPU kernels over it, sized for the
runner's model slice and placement (docs/design.md, "The runner").
"""
from cpu_attention.kv_pool import HostKVPool, host_pool_blocks
from offload_engine.distributed.parallel_state import ranks_on_this_host


def make_host_tier(runner) -> tuple:
    """(num_cpu_blocks, host_pool, executor) for `runner`: another runner's where it shares one (the prefill lane's
    `host_tier`), none where its placement and sizes ask for no host tier."""
    if runner.shared_host_tier is not None:
        return runner.shared_host_tier
    cfg = runner.cfg
    if cfg.kv_placement == "gpu" and not (cfg.num_cpu_blocks or cfg.cpu_kv_cache_gb):
        return 0, None, None
    from cpu_attention.executor import CpuAttentionExecutor, host_threads

    size = cfg.cpu_block_size
    # Counted in the whole model's bytes: every rank holds the same blocks, each with its share of the heads,
    # so cpu_kv_cache_gb and the cap on spare memory are for all ranks together, as with one.
    blocks = runner.agreed(host_pool_blocks(runner.block_bytes(size) * runner.tp.size, cfg.num_cpu_blocks,
                                            cfg.cpu_kv_cache_gb, runner.wanted_blocks(size)))
    shape = runner.model_cfg
    # numba compiles this dtype's kernels on the executor's thread now, joined once the weights are in.
    executor = CpuAttentionExecutor(num_threads=host_threads(ranks_on_this_host(runner.tp.size)),
                                    dtypes=(runner.dtype,))
    pool = HostKVPool(shape.num_layers, blocks, shape.num_kv_heads, size, shape.head_dim, runner.dtype,
                      pin_device=runner.device if runner.device.type == "cuda" else None)
    return blocks, pool, executor
