"""Sizes the device KV pool from the memory left after the model's own peak (CUDA only).

A warmup prefill of the largest batch the scheduler can form runs through a temporary pool; what the model,
its activations and the sampler (a full batch, once per lane) take at their peak, plus everything else
already on the card, is subtracted from total memory x gpu_memory_utilization. The rest is the KV pool.
"""
import torch

from offload_engine.engine.model_runner import layer_views
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.layers.sampler import largest_sampling_step, sample
from offload_engine.sampling_params import SamplingParams


@torch.inference_mode()
def profile_free_kv_bytes(runner) -> int:
    cfg = runner.cfg
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()

    seq_len = min(runner.max_model_len, cfg.max_num_batched_tokens)
    num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // seq_len))
    pool = runner.allocate_device_pool(num_seqs * -(-seq_len // cfg.block_size))
    pool_bytes = pool.nbytes
    runner.bind_kv_caches(layer_views(pool), None)
    run_dummy_prefill(runner, num_seqs, seq_len)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - allocated_before - pool_bytes
    del pool
    runner.bind_kv_caches([(None, None)] * runner.model_cfg.num_layers, None)
    torch.cuda.empty_cache()

    # The sampler's peak for a full batch, once per decode lane: each lane samples on its own stream, and the
    # caching allocator keeps each stream's blocks apart (ModelRunner._reserve_step_memory).
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sample(*largest_sampling_step(cfg.max_num_seqs, runner.model_cfg.vocab_size, runner.device))
    torch.cuda.synchronize()
    lanes = 2 if runner.host_pool is not None else 1
    sampler = lanes * (torch.cuda.max_memory_allocated() - base)
    torch.cuda.empty_cache()
    return int(total * cfg.gpu_memory_utilization - (total - free) - peak - sampler)


@torch.inference_mode()
def run_dummy_prefill(runner, num_seqs: int, seq_len: int) -> None:
    """One prefill of num_seqs sequences of seq_len tokens through the model, their KV written into the first
    blocks of the bound device pool, and their logits computed (nothing sampled). For sizing and reserving
    memory before any request exists: whatever those blocks held is overwritten."""
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
