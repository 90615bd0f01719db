"""The device KV pool: how many blocks (`size_device_pool`, by a memory profile on CUDA) and its layout
(`allocate_device_pool`). docs/design.md, "The runner"; why: docs/decisions/memory.md.
"""
import contextlib

import torch

from offload_engine.engine.graphs.prefill_graphs import paying_prefill_tokens
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.layers.sampler import largest_sampling_step, sample
from offload_engine.sampling_params import SamplingParams

CPU_DEVICE_POOL_BYTES = 1 << 30  # device="cpu": the "device" tier is host memory too; keep it modest


def size_device_pool(runner) -> int:
    """Blocks for the device pool: num_gpu_blocks if set, else what the device has room for, at most wanted_blocks."""
    cfg = runner.cfg
    if cfg.num_gpu_blocks is not None:
        return cfg.num_gpu_blocks
    block_bytes, wanted = runner.block_bytes(cfg.block_size), runner.wanted_blocks(cfg.block_size)
    if runner.device.type == "cpu":
        return max(1, min(wanted, CPU_DEVICE_POOL_BYTES // block_bytes))
    blocks = (profile_free_kv_bytes(runner) - stream_staging_bytes(runner)) // block_bytes
    if blocks < 1:
        raise ValueError("no GPU memory is left for the KV cache after the model and its activations: raise "
                         "gpu_memory_utilization, lower max_num_batched_tokens, or set num_gpu_blocks")
    return min(blocks, wanted)


def stream_capacity_blocks(runner) -> int:
    """Host blocks a host step may stream per layer (docs/design.md, "Streaming host KV"): what stream_staging_gb
    holds, double-buffered, K and V, where the device reads the pinned pool in place; 0 where streaming is off
    (stream_host_kv=False, no host tier). On a CPU device the staging is made per step, and every
    host block may stream (tests pin the share; nothing is measured there to choose one)."""
    cfg = runner.cfg
    if not cfg.stream_host_kv or runner.host_pool is None:
        return 0
    if runner.device.type == "cpu":
        return runner.num_cpu_blocks
    if not runner.host_pool.device_can_address:
        return 0
    from offload_engine.engine.graphs.stream_staging import StreamStaging

    one = StreamStaging.nbytes(runner.model_cfg, cfg.cpu_block_size, 1, runner.dtype)
    return int(cfg.stream_staging_gb * 2**30) // one


def stream_staging_bytes(runner) -> int:
    """The streamed share's staging buffer, which comes out of the KV pool's share of the device."""
    from offload_engine.engine.graphs.stream_staging import StreamStaging

    if runner.device.type == "cpu":
        return 0
    return StreamStaging.nbytes(runner.model_cfg, runner.cfg.cpu_block_size, runner.stream_capacity_blocks,
                                runner.dtype)


def allocate_device_pool(model_cfg, num_blocks: int, block_size: int, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    """Every layer's K and V in one tensor, [L, 2, blocks, block_size, Hkv, D]: moves between the tiers take a
    batch of layers per kernel. Zeroed: a kernel that loads a partial last block whole (flash-attn 4) reads finite
    values past a row's end; later, stale blocks hold earlier rows' finite K/V."""
    shape = (model_cfg.num_layers, 2, num_blocks, block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_views(stacked: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer[0], layer[1]) for layer in stacked]


@torch.inference_mode()
def profile_free_kv_bytes(runner) -> int:
    """Measured on the runner's own device, never the current one: a tensor-parallel rank 0 on cuda:i measures
    cuda:i whatever device the caller's thread has current."""
    cfg, device = runner.cfg, runner.device
    claim_blas_workspaces(runner)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    peak = prefill_peak_bytes(runner, cfg.max_num_batched_tokens)
    # The prefill graphs' pool keeps a prefill at their largest paying bucket for good, beside eager prefills' peak.
    with temporary_device_pool(runner, 1):
        graph_tokens = paying_prefill_tokens(runner)
    graphs = prefill_peak_bytes(runner, graph_tokens) if graph_tokens else 0

    # The sampler's peak, once per decode lane: each samples on its own stream, whose blocks the allocator keeps apart.
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    sample(*largest_sampling_step(cfg.max_num_seqs, runner.model_cfg.vocab_size, device))
    torch.cuda.synchronize(device)
    lanes = 2 if runner.host_pool is not None else 1
    sampler = lanes * (torch.cuda.max_memory_allocated(device) - base)
    torch.cuda.empty_cache()
    return int(total * cfg.gpu_memory_utilization - (total - free) - peak - graphs - sampler)


def claim_blas_workspaces(runner) -> None:
    """Runs one small product on each stream the lanes use, so that cuBLAS makes each stream's workspace (kept for
    the process) now, and the profile counts it as used."""
    from offload_engine.engine.graphs.host_step_graphs import few_sms
    from offload_engine.engine.runner.cuda_streams import engine_stream

    lanes = [("device", False), ("capture-device", False)]
    if runner.host_pool is not None:
        lanes += [("host", False), ("capture-host", True)]  # the host lane's graphs are captured on few SMs
    weight = torch.ones(8, 8, dtype=runner.dtype, device=runner.device)
    for name, narrow in lanes:
        products = few_sms(runner.device) if narrow else contextlib.nullcontext()
        with torch.cuda.stream(engine_stream(runner.device, name)), products:
            torch.nn.functional.linear(weight, weight)
    torch.cuda.synchronize(runner.device)


def prefill_peak_bytes(runner, tokens: int) -> int:
    """Device memory a prefill of `tokens` takes at its peak, besides the weights and its KV."""
    cfg, device = runner.cfg, runner.device
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    seq_len = min(runner.max_model_len, tokens)
    num_seqs = max(1, min(cfg.max_num_seqs, tokens // seq_len))
    with temporary_device_pool(runner, num_seqs * -(-seq_len // cfg.block_size)) as pool_bytes:
        run_dummy_prefill(runner, num_seqs, seq_len)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - allocated_before - pool_bytes


@contextlib.contextmanager
def temporary_device_pool(runner, num_blocks: int):
    """A device pool of num_blocks bound to the model while the block runs (it gets the pool's bytes), for
    measuring before the real pool exists; unbound and freed after."""
    pool = allocate_device_pool(runner.model_cfg, num_blocks, runner.cfg.block_size, runner.dtype, runner.device)
    runner.bind_kv_caches(layer_views(pool), None)
    try:
        yield pool.nbytes
    finally:
        del pool
        runner.bind_kv_caches([(None, None)] * runner.model_cfg.num_layers, None)
        torch.cuda.empty_cache()


@torch.inference_mode()
def run_dummy_prefill(runner, num_seqs: int, seq_len: int) -> None:
    """A prefill of num_seqs sequences of seq_len tokens, their KV written into the first blocks of the bound device
    pool (whatever those held is overwritten) and their logits computed, nothing sampled; before any request."""
    block_size = runner.cfg.block_size
    blocks_per_seq = -(-seq_len // block_size)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence([0] * seq_len, SamplingParams(), budget=seq_len)
        seq.location, seq.num_scheduled_tokens = BlockLocation.GPU, seq_len
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(seq)
    step = runner.inputs.prefill(seqs)
    hidden = runner.model(step.token_ids, step.positions, step.meta)
    runner.model.compute_logits(hidden[step.sample_rows])


def reserve_step_memory(runner) -> None:
    """Runs the largest prefill and a full-batch top-k / top-p sample on each lane's stream, so the allocator holds
    the steps' largest blocks from the start. Before any request: the prefill's KV lands in blocks nobody holds."""
    tokens = min(runner.cfg.max_num_batched_tokens, runner.num_gpu_blocks * runner.cfg.block_size)
    seq_len = min(runner.max_model_len, tokens)
    with torch.cuda.stream(runner.streams["device"]):
        run_dummy_prefill(runner, max(1, min(runner.cfg.max_num_seqs, tokens // seq_len)), seq_len)
    for lane, stream in runner.streams.items():
        if lane == "host" and runner.host_pool is None:
            continue  # no host lane will ever sample
        with torch.cuda.stream(stream), torch.inference_mode():
            sample(*largest_sampling_step(runner.cfg.max_num_seqs, runner.model_cfg.vocab_size, runner.device))
        stream.synchronize()
